#!/bin/sh
# The image's HEALTHCHECK (deploy/image/Containerfile): probes the daemon that
# this container runs, read from PID 1's command line, so one image serves
# every role without a setting per role.
#
#   kvdir directory serve  kvdir ctl wait-ready (grpc.health.v1 SERVING: knows a leader)
#   kvdir agent serve      kvdir ctl wait-ready --agent (connected to the directory)
#   kvdir gateway          GET /health (200: at least one healthy backend)
#   anything else          healthy (a one-shot command has nothing to probe)
#
# The address is the command's --grpc / --listen flag, else its --config file's.
# KVDIR_HEALTHCHECK_TIMEOUT_S (default 5) bounds one probe; KVDIR_HEALTHCHECK_FLAGS
# is appended to wait-ready (TLS: --ca ... --cert ... --key ..., docs/security.md).
set -eu

timeout_s="${KVDIR_HEALTHCHECK_TIMEOUT_S:-5}"

# PID 1's argv, one argument per line (an argument holding a newline would split).
args="$(tr '\0' '\n' < /proc/1/cmdline)"
IFS='
'
# shellcheck disable=SC2086 # split on newlines only, on purpose
set -- $args
unset IFS

# Skip the interpreter (the kvdir script is Python) up to the kvdir command itself.
while [ "$#" -gt 0 ] && [ "${1##*/}" != kvdir ]; do shift; done
[ "$#" -gt 0 ] || { echo "kvdir-healthcheck: PID 1 is not kvdir: $args" >&2; exit 1; }
shift
role="${1:-}"
[ "$#" -gt 0 ] && shift
if [ "$role" != gateway ]; then
  sub="${1:-}"
  [ "$sub" = serve ] || exit 0 # not a daemon
  shift
fi

config="" addr=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --config=*) config="${1#*=}" ;;
    --config) config="${2:-}"; [ "$#" -gt 1 ] && shift ;;
    --grpc=* | --listen=*) addr="${1#*=}" ;;
    --grpc | --listen) addr="${2:-}"; [ "$#" -gt 1 ] && shift ;;
  esac
  shift
done
# A wildcard listener is probed on loopback.
case "$addr" in
  0.0.0.0:*) addr="127.0.0.1:${addr#0.0.0.0:}" ;;
  "[::]:"*) addr="[::1]:${addr#\[::\]:}" ;;
esac

case "$role" in
  directory) agent_flag="" ;;
  agent) agent_flag="--agent" ;;
  gateway)
    exec python3 - "$addr" "$config" "$timeout_s" <<'EOF'
import sys, tomllib, urllib.error, urllib.request

addr, config, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
tls = False
if config:
    with open(config, "rb") as f:
        raw = tomllib.load(f)
    addr = addr or str(raw.get("listen", ""))
    tls = bool(raw.get("tls_cert"))
if not addr:
    sys.exit("kvdir-healthcheck: the gateway's --listen is not known")
host, _, port = addr.rpartition(":")
host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
scheme = "https" if tls else "http"
try:
    import ssl

    ctx = ssl.create_default_context() if tls else None
    if ctx is not None:  # its certificate names the public name, not loopback
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"{scheme}://{host}:{port}/health", timeout=timeout_s, context=ctx):
        pass
except (OSError, urllib.error.URLError) as e:
    sys.exit(f"kvdir-healthcheck: gateway {addr}: {e}")
EOF
    ;;
  *) exit 0 ;;
esac

set -- --timeout "$timeout_s"
if [ -n "$addr" ]; then
  set -- "$@" --addr "$addr"
elif [ -n "$config" ]; then
  set -- "$@" --config "$config"
fi
# shellcheck disable=SC2086 # the extra flags are words
exec kvdir ctl wait-ready $agent_flag "$@" ${KVDIR_HEALTHCHECK_FLAGS:-}
