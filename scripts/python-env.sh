#!/usr/bin/env sh
# Creates (or updates) .venv at the repository root with requirements-dev.txt.
# Idempotent: re-running only installs what is missing. Tests look for .venv/bin/python
# (or $REACH_PYTHON).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$root/.venv/bin/python" ]; then
    python3 -m venv "$root/.venv"
fi
"$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/requirements-dev.txt"
echo "python env ready: $root/.venv/bin/python"
