#!/usr/bin/env bash
# The test command: installs what the tests need (Python venv with grpcio, grpcurl, the OTLP
# receiver's packages and the Python SDK; buf; the TypeScript SDK's npm packages), checks the
# protobuf contracts and that the generated Python and TypeScript code is up to date, runs
# every Rust test — unit tests and cross-service tests against real servers on 127.0.0.1
# ephemeral ports (and a throwaway PostgreSQL on 127.0.0.1:5433 for the orchestrator's store
# tests, and etcd servers the registry's etcd tests start) — then the Python and TypeScript SDKs' tests against the `reach` binary it built,
# and the helm chart's checks (lint, render, kubernetes-validate, invariants).
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
echo "== generated code (buf.gen.yaml: Python, TypeScript)"
scripts/check-generated.sh
echo "== postgresql (orchestrator store tests)"
eval "$(scripts/start-postgres.sh)"
echo "== etcd and protoc (the registry's etcd backend: built, and tested against real etcd)"
eval "$(scripts/etcd-env.sh)"
echo "== cargo test"
cargo test --workspace --locked --features reach/etcd,reach-registry/etcd "$@"
# `cargo test` built target/debug/reach; the SDK suites run it as real processes.
export REACH_BIN="$repo/target/debug/reach"
scripts/test-python.sh
scripts/test-typescript.sh
scripts/test-chart.sh
