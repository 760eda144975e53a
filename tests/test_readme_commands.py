"""Every command of a generated project's README, and of the docs/*.md it points to (after it, in
name order), runs as pasted, in that order, and exits as the text says (0; diagnose 0 or 1, "exit
1 if any"): custom, image + ddp, generation and regression + fsdp, each rendered fresh; the default
project's README runs the same way in tests/test_install.py, in the fresh environment its own
set-up line installs it into.

The one scaling is `--max-steps`, an option the README shows, added to each `train` and torchrun
script line. What this machine cannot run as pasted is left out by name (NOT_HERE: the install,
which the test stands in for by running from src/ with this Python; two machines; SLURM;
Kubernetes; SkyPilot), and the
files a command names as the user's own (a table or photos to predict on, a text folder to
prepare), which its text names as standing for theirs, are written first, as a user would have
them. A command that names no run reads the one the README trained last."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from readme_commands import Ran, indented_commands, manual, manual_commands, run

from scaffold.render import new_project

pytestmark = pytest.mark.slow

CASES = {  # the default's: tests/test_install.py (run_as_pasted)
    "custom": {"task": "custom"},
    "image-ddp": {"task": "image", "distributed": "ddp"},
    "generation": {"task": "generation"},
    "regression-fsdp": {"task": "regression", "distributed": "fsdp"},
}
STEPS = "--max-steps 30"
NOT_HERE = {  # a line's start: why this machine cannot run it as pasted
    "pip install": "the install: the test runs the project from src/ with this Python",
    "MASTER_ADDR=10.0.0.1": "two machines",
    "sbatch": "SLURM",
    "kubectl apply": "a Kubernetes cluster with the Kubeflow Trainer",
    "sky launch": "SkyPilot and a cloud (tests/test_ddp.py runs its command on this machine)",
}


def scaled(line: str) -> str:
    """The line with --max-steps before its comment, if it trains."""
    command, hash_, comment = line.partition("  #")
    if " train " in f"{command} " or "scripts/train_single_node.sh" in command:
        command = f"{command.rstrip()} {STEPS}"
    return f"{command}  {hash_}{comment}" if hash_ else command


# The files a README's commands take from its user, each named in its text as standing for theirs.
PLACEHOLDERS = {
    "classification": ["new_rows.csv"],
    "regression": ["new_rows.csv"],
    "image": ["photo.jpg", "more/"],
    "generation": ["corpus/"],
    "custom": [],
}


def users_files(project: Path, answers: dict) -> None:
    """What the README's commands name as the user's own files (PLACEHOLDERS)."""
    task = answers.get("task", "classification")
    readme = "\n".join(path.read_text(encoding="utf-8") for path in manual(project))
    for name in PLACEHOLDERS[task]:
        assert re.search(rf"`{re.escape(name)}`[^.]*\bstands? for\b", readme), name
    if task in ("classification", "regression"):  # the synthetic default's columns
        rows = [",".join(f"x{i}" for i in range(16))]
        rows += [",".join(f"{(r * 16 + i) % 7 - 3}" for i in range(16)) for r in range(5)]
        (project / "new_rows.csv").write_text("\n".join(rows) + "\n")
    if answers.get("task") == "image":
        from PIL import Image

        (project / "more").mkdir()
        for i, path in enumerate(["photo.jpg", "more/1.png", "more/2.png"]):
            Image.new("RGB", (40, 30), (60 * i, 90, 200 - 50 * i)).save(project / path)
    if answers.get("task") == "generation":
        corpus = project / "corpus"
        corpus.mkdir()
        words = [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "seven",
            "wizards",
            "box",
        ]
        for i in range(12):
            text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(2000))
            (corpus / f"part{i}.txt").write_text(text + "\n", encoding="utf-8")


@pytest.mark.parametrize("case", CASES)
def test_every_readme_command_runs_as_pasted(case, tmp_path):
    answers = CASES[case]
    project = new_project(tmp_path / "proj", answers, git=True).path
    users_files(project, answers)
    env = {
        **os.environ,
        "PYTHONPATH": str(project / "src"),  # what `pip install -e .` makes importable
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    run_as_pasted(project, env, NOT_HERE)


def run_as_pasted(project: Path, env: dict[str, str], not_here: dict[str, str]) -> dict[str, Ran]:
    """Runs every command of `project`'s manual (README, then docs/) in order but those starting
    with a key of `not_here`, each as the text says it exits; a command that reads the newest run
    must read the one trained last. What ran, by its line as run."""
    commands = manual_commands(project)
    ran, left_out, trained, read = {}, [], [], []
    for command in commands:
        why = next((why for start, why in not_here.items() if command.line.startswith(start)), None)
        if why:
            left_out.append(command.line)
            continue
        command.line = scaled(command.line)
        done = run(command, project, env, timeout=600)
        assert done.as_said, f"{command.line}\nexit {done.status}\n{done.output[-3000:]}"
        ran[command.line] = done
        trained += re.findall(r"--run-dir (runs/\S+)", command.line)
        for run_dir in re.findall(r"^reading (\S+) \(the newest run", done.output, re.M):
            read.append(run_dir)
            assert run_dir == trained[-1], (command.line, run_dir, trained)  # the run just made

    assert read, "no command read the newest run"  # report, at least

    assert sum(" train " in line for line in ran) >= 2  # runs/first and runs/second at least
    assert any("check all" in line for line in ran)
    assert len(ran) >= 9 and len(left_out) <= 6, (list(ran), left_out)
    return ran


# scaffold's own README: its commands, each run or left out by name (a command added to the README
# must be placed in one or the other).
STARTS = ("pip ", "scaffold ", "python ", "pytest", "copier ", "git ", "mkdir ", "cd ")
OWN_NOT_HERE = {
    'pip install -e ".[bench]"': "the install of the benchmarks' extra",
    'pip install -e ".[dev]"': "the install of the test tools: this test's own environment",
    "pip install torch": None,  # the quickstart: its installs are this test's environment, its last
    # command (after the last &&) runs below
    "scaffold new DEST": "a synopsis",
    "scaffold check DIR": "a synopsis",
    "scaffold matrix [": "a synopsis",
    "[": "a synopsis",
    "scaffold update DIR": "a synopsis",
    "scaffold matrix --list": None,
    "scaffold matrix": "the matrix itself: CI's own phase (.ci/run)",
    "mkdir team-template": "the git-hosted template recipe: it pushes to a git host",
    "git ": "the git-hosted template recipe: it pushes to a git host",
    "copier copy --vcs-ref": "the git-hosted template recipe: it clones from a git host",
    "cd my-run && git init": "the git-hosted template recipe: it clones from a git host",
    "copier update": "the git-hosted template recipe: it clones from a git host",
    "pytest": "this test suite itself",
    "python -m scaffold.golden --refresh": "it rewrites tests/golden (tests/test_golden.py)",
    "python benchmarks/": "the benchmarks: minutes each, run by hand for the README's figures",
}


def test_scaffolds_own_readme_commands_run_as_pasted(tmp_path):
    from conftest import REPO

    commands = indented_commands((REPO / "README.md").read_text(encoding="utf-8"), STARTS)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    ran, left_out = [], {}
    for command in commands:
        line = command.line
        start = next(
            (s for s in OWN_NOT_HERE if line.startswith(s) or line.startswith(f"{s} ")), ""
        )
        if OWN_NOT_HERE.get(start):
            left_out[line] = OWN_NOT_HERE[start]
            continue
        if line.startswith("pip install torch"):
            command.line = line.rsplit("&&", 1)[1].strip()  # scaffold new demo --defaults --check
        cwd = REPO if "scaffold.golden" in line else tmp_path  # golden reads the checkout
        done = run(command, cwd, env, timeout=600)
        assert done.as_said, f"{command.line}\nexit {done.status}\n{done.output[-3000:]}"
        ran.append(command.line)

    assert "scaffold new demo --defaults --check" in ran
    assert {"scaffold new my-run", "scaffold update my-run --precision bf16"} <= {
        line.split("  #")[0].strip() for line in ran
    }
    assert (tmp_path / "demo" / "runs" / "check" / "summary.json").exists()
    assert len(ran) >= 6, (ran, left_out)
