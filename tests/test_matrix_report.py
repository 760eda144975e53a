"""The matrix's closing summary counts each kind of check and adds up the job time it took."""

from __future__ import annotations

from scaffold.matrix import report
from scaffold.matrix.plan import Plan
from scaffold.matrix.runner import Outcome


def _outcome(tracker: str, which: str, seconds: float, passed: bool = True) -> Outcome:
    primary = None if which == "all" else "classification-none-cpu"
    return Outcome(
        answers={"task": "classification", "tracker": tracker, "device": "cpu"},
        passed=passed,
        step="check",
        seconds={"render": 1.0, "lint": 1.0, "check": seconds - 2.0},
        output="" if passed else "boom",
        plan=Plan(which=which, options={}, primary=primary),
    )


def test_the_summary_counts_each_check_and_its_job_time():
    outcomes = [
        _outcome("none", "all", 30.0),
        _outcome("mlflow", "resume", 6.0),
        _outcome("wandb", "resume", 6.0),
        _outcome("tensorboard", "import", 3.0, passed=False),
    ]

    text = report.summary(outcomes, wall=40.0)

    assert "combinations 4: passed 3, failed 1" in text
    assert "check all on 1, a twin's check resume on 2, a cross's --help on 1" in text
    assert "job time by check (the sum over combinations, all jobs together): " in text
    assert "all 30.0s (1), import 3.0s (1), resume 12.0s (2)" in text
    assert "FAILED classification-tensorboard-cpu at check" in text
    assert text.endswith("matrix wall time: 40.0s")


def test_the_summary_splits_the_job_time_by_task_and_distributed_mode():
    outcomes = [_outcome("none", "all", 30.0), _outcome("mlflow", "resume", 6.0)]
    fsdp = _outcome("none", "all", 90.0)
    fsdp.answers.update(task="image", distributed="fsdp")
    outcomes.append(fsdp)

    text = report.summary(outcomes, wall=60.0)

    header, *rows = text.split("job time by family")[1].splitlines()[1:4]
    assert header.split() == ["all", "resume", "render+lint", "total"]
    # slowest family first; checks with their counts, then render and lint, then the total
    assert rows[0].split() == ["image", "fsdp", "1m28s", "(1)", "-", "2.0s", "1m30s"]
    assert rows[1].split() == [
        "classification",
        "-",
        "28.0s",
        "(1)",
        "4.0s",
        "(1)",
        "4.0s",
        "36.0s",
    ]
