#!/usr/bin/env bash
# Runs buf (installed from npm into .tools/ on first use) from the repository root:
#   scripts/buf.sh lint | scripts/buf.sh breaking --against '.git#ref=HEAD~1' | ...
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$repo/.tools"
buf="$tools/node_modules/@bufbuild/buf-linux-x64/bin/buf"
if [[ ! -x "$buf" ]]; then
    mkdir -p "$tools"
    (cd "$tools" && npm install --silent --no-audit --no-fund @bufbuild/buf@1.75 >/dev/null)
fi
cd "$repo"
exec "$buf" "$@"
