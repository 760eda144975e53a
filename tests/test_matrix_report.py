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
    assert "check all on 1, checks resume on 2, --help on 1" in text
    assert "job time by check (the sum over combinations, all jobs together): " in text
    assert "all 30.0s (1), import 3.0s (1), resume 12.0s (2)" in text
    assert "FAILED classification-tensorboard-cpu at check" in text
    assert text.endswith("matrix wall time: 40.0s")


def test_the_cost_model_says_the_job_minutes_by_phase_and_what_one_more_answer_adds():
    outcomes = [_outcome("none", "all", 62.0), _outcome("wandb", "lint", 2.0)]

    text = report.summary(outcomes, wall=40.0)

    # a lint-only combination's render (1 s) is every combination's: 2 s of render in all
    assert "job-minutes by phase: render 0.0, lint 0.0, all 1.0 (1)" in text
    # 15 primaries at 60 s (the check all less its render and lint), and 2 more renders of 1 s
    assert "15 primaries at 60.0 s a check all and 2 more renders: about 15.0 job-minutes" in text


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
