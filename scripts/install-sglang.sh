#!/usr/bin/env bash
# Fetch SGLang's REAL KV-event publisher (CPU only, no torch, no triton) into a
# small cached virtualenv, for the real-publisher tests of tests/events/
# (tests/events/sglang_driver.py; docs/events.md).
#
#   scripts/install-sglang.sh VERSION [DEST]
#
# DEST defaults to ${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/sglang-VERSION. Importing
# sglang pulls torch and triton, so instead: the wheel is downloaded with --no-deps
# and only the modules that make and publish KV events are extracted into
# DEST/src (sglang/srt/disaggregation/kv_events.py: ZmqEventPublisher and the
# event classes; sglang/srt/mem_cache/events.py: KVCacheEventRecorder; the
# page-hash helpers of sglang/srt/mem_cache/utils.py and their C++ SHA-256
# chain, cpp_utils/hash_binding.cpp, built here with g++ and pybind11 as
# SGLang builds it at run time with torch's cpp_extension). The driver loads
# them with stubs for the few imports that are irrelevant to publishing.
# A DEST that already passes the driver's --check is kept (CI re-runs are free).
set -euo pipefail
version=${1:?usage: install-sglang.sh VERSION [DEST]}
dest=${2:-${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/sglang-$version}
driver=$(cd "$(dirname "$0")/.." && pwd)/tests/events/sglang_driver.py
py=$dest/bin/python

if [[ -x $py ]] && "$py" "$driver" --home "$dest" --check >/dev/null 2>&1; then
  echo "sglang $version: $dest (cached)"
  exit 0
fi
rm -rf "$dest"
python3 -m venv "$dest"
pip=("$py" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install msgspec 'pyzmq>=25' 'pydantic>=2' psutil pybind11
# The cp311 manylinux wheel: only its .py and .cpp files are used, on any Python.
"${pip[@]}" download --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_34_x86_64 -d "$dest/wheel" "sglang==$version"
"$py" - "$dest" <<'PY'
import glob, sys, zipfile
dest = sys.argv[1]
files = [
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/mem_cache/events.py",
    "sglang/srt/mem_cache/utils.py",
    "sglang/srt/mem_cache/evict_policy.py",
    "sglang/srt/mem_cache/cpp_utils/native_hash.py",
    "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp",
    "sglang/srt/environ.py",
    "sglang/srt/utils/network.py",
]
(wheel,) = glob.glob(f"{dest}/wheel/sglang-*.whl")
with zipfile.ZipFile(wheel) as z:
    for f in files:
        z.extract(f, f"{dest}/src")
PY
# SGLang's native page hash (native_hash.py builds it with these flags at run time).
flags=(-O3 -std=c++17 -DNDEBUG -shared -fPIC -Wno-deprecated-declarations -DTORCH_EXTENSION_NAME=hicache_hash_cpp)
grep -qi avx2 /proc/cpuinfo && flags+=(-mavx2)
mkdir -p "$dest/ext"
# shellcheck disable=SC2046 # pybind11 --includes prints several -I flags
g++ "${flags[@]}" $("$py" -m pybind11 --includes) \
  "$dest/src/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp" \
  -o "$dest/ext/hicache_hash_cpp$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
  -lcrypto
"$py" "$driver" --home "$dest" --check
echo "sglang $version: $dest"
