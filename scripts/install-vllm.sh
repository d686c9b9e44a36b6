#!/usr/bin/env bash
# Install a stock vLLM (CPU only, no GPU build) into its own virtualenv, for the
# real-publisher tests of tests/events/ (see docs/events.md).
#
#   scripts/install-vllm.sh VERSION [DEST]
#
# DEST defaults to ${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/vllm-VERSION; a venv
# that already imports vllm's publisher and BlockPool is kept (CI re-runs are
# free). Each version gets its own venv because two vLLMs cannot share one.
# Why these steps: ../shared/notes/vllm-kv-events.md (torch is the CPU wheel on
# disk; --no-deps keeps pip from choosing a multi-GB CUDA torch or triton).
set -euo pipefail
version=${1:?usage: install-vllm.sh VERSION [DEST]}
dest=${2:-${KVDIR_VLLM_HOME:-$HOME/.cache/kvdir}/vllm-$version}
py=$dest/bin/python
probe='import vllm.distributed.kv_events, vllm.v1.core.block_pool, vllm.v1.core.kv_cache_utils'

source "$(dirname "$0")/probe-stamp.sh"

if probe_is_stamped "$dest" "$probe"; then
  echo "vllm $version: $dest (cached, probed before)"
  exit 0
fi
if [[ -x $py ]] && "$py" -c "$probe" >/dev/null 2>&1; then
  probe_stamp "$dest" "$probe"
  echo "vllm $version: $dest (cached)"
  exit 0
fi
rm -rf "$dest"
python3 -m venv "$dest"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps "vllm==$version" xgrammar==0.2.8 apache-tvm-ffi==0.1.11
# vllm's import closure, without letting pip resolve vllm itself.
"${pip[@]}" msgspec 'pyzmq>=25' numpy packaging psutil regex 'pydantic>=2.12' cbor2 \
  'transformers>=5.16.1,<5.21' 'aiohttp>=3.14.4' 'requests>=2.33' 'openai>=2.25' \
  'pillow>=13' pybase64 cachetools cloudpickle uvloop py-cpuinfo 'prometheus_client>=0.18' \
  'fastapi>=0.133,<0.137' partial-json-parser 'llguidance>=1.7,<1.8' \
  sentencepiece tiktoken blake3 gguf einops diskcache lark pyyaml six setuptools \
  protobuf watchfiles python-json-logger openai-harmony mistral_common compressed-tensors \
  depyf pyzmq msgpack tqdm filelock typing_extensions
"$py" -c "$probe"
probe_stamp "$dest" "$probe"
echo "vllm $version: $dest"
