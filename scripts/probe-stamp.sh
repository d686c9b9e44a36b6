# Sourced by the venv install scripts: a venv that passed its import probe is not probed
# again (importing vLLM takes 20-30 s on a busy 2-core host, three venvs per `make test`)
# until its site-packages folder changes (pip adds or removes an entry there on every
# install). The stamp holds the probe text and that folder's mtime.

probe_key() { # DEST PROBE
  local site
  site=$(compgen -G "$1/lib/python3*/site-packages" | head -n1) || return 1
  printf '%s\n%s\n' "$2" "$(stat -c %Y "$site")"
}

probe_is_stamped() { # DEST PROBE: true when the stamp matches the venv as it is now
  [[ -x $1/bin/python && -f $1/.kvdir-probed ]] || return 1
  [[ $(cat "$1/.kvdir-probed") == "$(probe_key "$1" "$2")" ]]
}

probe_stamp() { # DEST PROBE: record a probe that just passed
  probe_key "$1" "$2" >"$1/.kvdir-probed"
}
