#!/usr/bin/env bash
# Creates (or updates) the Python virtualenv at <repo>/.venv with the tools tests use:
# grpcio and friends, opentelemetry-proto (the OTLP receiver in
# sdk/rust/reach-telemetry/tests/otlp_receiver.py). Idempotent: a venv whose installed
# requirements match requirements-dev.txt is left alone.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
requirements="$repo/requirements-dev.txt"
stamp="$venv/.requirements-dev.sha256"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi

want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "python-env: $venv is up to date"
    exit 0
fi

"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
echo "$want" > "$stamp"
echo "python-env: installed $(wc -l < "$requirements") requirement lines into $venv"
