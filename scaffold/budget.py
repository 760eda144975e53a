"""The render budget and the spread of answers through the template, measured.

    python -m scaffold.budget              # this checkout's template
    python -m scaffold.budget --rev 1a76b8a  # the template of a commit, to compare

The render budget (README.md, "Render budget"): the default render's `src/` holds at most
BUDGET_LINES lines, and no rendered `train.py` is over TRAIN_PY_LINES, with every option on too.
An answer lives in its own folder (templates/<folder>/, its pieces included at the shared
templates' named seams): in the shared templates (templates/project/ and templates/tasks/) at most
SPREAD_AIMS[answer] files test the answer, a file counting when a Jinja tag in its text or its path
compares it (`answer ==`, `!=`, `in`, `not in`), tests it (`if answer`), joins it to a condition
(`answer if`, `else`, `and`, `or`) or looks a text up by it (`{...}[answer]`, `.get(answer`), a
conditional folder once. Every asked answer has an aim: a new
answer declares its own. train.py.jinja tests precision at most TRAIN_PRECISION_TESTS times, the
whole template holds at most TAGS_TOTAL `{%` tags and no file more than TAGS_AIM, and no inline
`{{ a if x else b }}` carries a statement or a comment. tests/test_budget.py holds the template to
these.
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
SPREAD_AIMS = {
    "task": 13,  # the base answer the shared templates are written around: its files, its commands
    "distributed": 5,
    "device": 8,
    "precision": 3,
    "tracker": 3,
    "finetune": 6,
    "streaming": 7,
    "compile": 5,
    "grad_accum_steps": 1,
}
TAGS_AIM = 30
TAGS_TOTAL = 550
TRAIN_PRECISION_TESTS = 2
# The shared templates: every other folder holds an answer's own templates (or its pieces).
SHARED_FOLDERS = ("project", "tasks")

_TAG = re.compile(r"\{%.*?%\}|\{\{.*?\}\}", re.DOTALL)


def _tests(answer: str) -> re.Pattern[str]:
    compared = rf"\b{answer}\s*(==|!=|not\s+in\b|in\b)"
    tested = rf"\bif\s+(not\s+)?{answer}\b"
    joined = rf"\b{answer}\s+(if|else|and|or)\b|\b(else|and|or)\s+(not\s+)?{answer}\b"
    looked_up = rf"\[\s*{answer}\s*\]|\.get\(\s*{answer}\b"  # {{ {"fp16": "..."}[precision] }}
    return re.compile(f"{compared}|{tested}|{joined}|{looked_up}")


def spread(template: Path, answer: str) -> list[str]:
    """The shared template files (a conditional folder once) whose text or path has a tag testing
    `answer`."""
    pattern = _tests(answer)
    found: set[str] = set()
    for path in sorted(template.rglob("*.jinja")):
        relative = path.relative_to(template)
        if relative.parts[0] not in SHARED_FOLDERS:
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


def tests_in(path: Path, answer: str) -> int:
    """How many tags of the template file at `path` test `answer`."""
    pattern = _tests(answer)
    return sum(bool(pattern.search(tag)) for tag in _TAG.findall(path.read_text()))


def total_tags(template: Path) -> int:
    """The `{%` tags in every file of the template (copier.yml too)."""
    return sum(p.read_text().count("{%") for p in template.rglob("*") if p.is_file())


# A statement or a comment inside an inline expression's text: {{ "return x  # ..." if a else "" }}.
_STATEMENT = re.compile(
    r"#|^\s*(return|raise|import|def|class|assert|del|pass|yield)\b|^\s*from\s+\S+\s+import\b"
)


def inline_statements(template: Path) -> list[str]:
    """`file:line` of each inline {{ a if x else b }} whose texts hold a statement or a comment."""
    from jinja2 import Environment, nodes

    found = []
    env = Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])
    for path in sorted(template.rglob("*.jinja")):
        try:
            tree = env.parse(path.read_text())
        except Exception:
            continue
        for output in tree.find_all(nodes.CondExpr):
            texts = [n.value for n in output.find_all(nodes.Const) if isinstance(n.value, str)]
            if any(_STATEMENT.search(text) for text in texts):
                found.append(f"{path.relative_to(template)}:{output.lineno}")
    return found


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
    lines.append(f"tags in the whole template: {total_tags(template)} (aim {TAGS_TOTAL})")
    train = next(template.glob("project/src/*/train.py.jinja"))
    tested = tests_in(train, "precision")
    lines.append(f"train.py.jinja tests precision {tested} times (aim {TRAIN_PRECISION_TESTS})")
    lines.append(f"inline statements: {len(inline_statements(template))} (aim 0)")
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
