#!/usr/bin/env bash
# Regenerates every language's code from the protobuf contracts as buf.gen.yaml says (buf from
# scripts/buf.sh; the Python plugins from the venv of scripts/python-env.sh; protoc-gen-es from
# sdk/typescript/node_modules, installed with `npm ci` when missing), plus the TypeScript SDK's
# vendored protos (sdk/typescript/buf.gen.yaml):
#   scripts/generate.sh
# Commit what it changes; scripts/check-generated.sh fails while the committed code is stale.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

if ! .venv/bin/python -c 'import grpc_tools.protoc' 2>/dev/null; then
    echo "generate.sh: .venv has no grpcio-tools; run scripts/python-env.sh first" >&2
    exit 1
fi
if [[ ! -x sdk/typescript/node_modules/.bin/protoc-gen-es ]]; then
    (cd sdk/typescript && npm ci --silent --no-audit --no-fund)
fi

# Generated files of protos that no longer exist must not survive: remove every language's
# generated files first (hand-written files next to them, such as __init__.py, stay).
rm -f sdk/python/src/reach/v1/*_pb2.py sdk/python/src/reach/v1/*_pb2.pyi \
    sdk/python/src/reach/v1/*_pb2_grpc.py
rm -rf sdk/typescript/src/gen

scripts/buf.sh generate
scripts/buf.sh generate --template sdk/typescript/buf.gen.yaml
echo "generate.sh: regenerated from proto/ (buf.gen.yaml) and sdk/typescript/proto"
