"""The render budget and the spread of answers through the template, measured.

    python -m scaffold.budget              # this checkout's template
    python -m scaffold.budget --rev 1a76b8a  # the template of a commit, to compare

The render budget (README.md, "Render budget"): the default render's `src/` holds at most
BUDGET_LINES lines, and no rendered `train.py` is over TRAIN_PY_LINES, with every option on too.
An answer lives in its own strategy (a folder of templates picked by the answer, as
templates/distributed/ is): outside those folders, at most SPREAD_AIMS[answer] template files test
the answer, a file counting when a Jinja tag in its text or its path compares the answer
(`answer ==`, `!=`, `in`, `not in`) or tests it (`if answer`), a conditional folder once; and no
template holds more than TAGS_AIM `{%` tags. tests/test_budget.py holds the template to these.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scaffold.golden import render_goldens
from scaffold.questions import template_dir

BUDGET_LINES = 4412  # the default render's src/ at 1a76b8a, when the budget was set
TRAIN_PY_LINES = 300  # nanoGPT's train.py is ~340; ours holds less (the machinery is apart)
SPREAD_AIMS = {"distributed": 5, "device": 8, "precision": 5}
TAGS_AIM = 45
# Folders whose templates an answer picks by name: inside them, testing the answer is their job.
STRATEGY_FOLDERS = ("distributed", "checkpoint", "device", "precision", "readme")

_TAG = re.compile(r"\{%.*?%\}|\{\{.*?\}\}", re.DOTALL)


def _tests(answer: str) -> re.Pattern[str]:
    compared = rf"\b{answer}\s*(==|!=|not\s+in\b|in\b)"
    tested = rf"\bif\s+(not\s+)?{answer}\b(?!\s*(==|!=|in\b|not\b))"
    return re.compile(f"{compared}|{tested}")


def spread(template: Path, answer: str) -> list[str]:
    """The template files (a conditional folder once) outside the strategy folders whose text or
    path has a tag testing `answer`."""
    pattern = _tests(answer)
    found: set[str] = set()
    for path in sorted(template.rglob("*.jinja")):
        relative = path.relative_to(template)
        if relative.parts[0] in STRATEGY_FOLDERS:
            continue
        folders = [
            "/".join(relative.parts[: i + 1])
            for i, part in enumerate(relative.parts[:-1])
            if any(pattern.search(tag) for tag in _TAG.findall(part))
        ]
        if folders:
            found.add(folders[0] + "/")
        elif any(pattern.search(tag) for tag in _TAG.findall(f"{relative}\n{path.read_text()}")):
            found.add(str(relative))
    return sorted(found)


def most_tags(template: Path) -> tuple[int, str]:
    """The most `{%` tags in one template file, and that file."""
    counts = [
        (p.read_text().count("{%"), str(p.relative_to(template))) for p in template.rglob("*.jinja")
    ]
    return max(counts)


@dataclass
class Render:
    name: str
    src_lines: int
    groups: dict[str, tuple[int, int]]  # group: (files, lines)
    train_py: int
    train_py_defs: list[str]


def measure_render(name: str, project: Path) -> Render:
    package = next((project / "src").iterdir())
    groups: dict[str, tuple[int, int]] = {}
    for path in sorted(package.rglob("*.py")):
        group = path.relative_to(package).parts[0] if path.parent != package else "top"
        files, lines = groups.get(group, (0, 0))
        groups[group] = (files + 1, lines + len(path.read_text().splitlines()))
    train = (package / "train.py").read_text()
    defs = re.findall(r"^(?:def|class) (\w+)", train, re.MULTILINE)
    return Render(name, sum(n for _, n in groups.values()), groups, len(train.splitlines()), defs)


def template_at(rev: str, into: Path) -> Path:
    """The templates/ folder of commit `rev` of this checkout, extracted into `into`."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", rev, "templates"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "templates"


def report(template: Path) -> str:
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, project in render_goldens(Path(scratch), template).items():
            r = measure_render(name, project)
            groups = ", ".join(f"{g} {f} files {n:,}" for g, (f, n) in sorted(r.groups.items()))
            lines.append(f"{name}: src/ {r.src_lines:,} lines ({groups})")
            lines.append(f"  train.py {r.train_py} lines: {', '.join(r.train_py_defs)}")
    for answer, aim in SPREAD_AIMS.items():
        files = spread(template, answer)
        lines.append(f"{answer}: {len(files)} files test it outside its strategy (aim {aim})")
        lines.extend(f"  {f}" for f in files)
    count, path = most_tags(template)
    lines.append(f"most tags in one template: {count} in {path} (aim {TAGS_AIM})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaffold.budget", description=__doc__)
    parser.add_argument("--rev", help="measure the template of this commit instead")
    args = parser.parse_args(argv)
    if args.rev is None:
        print(report(template_dir()))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        print(report(template_at(args.rev, Path(scratch))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
