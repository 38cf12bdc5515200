"""Lints and renders the Reach chart (deploy/helm/reach) with the Helm SDK, offline.

As a module: `render(values)` returns the manifests as dicts; `values_files()` lists the CI
values files, each with the error it must fail with (an `# expect-error: MESSAGE` first line)
or None. As a script (`python deploy/tests/chart.py OUT_DIR`, what scripts/test-chart.sh
runs): lints the chart with each good values file, writes each one's manifests to
OUT_DIR/<name>.yaml for kubernetes-validate, and checks that each bad one fails with its
message. Exits non-zero on any failure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "reach"
RELEASE = "ci"
NAMESPACE = "reach"
EXPECT_ERROR = "# expect-error:"


@dataclass(frozen=True)
class ValuesFile:
    """One file of deploy/helm/reach/ci."""

    path: Path
    #: The message rendering must fail with; None for values that must render.
    expect_error: str | None

    @property
    def name(self) -> str:
        return self.path.stem

    def values(self) -> dict[str, Any]:
        return yaml.safe_load(self.path.read_text()) or {}


def values_files() -> list[ValuesFile]:
    files = []
    for path in sorted((CHART / "ci").glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        expect = first[len(EXPECT_ERROR) :].strip() if first.startswith(EXPECT_ERROR) else None
        files.append(ValuesFile(path, expect))
    return files


def render_text(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered manifests, NOTES.txt and empty documents left out."""
    manifests = []
    for path, text in sorted(render_text(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return manifests


def lint(values: dict[str, Any]) -> list[str]:
    """Lint findings of warning severity or worse, as text."""
    report = helm.lint(str(CHART), values)
    return [
        f"{m['path']}: {m['error'].strip()}"
        for m in report["messages"]
        if m["severity"] >= 2
    ] + [e.strip() for e in report["errors"]]


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    for file in values_files():
        if file.expect_error is None:
            problems = lint(file.values())
            failures += [f"{file.path.name}: lint: {p}" for p in problems]
            manifests = render(file.values())
            (out / f"{file.name}.yaml").write_text(yaml.safe_dump_all(manifests, sort_keys=False))
            print(f"chart: {file.path.name}: linted, {len(manifests)} manifests")
            continue
        try:
            render(file.values())
        except helm.HelmError as error:
            if file.expect_error in str(error):
                print(f"chart: {file.path.name}: refused as expected ({file.expect_error})")
                continue
            failures.append(f"{file.path.name}: failed with another message: {error}")
        else:
            failures.append(f"{file.path.name}: rendered, but must fail with: {file.expect_error}")
    for failure in failures:
        print(f"chart: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: chart.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
