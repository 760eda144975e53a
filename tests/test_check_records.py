"""A `check all` says what it checked (the commit taken as it starts, a digest of the source, the
data and the config), `report` shows its Sanity line only for a run of that code, data and
settings, and two checks never share their folder."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_project import _command, _env, render, run

SHORT = ("--max-steps", "12", "--eval-every", "6")  # options a check of the run need not share


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The default project with a run, then `check all` on the same code, data and settings."""
    project = render(tmp_path_factory.mktemp("c") / "demo")
    assert run(project, "train", "--run-dir", "runs/first", *SHORT).returncode == 0
    done = run(project, "check", "all")
    assert done.returncode == 0, done.stdout + done.stderr
    return project, done


@pytest.fixture(scope="module")
def project(checked) -> Path:
    return checked[0]


def test_each_check_says_on_stderr_what_it_is_doing_and_how_long_it_took(checked):
    lines = checked[1].stderr.splitlines()

    by_check: dict[str, list[str]] = {}  # what each check said, in order: its start, phases, end
    for line in lines:
        name, said = line.split(": ", 1)
        by_check.setdefault(name, []).append(said)
    assert list(by_check) == [
        f"check {name}" for name in ("overfit", "batch", "init", "loader", "resume")
    ]
    assert lines[0] == "check overfit: memorising one batch of 8 (at most 300 steps)..."
    for said in by_check.values():
        assert said[0].endswith("...") and re.fullmatch(r"done in \d+\.\d s", said[-1]), said
    assert (
        "training steps with the loader..." in by_check["check loader"]
    )  # its phases said as they start


def sanity(project: Path, run_dir: str) -> str:
    done = run(project, "report", run_dir)
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stdout.splitlines() if line.startswith("**Sanity:**"))


def test_the_summary_records_what_was_checked(project):
    summary = json.loads((project / "runs/check/summary.json").read_text())
    record = json.loads((project / "runs/first/run.json").read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True, check=True
    ).stdout.strip()

    assert summary["git"] == {"commit": head, "dirty": False}
    assert summary["source_digest"] == record["source_digest"]
    assert summary["data"]["source"] == "synthetic" == record["data"]["source"]
    assert summary["data"]["digest"] == record["data"]["digest"]
    assert summary["config"]["hidden_dim"] == record["config"]["hidden_dim"]
    assert summary["started"] <= summary["finished"]


def test_report_shows_the_checks_only_for_a_run_of_their_code_data_and_settings(project):
    assert sanity(project, "runs/first").startswith("**Sanity:** overfit-one-batch loss ")

    assert (
        run(project, "train", "--run-dir", "runs/wide", "--hidden-dim", "64", *SHORT).returncode
        == 0
    )
    assert "ran on other settings (--hidden-dim)" in sanity(project, "runs/wide")

    rng = np.random.default_rng(0)
    rows = np.column_stack([rng.normal(size=(600, 4)), rng.integers(0, 2, 600)])
    np.savetxt(project / "table.csv", rows, delimiter=",", header="a,b,c,d,label", comments="")
    assert (
        run(project, "train", "--run-dir", "runs/table", "--data", "table.csv", *SHORT).returncode
        == 0
    )
    assert "ran on other data" in sanity(project, "runs/table")

    model = project / "src" / "demo" / "model.py"
    model.write_text(model.read_text() + "\n# an edit\n")
    assert run(project, "train", "--run-dir", "runs/edited", *SHORT).returncode == 0
    line = sanity(project, "runs/edited")
    assert "**Sanity:** not checked on this run's code and data: the last checks" in line
    assert "ran on other code: python -m demo check all" in line
    assert sanity(project, "runs/first").startswith("**Sanity:** overfit-one-batch loss ")


def test_a_second_check_on_the_same_folder_is_refused_in_one_line(tmp_path):
    project = render(tmp_path / "demo")
    first = subprocess.Popen(
        _command(project, ["check", "all"]),
        cwd=project,
        env=_env(project),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    lock = project / "runs" / "check" / ".lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().startswith("pid")):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)

    second = run(project, "check", "resume")

    assert first.wait(timeout=300) == 0
    assert lock.read_text().startswith(f"pid {first.pid} on ")
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        f"error: runs/check is in use by {lock.read_text().strip()}: wait for it to end, or train "
        "into another --run-dir"
    ]


def test_a_check_refused_on_bad_data_leaves_no_folder_behind(tmp_path):
    project = render(tmp_path / "demo")

    done = run(project, "check", "all", "--data", "nowhere.csv")

    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "error: nowhere.csv: no such file"
    assert not (project / "runs").exists()
