#!/usr/bin/env bash
# The one place that regenerates proto/kvdir/v1/*_pb2*.py{,i} from the .proto files.
#   scripts/genproto.sh          regenerate in place
#   scripts/genproto.sh --check  fail (exit 1) if the committed code differs from a fresh generation
# Needs the dev extras (grpcio-tools, mypy-protobuf) in the Python named by $PYTHON (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# protoc finds the mypy plugins on PATH, next to the interpreter that has them.
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
dest=proto
if [[ "${1:-}" == "--check" ]]; then
  dest=$(mktemp -d)
  trap 'rm -rf "$dest"' EXIT
fi
# -I proto makes the generated modules import each other as kvdir.v1.*, the name
# they are installed under (kvdir/v1 is proto/kvdir/v1), matching the protobuf
# package kvdir.v1 (and so every wire name).
"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$dest" --grpc_python_out="$dest" \
  --mypy_out="$dest" --mypy_grpc_out="$dest" \
  proto/kvdir/v1/*.proto
if [[ "${1:-}" == "--check" ]]; then
  status=0
  for f in "$dest"/kvdir/v1/*; do
    rel=proto/${f#"$dest"/}
    if ! cmp -s "$f" "$rel"; then
      echo "proto drift: $rel differs from a fresh generation (run scripts/genproto.sh)"
      status=1
    fi
  done
  exit $status
fi
