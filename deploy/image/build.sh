#!/usr/bin/env bash
# Builds the kvdir container image offline: `make image` (docs/operations.md,
# "Container image"). Nothing is pulled from a container registry.
#
#   1. base: a Debian root filesystem made with mmdebstrap from this host's apt
#      sources (the essential set, python3, libstdc++6), imported as
#      localhost/kvdir-base:KEY. The tarball is cached under $KVDIR_IMAGE_CACHE,
#      KEY a hash of the recipe and of every package version it resolves to,
#      so a Debian point release builds a new one.
#   2. wheels: kvdir's, built from this checkout (tracked and untracked files,
#      not ignored ones), plus its pinned dependencies' and pip's (cached, keyed
#      on the dependency list and the Python version).
#   3. podman build of deploy/image/Containerfile, --network=none --pull=never.
#
# Environment: IMAGE (default localhost/kvdir:VERSION), PYTHON (a Python 3.11,
# like the image's, whose pip builds the wheels; default python3), PODMAN
# (default podman), KVDIR_IMAGE_CACHE (default ~/.cache/kvdir/image).
# Podman's own settings come from its usual files or CONTAINERS_CONF /
# CONTAINERS_STORAGE_CONF (tests/image writes both).
# Prints the image reference, then its id, on stdout; progress goes to stderr.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
PODMAN="${PODMAN:-podman}"
CACHE="${KVDIR_IMAGE_CACHE:-$HOME/.cache/kvdir/image}"

BASE_RECIPE=1 # bump when the mmdebstrap command below changes
SUITE=bookworm
IMAGE_PYTHON=3.11 # bookworm's python3: the dependency wheels are cp311
BASE_PACKAGES=(python3 libstdc++6) # libstdc++6: grpcio's extension links it
MMDEBSTRAP_ARGS=(
  --variant=essential
  # merged /usr without the usrmerge package (which would pull in perl)
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --dpkgopt=path-exclude=/usr/share/doc/*
  --dpkgopt=path-exclude=/usr/share/man/*
  --dpkgopt=path-exclude=/usr/share/locale/*
  --dpkgopt=path-exclude=/usr/share/info/*
)

log() { printf "[kvdir-image %3ds] %s\n" "$SECONDS" "$*" >&2; }
die() { log "error: $*"; exit 1; }
sha() { sha256sum | cut -c1-16; }

check_tools() {
  local t missing=()
  for t in "$PODMAN" mmdebstrap apt-cache dpkg-query git "$PYTHON"; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  ((${#missing[@]} == 0)) || die "missing: ${missing[*]} (apt-get install --no-install-recommends podman runc catatonit mmdebstrap)"
  local v
  # shellcheck source=/dev/null
  v="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
  [[ "$v" == "$SUITE" ]] || die "this host is Debian '$v', the base is built for $SUITE from its apt sources"
  v="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [[ "$v" == "$IMAGE_PYTHON" ]] || die "$PYTHON is Python $v; the image's is $IMAGE_PYTHON and its wheels must match (PYTHON=python$IMAGE_PYTHON)"
}

# The cache keeps one base and one wheel set (about 100 MB and 150 MB): the current ones.
prune() {
  local pattern="$1" keep="$2" f
  for f in "$CACHE"/$pattern; do
    [[ -e "$f" && "${f##*/}" != "$keep" && "${f##*/}" != *build.* ]] || continue
    rm -rf "$f" "${f%.tar}.versions"
  done
}

# ---------------------------------------------------------------- 1. base

apt_sources() {
  local f
  if [[ -f /etc/apt/sources.list ]] && grep -qE '^[[:space:]]*deb' /etc/apt/sources.list; then
    echo /etc/apt/sources.list
  fi
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] && echo "$f"
  done
}

# Every package the base resolves to (the essential set, the packages named and
# their dependencies) with its candidate version: what the cache key covers.
base_versions() {
  local names
  names="$(
    {
      # the essential set, as installed here (this host is a bookworm too: check_tools)
      dpkg-query -W -f '${Package} ${Essential}\n' | awk '$2 == "yes" {print $1}'
      apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances "${BASE_PACKAGES[@]}" | grep -v '^ ' | grep -v '^<'
    } | sort -u
  )"
  # shellcheck disable=SC2086 # one package name per word
  apt-cache policy $names | awk '/^[^ ]/ {p = $1} /Candidate:/ {print p, $2}'
}

base_tarball() {
  local versions key tar tmp
  versions="$(base_versions)"
  [[ -n "$versions" ]] || die "apt knows no versions (run apt-get update)"
  key="$(printf '%s\n' "$BASE_RECIPE" "$SUITE" "${BASE_PACKAGES[*]}" "${MMDEBSTRAP_ARGS[*]}" "$versions" | sha)"
  tar="$CACHE/base-$key.tar"
  if [[ ! -f "$tar" ]]; then
    mkdir -p "$CACHE"
    tmp="$(mktemp "$CACHE/base-build.XXXXXX.tar")"
    log "building the base root filesystem $key (mmdebstrap)"
    local sources
    mapfile -t sources < <(apt_sources)
    ((${#sources[@]})) || die "this host has no apt sources to bootstrap from"
    if ! mmdebstrap --quiet "${MMDEBSTRAP_ARGS[@]}" --include="$(IFS=,; echo "${BASE_PACKAGES[*]}")" \
      "$SUITE" "$tmp" "${sources[@]}" >&2; then
      rm -f "$tmp"
      die "mmdebstrap failed"
    fi
    printf '%s\n' "$versions" > "$CACHE/base-$key.versions"
    mv "$tmp" "$tar"
    prune "base-*.tar" "base-$key.tar"
  fi
  echo "$key"
}

base_image() {
  local key="$1" ref="localhost/kvdir-base:$1"
  if ! "$PODMAN" image exists "$ref"; then
    log "importing $ref"
    "$PODMAN" import --quiet "$CACHE/base-$key.tar" "$ref" >/dev/null
  fi
  echo "$ref"
}

# ---------------------------------------------------------------- 2. wheels

dependencies() {
  "$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$REPO/pyproject.toml"
}

dependency_wheels() {
  local deps pip_version key dest tmp
  deps="$(dependencies)"
  pip_version="$("$PYTHON" -m pip --version | awk '{print $2}')"
  key="$(printf '%s\n' "$IMAGE_PYTHON" "pip==$pip_version" "$deps" | sha)"
  dest="$CACHE/wheels-$key"
  if [[ ! -f "$dest/requirements.txt" ]]; then
    mkdir -p "$CACHE"
    tmp="$(mktemp -d "$CACHE/wheels-build.XXXXXX")"
    log "fetching dependency wheels $key (pip wheel)"
    # shellcheck disable=SC2086 # one requirement per word
    if ! "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$tmp" \
      "pip==$pip_version" $deps >&2; then
      rm -rf "$tmp"
      die "pip wheel of the dependencies failed"
    fi
    printf '%s\n' "$deps" > "$tmp/requirements.txt"
    rm -rf "$dest"
    mv "$tmp" "$dest"
    prune "wheels-*" "wheels-$key"
  fi
  echo "$dest"
}

# kvdir's wheel from the files git knows of (a copy: no build/ lands in the tree).
kvdir_wheel() {
  local out="$1" src
  src="$(mktemp -d)"
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -) | tar -C "$src" -xf -
  if ! "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation --wheel-dir "$out" "$src" >&2; then
    rm -rf "$src"
    die "building kvdir's wheel failed"
  fi
  rm -rf "$src"
}

source_commit() {
  local commit
  commit="$(git -C "$REPO" rev-parse HEAD)"
  if [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=normal)" ]]; then
    commit="$commit-dirty"
  fi
  echo "$commit"
}

# ---------------------------------------------------------------- 3. image

main() {
  check_tools
  local version commit key base deps wheel digest
  version="$("$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$REPO/pyproject.toml")"
  IMAGE="${IMAGE:-localhost/kvdir:$version}"
  commit="$(source_commit)"
  log "resolving the base's package versions"
  key="$(base_tarball)"
  base="$(base_image "$key")"
  deps="$(dependency_wheels)"

  CTX="$(mktemp -d)"
  trap 'rm -rf "$CTX"' EXIT
  local ctx="$CTX"
  mkdir "$ctx/wheels"
  cp -l "$deps"/*.whl "$ctx/wheels/" 2>/dev/null || cp "$deps"/*.whl "$ctx/wheels/"
  log "building kvdir's wheel"
  kvdir_wheel "$ctx/wheels"
  wheel="$ctx/wheels/kvdir-$version-py3-none-any.whl"
  [[ -f "$wheel" ]] || die "no $wheel was built"
  digest="$(sha256sum "$wheel" | cut -d' ' -f1)"
  install -m 0755 "$HERE/healthcheck.sh" "$ctx/healthcheck.sh"

  log "building $IMAGE (kvdir $version, $commit) on $base"
  "$PODMAN" build --quiet --network=none --pull=never --format=docker \
    --file "$HERE/Containerfile" \
    --build-arg "BASE=$base" \
    --build-arg "KVDIR_VERSION=$version" \
    --build-arg "KVDIR_COMMIT=$commit" \
    --build-arg "KVDIR_WHEEL_SHA256=$digest" \
    --tag "$IMAGE" "$ctx" >&2
  log "built $IMAGE"
  echo "$IMAGE"
  "$PODMAN" image inspect --format '{{.Id}}' "$IMAGE"
}

main "$@"; exit
