#!/usr/bin/env bash
# The Python SDK's checks: its type check (mypy --strict) and its pytest suite, which starts
# real `reach` processes on 127.0.0.1 (and, for the web console, headless Chromium:
# scripts/browser-env.sh installs it when missing) — the binary named by REACH_BIN, default
# target/debug/reach (what `cargo test` builds). Arguments go to pytest:
#   scripts/test-python.sh                      # everything
#   scripts/test-python.sh -k drain             # one test
#   REACH_BIN=/path/to/reach scripts/test-python.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative REACH_BIN means relative to where the script was started.
if [[ -n "${REACH_BIN:-}" ]]; then REACH_BIN="$(realpath -m -- "$REACH_BIN")"; export REACH_BIN; fi
cd "$repo"

scripts/python-env.sh
scripts/browser-env.sh
export REACH_BIN="${REACH_BIN:-$repo/target/debug/reach}"
if [[ ! -x "$REACH_BIN" ]]; then
    echo "test-python: $REACH_BIN is missing: run cargo build -p reach (or set REACH_BIN)" >&2
    exit 1
fi
echo "== mypy (sdk/python)"
(cd sdk/python && "$repo/.venv/bin/python" -m mypy)
echo "== pytest (sdk/python, reach: $REACH_BIN)"
cd sdk/python
exec "$repo/.venv/bin/python" -m pytest "$@"
