#!/usr/bin/env bash
# Regenerates the TypeScript protobuf code in sdk/typescript/src/gen (committed) with buf and
# the local protoc-gen-es plugin: reach.v1 from proto/ (the root buf.gen.yaml) and the vendored
# grpc.health.v1 and google.rpc files from sdk/typescript/proto (sdk/typescript/buf.gen.yaml).
#   sdk/typescript/scripts/generate.sh           regenerate
#   sdk/typescript/scripts/generate.sh --check   regenerate, then fail if src/gen differs from git
# The output is byte-for-byte reproducible (same plugin version from package-lock.json).
set -euo pipefail
sdk="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repo="$(cd "$sdk/../.." && pwd)"
if [[ ! -x "$sdk/node_modules/.bin/protoc-gen-es" ]]; then
    (cd "$sdk" && npm ci --silent --no-audit --no-fund)
fi
rm -rf "$sdk/src/gen"
cd "$repo"
scripts/buf.sh generate
scripts/buf.sh generate --template sdk/typescript/buf.gen.yaml
if [[ "${1:-}" == "--check" ]]; then
    if [[ -n "$(git status --porcelain -- sdk/typescript/src/gen)" ]]; then
        git status --short -- sdk/typescript/src/gen >&2
        echo "generate.sh: sdk/typescript/src/gen is stale; run sdk/typescript/scripts/generate.sh and commit the result" >&2
        exit 1
    fi
fi
