#!/usr/bin/env bash
# The TypeScript SDK's checks (sdk/typescript): installs its npm packages from the lockfile,
# checks that the sources are formatted (prettier), builds, then runs its tests (node --test)
# against real `reach` processes on 127.0.0.1. (scripts/check-generated.sh checks src/gen.)
#   REACH_BIN     the reach binary (default target/debug/reach, built by `cargo test`)
#   REACH_PYTHON  the Python with grpcio for the Python-client test (default .venv/bin/python,
#                 made by scripts/python-env.sh; without it that test is skipped)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative REACH_BIN means relative to where the script was started.
if [[ -n "${REACH_BIN:-}" ]]; then REACH_BIN="$(realpath -m -- "$REACH_BIN")"; export REACH_BIN; fi
cd "$repo/sdk/typescript"
echo "== typescript: npm ci"
npm ci --silent --no-audit --no-fund
echo "== typescript: sources formatted"
npm run --silent format:check
echo "== typescript: build and test"
npm test --silent
