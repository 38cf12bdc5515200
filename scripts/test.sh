#!/usr/bin/env bash
# The test command: installs what the tests need (Python venv with grpcio, grpcurl and the
# OTLP receiver's packages; buf), checks the protobuf contracts, then runs every Rust test —
# unit tests and cross-service tests against real servers on 127.0.0.1 ephemeral ports
# (and a throwaway PostgreSQL on 127.0.0.1:5433 for the orchestrator's store tests).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

scripts/python-env.sh
echo "== buf lint"
scripts/buf.sh lint
if git rev-parse --verify -q HEAD~1 >/dev/null && git cat-file -e HEAD~1:proto 2>/dev/null; then
    echo "== buf breaking (against HEAD~1)"
    scripts/buf.sh breaking --against '.git#ref=HEAD~1'
fi
echo "== postgresql (orchestrator store tests)"
eval "$(scripts/start-postgres.sh)"
echo "== cargo test"
cargo test --workspace --locked "$@"
