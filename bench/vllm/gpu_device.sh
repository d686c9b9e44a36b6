#!/usr/bin/env bash
# On the GPU machine, from the repository root: run a command with vLLM 0.24 importable.
#
# The bundle (../shared/tools/vllm-gpu-bundle.sh; ../shared/notes/vllm-gpu.md) is
# expected as parts in /tmp/parts (part*, unpack.sh, the zstandard wheel); it is
# unpacked once into /tmp/site. Every process gets NVLink multicast off, the
# PyTorch sampler (FlashInfer is not bundled) and a fixed PYTHONHASHSEED (vLLM
# 0.24 seeds its block hashes with it: engines must agree).
#
#   bash bench/vllm/gpu_device.sh python3 -m bench.vllm.gpu --out "$OUT" --work-dir /dev/shm/kvw
#   (add --only 70b peer for the two-engine parts alone: ~4 min instead of ~8)
set -euo pipefail
site=/tmp/site
if [[ ! -e $site/vllm/__init__.py ]]; then
  bash /tmp/parts/unpack.sh /tmp/parts "$site" >/dev/null
fi
export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "$@"
