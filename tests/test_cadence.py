"""What a run prints keeps a readable cadence on small data: a 333-row table, one step an epoch,
validates at least EVAL_EVERY_MIN (10) steps apart, not every step, and prints a validation line at
most once in --log-every steps, with the early stop and the best always said. Checkpoints keep a
cadence in time as well as in steps: a killed run loses minutes, not the run, and one killed before
its first checkpoint says that it starts over."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_project import SMALL_RUN, kill_at_step, records, render, run


def test_a_small_table_validates_every_10_steps_not_every_step(tmp_path):
    project = render(tmp_path / "small")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(333, 5))
    labels = (features[:, 0] + features[:, 1] > 0).astype(int)
    rows = [
        ",".join(f"{v:.4f}" for v in row) + f",{label}"
        for row, label in zip(features, labels, strict=True)
    ]
    (project / "small.csv").write_text("a,b,c,d,e,label\n" + "\n".join(rows) + "\n")

    done = run(project, "train", "--data", "small.csv", "--run-dir", "runs/s", "--max-steps", "300")

    assert done.returncode == 0, done.stderr
    assert "validating every 10 steps (at least 10 steps apart, as epochs are short)" in done.stdout
    records = [
        json.loads(line) for line in (project / "runs/s/metrics.jsonl").read_text().splitlines()
    ]
    validated = [r["step"] for r in records if r["split"] == "val"]
    last = validated[-1]
    assert validated[:-1] == list(range(10, last, 10)), validated  # not every step
    assert last % 10 == 0 or last == 300
    printed = [line for line in done.stdout.splitlines() if "  val loss " in line]
    assert len(printed) <= 31, printed  # 300 steps: at most 30 validations, and the last
    assert printed[-1].startswith(f"step {last}  val loss ")
    assert "best val loss " in done.stdout.splitlines()[-1]

    often = ("--eval-every", "2", "--max-steps", "60", "--patience", "0")
    done = run(project, "train", "--data", "small.csv", "--run-dir", "runs/often", *often)
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(line) for line in (project / "runs/often/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["split"] == "val"] == list(range(2, 61, 2))
    printed = [line.split()[1] for line in done.stdout.splitlines() if "  val loss " in line]
    assert printed == [str(step) for step in range(2, 61, 10)] + ["60"], printed  # --log-every 10


def test_a_long_validation_says_where_it_is_in_a_log_and_a_short_one_says_nothing(tmp_path, capsys):
    """On a 5,000-image folder nothing was printed for minutes while validation ran. In a log
    (stderr not a terminal) a pass says where it is every `every` seconds, never at its end."""
    import importlib
    import sys

    project = render(tmp_path / "passes")
    sys.path.insert(0, str(project / "src"))
    try:
        progress = importlib.import_module("passes.runtime.progress")

        # The clock as the caller ends its work on each of 8 batches: 30 s since the start at the
        # 3rd and since that line at the 6th; 29.9 s at the 2nd and 5th, too soon; 35 s at the
        # 8th, when the pass has ended.
        ended = [10.0, 29.9, 30.0, 45.0, 59.9, 60.0, 70.0, 95.0]
        now = 0.0
        passes = progress.announced(list(range(8)), "validating", every=30.0, clock=lambda: now)
        passed = []
        for batch in passes:
            passed.append(batch)
            now = ended[batch]
        assert passed == list(range(8))
        lines = capsys.readouterr().err.splitlines()
        assert lines == ["validating: 3/8 batches, 30 s", "validating: 6/8 batches, 60 s"]

        assert list(progress.announced(list(range(6)), "validating")) == list(range(6))
        assert capsys.readouterr().err == ""  # a short pass: nothing
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == "passes" or m.startswith("passes.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def clocked(tmp_path_factory):
    """A project and its 60-step reference run, checkpointed at its last step only."""
    project = render(tmp_path_factory.mktemp("clock") / "clocked")
    args = ("--max-steps", "60", *SMALL_RUN, "--ckpt-every", "1000", "--ckpt-minutes", "0")
    done = run(project, "train", "--run-dir", "runs/reference", *args)
    assert done.returncode == 0, done.stderr
    saved = sorted(p.name for p in (project / "runs/reference/checkpoints").iterdir())
    assert saved == ["best.pt", "step-00000060.pt"]
    return project


def test_checkpoints_by_the_clock_lose_minutes_not_the_run_and_resume_exactly(clocked):
    """--ckpt-minutes writes a step checkpoint once that much time has passed since the last,
    whatever --ckpt-every says (here 1000, past the run's end): the run killed at step 30 resumes
    near where it stopped, not from step 0, and ends with the very records of the run that never
    stopped (a checkpoint by the clock is taken at a step boundary and changes nothing)."""
    args = ["train", "--run-dir", "runs/clock", "--max-steps", "60", *SMALL_RUN]
    args += ["--ckpt-every", "1000", "--ckpt-minutes", "0.0001", "--keep-last", "100"]  # 6 ms
    kill_at_step(clocked, args, 30)
    steps = sorted(int(p.stem[5:]) for p in (clocked / "runs/clock/checkpoints").glob("step-*.pt"))
    assert len(steps) >= 3 and steps[-1] >= 20, steps

    done = run(clocked, *args)

    assert done.returncode == 0, done.stderr
    resumed_at = int(re.search(r"^resuming from .* at step (\d+)$", done.stdout, re.M).group(1))
    assert resumed_at == steps[-1]
    assert records(clocked / "runs/clock") == records(clocked / "runs/reference")  # bit for bit

    readme = (clocked / "README.md").read_text()
    assert "at least every `--ckpt-minutes` (5)\n  minutes of training" in readme
    entry = run(clocked, "train", "--help").stdout.split("--ckpt-minutes CKPT_MINUTES\n")[1]
    assert " ".join(entry.split("--keep-last")[0].split()).endswith("0: steps alone (default: 5.0)")


def test_a_run_killed_before_its_first_checkpoint_says_it_starts_over(clocked):
    """Killed at step 25 of a run that checkpoints at step 1000 and never by the clock: the same
    command starts over at step 0 and says so, and why, in one line (its run.json and metrics.jsonl
    are replaced, not silently); it then ends as the reference did."""
    args = ["train", "--run-dir", "runs/killed", "--max-steps", "60", *SMALL_RUN]
    args += ["--ckpt-every", "1000", "--ckpt-minutes", "0"]
    kill_at_step(clocked, args, 25)
    assert not list((clocked / "runs/killed/checkpoints").glob("step-*"))

    done = run(clocked, *args)

    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("starting over")]
    stopped = re.fullmatch(
        r"starting over at step 0: runs/killed holds no step checkpoint \(its run stopped at step"
        r" (\d+), before its first\): its run.json and metrics.jsonl are replaced",
        line,
    )
    assert stopped and int(stopped.group(1)) >= 25, line
    assert "resuming" not in done.stdout
    assert records(clocked / "runs/killed") == records(clocked / "runs/reference")
