#!/usr/bin/env bash
# Fails when the committed generated code differs from what proto/ and buf.gen.yaml generate
# now: regenerates into the work tree (scripts/generate.sh), then lists every generated file
# that changed, appeared or disappeared. For CI and before committing a proto change:
#   scripts/check-generated.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# Every directory a buf.gen.yaml plugin writes into.
generated=(sdk/python/src/reach/v1 sdk/typescript/src/gen)

scripts/generate.sh >/dev/null
# Changed or deleted tracked files, and new files git does not ignore.
stale="$(git status --porcelain --untracked-files=all -- "${generated[@]}")"
if [[ -n "$stale" ]]; then
    echo "check-generated: the generated code is stale (M changed, D removed, ?? new):" >&2
    echo "$stale" >&2
    echo "check-generated: run scripts/generate.sh and commit the result" >&2
    exit 1
fi
echo "check-generated: generated code is up to date"
