#!/usr/bin/env bash
# Generates the Python gRPC client (grpcio) for reach.v1 from proto/ into OUT_DIR
# (default sdk/python/generated). Needs the venv from scripts/python-env.sh.
#   sdk/python/generate.sh [OUT_DIR]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$repo/sdk/python/generated}"
python="${PYTHON:-$repo/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "generate.sh: $python not found; run scripts/python-env.sh first" >&2
    exit 1
fi
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I "$repo/proto" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    "$repo"/proto/reach/v1/*.proto
echo "generate.sh: reach.v1 Python client in $out"
