"""Long commands say where they are: `find-lr` (209 s), `profile` (50 s), `check loader` (108-146 s)
and `check overfit` (39-79 s) printed nothing between their start and their result, and `prepare`
nothing in a log. Each now says what it is about to time as a phase starts, and inside a phase a
bar rewrites itself on a terminal (runtime/progress.py's `announced`), or a line every 30 s in a
log.
"""

from __future__ import annotations

import importlib
import sys

import pytest
from test_project import render, run

SMALL = ("--max-train-examples", "512", "--batch-size", "32", "--num-workers", "1")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return render(tmp_path_factory.mktemp("progress") / "talky")


def test_a_pass_of_steps_in_a_log_says_steps(project, capsys):
    sys.path.insert(0, str(project / "src"))
    try:
        progress = importlib.import_module("talky.runtime.progress")
        clock = iter([0.0, 20.0, 40.0, 60.0, 80.0])  # 20 s a step: a line at 40 s, none at the end
        passed = []
        for step in progress.announced(range(4), "find-lr", "step", clock=lambda: next(clock)):
            passed.append(step)
        assert passed == [0, 1, 2, 3]
        assert capsys.readouterr().err.splitlines() == ["find-lr: 2/4 steps, 40 s"]
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == "talky" or m.startswith("talky.")]:
            del sys.modules[name]


def test_check_loader_says_each_phase_as_it_starts(project):
    done = run(project, "check", "loader", *SMALL)
    assert done.returncode in (0, 1) and "loader: " in done.stdout, done.stderr  # 1: a slow loader
    phases = [line for line in done.stderr.splitlines() if line.startswith("check loader: ")]
    assert phases[1:5] == [
        "check loader: the loader alone...",
        "check loader: the loader alone by --num-workers...",
        "check loader: training steps alone...",
        "check loader: training steps with the loader...",
    ], done.stderr


def test_find_lr_and_profile_say_what_they_run_before_they_run_it(project, tmp_path):
    done = run(project, "find-lr", *SMALL, "--range-steps", "20", "-o", str(tmp_path / "lr.png"))
    assert done.returncode == 0, done.stderr
    assert "find-lr: 20 steps, lr 1e-07 up to 10..." in done.stderr.splitlines()
    done = run(project, "profile", *SMALL, "-o", str(tmp_path / "profile"))
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("profile: ")]
    assert said == [
        "profile: 5 warm-up steps...",
        "profile: 20 steps timed phase by phase...",
        "profile: 20 steps timed whole...",
        "profile: 8 steps under torch.profiler...",
    ], done.stderr


def test_prepare_says_each_phase_in_a_log(tmp_path):
    project = render(tmp_path / "prep", task="generation")
    (project / "book.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    done = run(project, "prepare", "--data", "book.txt", "--vocab-size", "300", "--out", "data/b")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("prepare: ")]
    assert said == [
        "prepare: reading 0.0 MB in 1 file(s) once, to check them...",
        "prepare: the bpe tokenizer (merges learnt from the training split)...",
        "prepare: encoding into train.bin and val.bin...",
    ], done.stderr
