"""Every combination of answers renders a project that is lint-clean as rendered, has no template
residue, and holds no code for the options not chosen."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from scaffold.matrix import combination_id, combinations
from scaffold.render import new_project

RESIDUE = re.compile(r"\{%-?\s|\s-?%\}|\{\{\s|\s\}\}|\{#|#\}|\.jinja\b")
# copier.yml's longest project name: rendered lines must stay within the line length with it.
LONGEST_NAME = "a-long-project-name-to-fill-forty-chars1"


ALL = combinations()


def _fast_subset() -> list[dict]:
    """Every loop option (device, precision, accumulation, compile) for the default task and
    tracker, and every task x tracker pair with the loop options cycling through their values."""
    loop = [c for c in ALL if c["task"] == "classification" and c["tracker"] == "none"]
    pairs = sorted({(c["task"], c["tracker"]) for c in ALL})
    subset = list(loop)
    for i, (task, tracker) in enumerate(pairs):
        candidates = [c for c in ALL if c["task"] == task and c["tracker"] == tracker]
        subset.append(candidates[(7 * i) % len(candidates)])
    return subset


def _source(project: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(project.rglob("*.py")))


FAST = _fast_subset()
REST = [c for c in ALL if c not in FAST]


@pytest.mark.parametrize(
    "answers",
    [*FAST, *(pytest.param(c, marks=pytest.mark.matrix) for c in REST)],
    ids=combination_id,
)
def test_renders_lint_clean_without_residue(answers, tmp_path):
    project = new_project(tmp_path / LONGEST_NAME, answers, git=False).path

    lint = subprocess.run(
        ["ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        ["ruff", "format", "--no-cache", "--check", "--diff", "."],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr

    for path in project.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            text = path.read_text()
            assert not RESIDUE.search(text), f"template residue in {path.relative_to(project)}"
            for line in text.splitlines():
                assert "REPLACE ME" not in line and "TODO" not in line

    source = _source(project)
    assert ("GradScaler" in source) == (answers["precision"] == "fp16")
    assert ("autocast" in source) == (answers["precision"] != "fp32")
    assert ("torch.compile" in source) == answers["compile"]
    assert ("set_float32_matmul_precision" in source) == (answers["device"] == "cuda")
    assert ("torch.mps" in source) == (answers["device"] == "mps")
    assert ("torch.cuda.get_rng_state" in source) == (answers["device"] == "cuda")
    for tracker, marker in (
        ("tensorboard", "SummaryWriter"),
        ("wandb", "wandb"),
        ("mlflow", "mlflow"),
    ):
        assert (marker in source) == (answers["tracker"] == tracker), tracker
        pyproject = (project / "pyproject.toml").read_text()
        assert (f'"{tracker}' in pyproject) == (answers["tracker"] == tracker), tracker
    assert ("def sample(" in source) == (answers["task"] == "generation")
    compile(source, "<project>", "exec")  # every file parses on its own too, via ruff above


def test_defaults_are_recorded_in_the_answers_file(tmp_path):
    project = new_project(tmp_path / "my-run", {}, git=False).path
    answers = (project / ".copier-answers.yml").read_text()
    assert "project_name: my-run" in answers
    assert "machine_device" not in answers  # machine facts are never saved
    assert (project / "src" / "my_run" / "train.py").is_file()
