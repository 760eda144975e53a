"""Golden renders: the default and the everything-on projects, committed under tests/golden/.

Reviewers read real output in diffs; tests/test_golden.py checks that a fresh render matches
them byte for byte. After changing the template, refresh them from a checkout with

    python -m scaffold.golden --refresh

and commit tests/golden/ with the template change.

Which combinations (both picked from copier.yml by rule, never listed here):

- default: every question's first value (what `scaffold new --defaults` gives on a machine
  without a GPU);
- everything: the valid combination with the most answers away from those first values, the
  last such in the matrix's order on a tie (today custom, mlflow, cuda, fsdp, fp16, 4, compile).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from scaffold.combinations import combinations

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden"


def golden_answers(template: Path | None = None) -> dict[str, dict[str, Any]]:
    """{folder name under tests/golden: answers}."""
    combos = combinations(template)
    first = combos[0]
    away = [sum(c[k] != first[k] for k in c) for c in combos]
    most = max(away)
    everything = [c for c, n in zip(combos, away, strict=True) if n == most][-1]
    return {"default": first, "everything": everything}


def render_goldens(into: Path, template: Path | None = None) -> dict[str, Path]:
    """Render each golden project into `into/<name>`; returns {name: project folder}."""
    from scaffold.render import new_project

    return {
        name: new_project(into / name, answers, git=False, template=template).path
        for name, answers in golden_answers(template).items()
    }


def differences(expected: Path, actual: Path) -> list[str]:
    """Files that differ between two trees, are missing, or are extra ([] when identical)."""

    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    want, got = files(expected), files(actual)
    problems = [f"missing {f}" for f in sorted(want - got)]
    problems += [f"extra {f}" for f in sorted(got - want)]
    problems += [
        f"differs {f}"
        for f in sorted(want & got)
        if (expected / f).read_bytes() != (actual / f).read_bytes()
    ]
    return problems


def refresh(golden_dir: Path = GOLDEN_DIR) -> list[str]:
    """Re-render every golden project into `golden_dir`; returns the names refreshed."""
    with tempfile.TemporaryDirectory() as scratch:
        rendered = render_goldens(Path(scratch))
        for name, project in rendered.items():
            shutil.rmtree(golden_dir / name, ignore_errors=True)
            (golden_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(project, golden_dir / name)
    return list(rendered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaffold.golden", description=__doc__)
    parser.add_argument("--refresh", action="store_true", help="re-render tests/golden/")
    args = parser.parse_args(argv)
    if args.refresh:
        for name in refresh():
            print(f"refreshed {GOLDEN_DIR / name}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        stale = {
            name: problems
            for name, project in render_goldens(Path(scratch)).items()
            if (problems := differences(GOLDEN_DIR / name, project))
        }
    for name, problems in stale.items():
        print(f"{name}: " + "; ".join(problems))
    if stale:
        print("stale: run `python -m scaffold.golden --refresh` and commit tests/golden/")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
