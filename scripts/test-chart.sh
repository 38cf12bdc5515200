#!/usr/bin/env bash
# Checks the helm chart (deploy/helm/reach) offline, in well under a minute: lints it and
# renders it with the Helm SDK for each values file of deploy/helm/reach/ci (the `bad-*` ones
# must fail with the message their first line names), validates every rendered manifest
# against the Kubernetes API schemas of the oldest supported and the newest Kubernetes
# (kubernetes-validate --strict: unknown fields are errors), then runs the invariant tests
# (deploy/tests/test_chart.py). No helm binary or cluster is needed. One test runs each
# service's rendered settings through `reach <service> --dump-config`: it uses $REACH_BIN, else
# target/debug/reach or target/release/reach, and is skipped (saying so) when none is built.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

scripts/python-env.sh
python="$repo/.venv/bin/python"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "== chart: lint and render (deploy/helm/reach/ci)"
"$python" deploy/tests/chart.py "$out"
# The chart's kubeVersion floor, and kubernetes-validate's newest schemas.
for version in 1.30.0 latest; do
    echo "== chart: kubernetes-validate --strict ($version)"
    args=()
    [[ "$version" == latest ]] || args=(--kubernetes-version "$version")
    "$repo/.venv/bin/kubernetes-validate" --strict --quiet "${args[@]}" "$out"/*.yaml
done
echo "== chart: invariants (pytest)"
"$python" -m pytest -q -p no:cacheprovider -p no:asyncio -rs deploy/tests
