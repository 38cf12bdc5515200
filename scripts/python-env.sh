#!/usr/bin/env bash
# Creates (or updates) the Python virtualenv at <repo>/.venv with the tools tests use:
# grpcio and friends, opentelemetry-proto (the OTLP receiver in
# sdk/rust/reach-telemetry/tests/otlp_receiver.py), pytest, and the Python SDK (sdk/python)
# installed editable, so its code is used from the work tree as it changes. Idempotent: a venv
# whose installed requirements match requirements-dev.txt and sdk/python/pyproject.toml is
# left alone.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
requirements="$repo/requirements-dev.txt"
sdk="$repo/sdk/python"
stamp="$venv/.requirements-dev.sha256"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi

want="$(cat "$requirements" "$sdk/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "python-env: $venv is up to date"
    exit 0
fi

"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$sdk"
echo "$want" > "$stamp"
echo "python-env: installed $(wc -l < "$requirements") requirement lines into $venv"
