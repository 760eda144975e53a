"""Generated projects behave as their README promises (templates/project/README.md.jinja: "Work
in this order", "Data", "The run folder", "Checkpoints"): checks, exact resume after a kill,
corrupt checkpoints, refused resumes, clear data errors and complete run records.

Each test renders a project and drives it as its user would, through `python -m <package>`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warm_python
from conftest import check_passed_line, checks_passed

from scaffold.render import new_project

# One compile cache for every project these tests run: compiling the same graphs is paid once.
INDUCTOR_CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "inductor"

# Small and fast, with the structure that matters: 16 steps an epoch, checkpoints every 10.
SMALL_RUN = (
    "--max-train-examples",
    "1024",
    "--batch-size",
    "64",
    "--ckpt-every",
    "10",
    "--eval-every",
    "25",
    "--log-every",
    "1",
    "--deterministic",
    "--num-workers",
    "1",
)


def render(dest: Path, **answers) -> Path:
    return new_project(dest, answers).path


def run(project: Path, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    if not kwargs:  # forked from a warm interpreter (tests/warm_python.py)
        return warm_python.run(_command(project, args), cwd=project, env=_env(project), timeout=600)
    return subprocess.run(
        _command(project, args),
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


def _command(project: Path, args) -> list[str]:
    package = next((project / "src").iterdir()).name
    return [sys.executable, "-m", package, *map(str, args)]


def _env(project: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(project / "src"),
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
    }


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("p") / "demo")


@pytest.fixture(scope="module")
def finished(project) -> Path:
    """A completed 60-step run, the reference the resume tests compare against."""
    done = run(project, "train", "--run-dir", "runs/reference", "--max-steps", "60", *SMALL_RUN)
    assert done.returncode == 0, done.stderr
    return project / "runs" / "reference"


@pytest.mark.parametrize(
    "answers",
    [{}],
    ids=["default"],  # every other combination's checks are the matrix's (scaffold matrix)
)
def test_check_all_passes_and_prints_the_summary(answers, tmp_path):
    project = render(tmp_path / "proj", **answers)
    done = run(project, "check", "all", "--device", "cpu")
    assert checks_passed(done), done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[-3:]] == [
        "**Run:**",
        "**Sanity:**",
        "**Throughput:**",
    ]
    assert "resume check matched: yes; batch independence pass" in lines[-2]
    commit = lines[-3].split("commit ")[1].split(",")[0]
    assert len(commit) == 12 and commit != "none"  # the project's own first commit
    for name in ("overfit", "batch", "init", "loader", "resume"):
        assert check_passed_line(done.stdout, name), done.stdout


def test_the_projects_own_tests_pass(project):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed" in done.stdout


def kill_at_step(project: Path, args: list, step: int, env: dict | None = None) -> None:
    """Runs the project's command `args`, SIGKILLed once it logs `step`."""
    env = env or _env(project)
    with subprocess.Popen(
        _command(project, args), cwd=project, env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def kill_then_resume(
    project: Path, run_dir: str, kill_after: int, **env
) -> subprocess.CompletedProcess:
    """Trains 60 small steps in `run_dir`, SIGKILLed once step `kill_after` is logged, then runs
    the same command again to resume it; returns the resumed run."""
    args = ["train", "--run-dir", run_dir, "--max-steps", "60", *SMALL_RUN]
    env = {**_env(project), **env}
    kill_at_step(project, args, kill_after, env)
    done = subprocess.run(
        _command(project, args), cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done


def test_a_killed_run_resumes_to_the_same_records(project, finished):
    done = kill_then_resume(project, "runs/killed", kill_after=25)
    resumed_at = int(done.stdout.split("resuming from ")[1].split(" at step ")[1].split()[0])
    assert 20 <= resumed_at < 60
    assert records(project / "runs" / "killed") == records(finished)  # one record a step, all equal


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(
    project, finished, tmp_path
):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(copy)], check=True)
    newest = copy / "checkpoints" / "step-00000060.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    (copy / "checkpoints" / "step-00000050.pt").write_bytes(b"")  # zero bytes
    stale = copy / "checkpoints" / ".step-00000070.pt.tmp"  # a save cut short by a crash
    stale.write_bytes(b"partial")

    done = run(project, "train", "--run-dir", copy, "--max-steps", "60", *SMALL_RUN)
    assert done.returncode == 0, done.stderr
    assert "step-00000060.pt is unreadable" in done.stdout
    assert "step-00000050.pt is unreadable" in done.stdout
    assert f"resuming from {copy / 'checkpoints' / 'step-00000040.pt'} at step 40" in done.stdout
    assert records(copy) == records(finished)
    assert not stale.exists()


def test_no_usable_checkpoint_is_an_error_naming_the_files(project, finished, tmp_path):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished), str(copy)], check=True)
    for path in (copy / "checkpoints").glob("step-*.pt"):
        path.write_bytes(b"not a checkpoint")
    done = run(project, "train", "--run-dir", copy, "--max-steps", "60", *SMALL_RUN)
    assert done.returncode == 1
    assert done.stderr.startswith("error: no usable checkpoint")
    for step in (40, 50, 60):
        assert f"step-{step:08d}.pt" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_resume_that_changes_the_model_is_refused(project, finished):
    before = (finished / "metrics.jsonl").read_bytes()
    done = run(
        project,
        "train",
        "--run-dir",
        finished,
        "--max-steps",
        "80",
        *SMALL_RUN,
        "--hidden-dim",
        "64",
    )
    assert done.returncode == 2
    assert "hidden_dim 256 -> 64" in done.stderr
    assert (finished / "metrics.jsonl").read_bytes() == before


def test_run_records_hold_what_was_run(finished):
    run_json = json.loads((finished / "run.json").read_text())
    assert run_json["seed"] == 0 and run_json["config"]["max_steps"] == 60
    assert len(run_json["git"]["commit"]) == 40
    assert {"python", "torch", "numpy"} <= run_json["versions"].keys()
    assert run_json["command"][0].endswith("__main__.py") and run_json["started"]

    metrics = records(finished)
    train = [r for r in metrics if r["split"] == "train"]
    val = [r for r in metrics if r["split"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 61))
    assert [r["step"] for r in val] == [25, 50, 60]
    assert set(train[0]) == {"step", "split", "loss", "lr", "grad_norm"}
    assert set(val[0]) == {"step", "split", "loss", "accuracy"}
    assert train[-1]["loss"] < train[0]["loss"]
    saved = sorted(p.name for p in (finished / "checkpoints").iterdir())
    assert saved == ["best.pt", "step-00000040.pt", "step-00000050.pt", "step-00000060.pt"]


def test_learns_a_csv_and_an_npz_file(project, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1200, 6))
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(int) + 2 * (x[:, 3] > 0.5)  # 4 classes
    np.savez(tmp_path / "d.npz", x=x, y=y)
    rows = ["a,b,c,d,e,f,label"] + [
        ",".join(map(str, [*row, label])) for row, label in zip(x, y, strict=True)
    ]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    for name in ("d.npz", "d.csv"):
        run_dir = tmp_path / f"run-{name}"
        done = run(
            project,
            "train",
            "--data",
            tmp_path / name,
            "--run-dir",
            run_dir,
            "--max-steps",
            "300",
            "--eval-every",
            "100",
            "--batch-size",
            "64",
            "--warmup-steps",
            "20",
        )
        assert done.returncode == 0, done.stderr
        best = max(r["accuracy"] for r in records(run_dir) if r["split"] == "val")
        assert best > 0.85, (name, best)


@pytest.mark.parametrize(
    ("name", "content", "args", "expected"),
    [
        ("bad.csv", "a,b,label\n1,2,0\n3,4,1.5\n", (), "label of example 1 is 1.5"),
        ("bad.csv", "", (), "bad.csv: need a header row"),
        ("bad.csv", b"a,b,label\n1,2,\xff\n", (), "bad.csv: not UTF-8"),
        (
            "bad.csv",
            "a,b,label\n1,2,3\n3,4,3\n",
            (),
            "bad.csv: one class only (label 3): a classifier needs two or more",
        ),
        (
            "bad.csv",
            "1,2,0\n3,4,1\n",
            (),
            "bad.csv:1: every field is a number: the file needs a header row naming its columns",
        ),
        (
            "bad.csv",
            "a,b,kind\n1,x,0\n2,y,1\n",
            ("--label", "species"),
            "no column 'species' (--label)",
        ),
        ("bad.csv", "a,b,label\n1,2,\n3,4,\n", (), "bad.csv: 'label' (the last column: no --label"),
        ("bad.parquet", "a,b\n1,2\n", (), "bad.parquet: not a readable Parquet file"),
    ],
    ids=[
        "fractional-label",
        "empty",
        "not-utf8",
        "one-class",
        "no-header",
        "no-label-column",
        "empty-label",
        "not-parquet",
    ],
)
def test_malformed_tables_are_named_before_training(
    project, tmp_path, name, content, args, expected
):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = run(project, "train", "--data", path, *args, "--run-dir", tmp_path / "run")
    assert done.returncode == 2
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_a_label_without_a_table_is_refused(project, tmp_path):
    """--label names a column of --data: on the synthetic default it would be dropped unseen."""
    done = run(project, "train", "--label", "species", "--run-dir", tmp_path / "run")
    assert done.returncode == 2 and not (tmp_path / "run").exists()
    assert done.stderr.strip() == (
        "error: --label species names a column of a table: give the table with --data"
    )


def _table(n: int, seed: int) -> dict[str, list]:
    """A table as it comes: an id, text with gaps, numbers with gaps, and a text label."""
    rng = np.random.default_rng(seed)
    island = rng.choice(["Biscoe", "Dream", "Torgersen"], n).tolist()
    mass = rng.normal(4000, 600, n)
    species = [
        "Gentoo" if m > 4300 else ("Chinstrap" if i == "Dream" else "Adelie")
        for m, i in zip(mass, island, strict=True)
    ]
    return {
        "penguin": [f"p{seed}-{i:04d}" for i in range(n)],
        "island": [None if i % 17 == 0 else v for i, v in enumerate(island)],
        "mass": [None if i % 13 == 0 else round(float(v), 1) for i, v in enumerate(mass)],
        "species": species,
    }


def test_a_table_as_it_comes_trains_resumes_and_predicts(project, tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    pq.write_table(pa.table(_table(600, 0)), tmp_path / "train.parquet")
    args = ("--data", tmp_path / "train.parquet", "--label", "species", "--batch-size", "64")
    done = run(project, "check", "resume", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "column 'penguin' is unique on every row, an id: left out" in done.stderr

    run_dir = tmp_path / "run"
    done = run(
        project, "train", *args, "--run-dir", run_dir, "--max-steps", "40", "--eval-every", "20"
    )
    assert done.returncode == 0, done.stderr
    saved = json.loads((run_dir / "run.json").read_text())["data"]
    assert saved["classes"] == ["Adelie", "Chinstrap", "Gentoo"] and saved["ids"] == ["penguin"]
    island, mass = saved["columns"]
    assert island["type"] == "text" and island["indicator"] and len(island["levels"]) == 3
    assert mass["type"] == "number" and 0 < mass["missing"] < 0.2

    rows = _table(50, 1)
    rows["island"][3] = "Atlantis"  # a level training never saw
    del rows["species"]
    pa_csv.write_csv(pa.table(rows), tmp_path / "new.csv")
    out = tmp_path / "out" / "predictions.csv"
    best = run_dir / "checkpoints" / "best.pt"
    done = run(project, "predict", tmp_path / "new.csv", "-o", out, "--checkpoint", best)
    assert done.returncode == 0, done.stderr
    predicted = pa_csv.read_csv(out).to_pydict()
    assert list(predicted) == ["penguin", "species", "p_Adelie", "p_Chinstrap", "p_Gentoo"]
    assert predicted["penguin"] == rows["penguin"]  # in order, ids kept
    assert (
        sum(a == b for a, b in zip(predicted["species"], _table(50, 1)["species"], strict=True))
        >= 35
    )
    total = np.add(predicted["p_Adelie"], predicted["p_Chinstrap"]) + predicted["p_Gentoo"]
    assert np.allclose(total, 1, atol=1e-4)

    del rows["mass"]
    pa_csv.write_csv(pa.table(rows), tmp_path / "short.csv")
    done = run(
        project, "predict", tmp_path / "short.csv", "-o", tmp_path / "x.csv", "--checkpoint", best
    )
    assert (
        done.returncode == 2 and "no column 'mass', which the model was trained on" in done.stderr
    )
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "x.csv").exists()


def test_commands_that_read_a_run_read_the_newest_unless_named(tmp_path):
    project = render(tmp_path / "fresh")
    for command in (["report"], ["diagnose"], ["plot"], ["export"], ["predict", "rows.csv"]):
        done = run(project, *command)
        assert done.returncode == 1, (command, done.stderr)
        assert (
            done.stderr
            == "error: no run under runs/ to read: train one first (python -m fresh train)\n"
        )

    for name in ("first", "second"):
        done = run(project, "train", "--run-dir", f"runs/{name}", "--max-steps", "20", *SMALL_RUN)
        assert done.returncode == 0, done.stderr
    reading = "reading runs/second (the newest run under runs/)\n"
    reported = run(project, "report")
    assert reported.returncode == 0 and reported.stderr == reading, reported.stderr
    assert "config runs/second/run.json" in reported.stdout
    diagnosed = run(project, "diagnose", "--json")
    assert diagnosed.stderr == reading and json.loads(diagnosed.stdout)  # stdout stays JSON
    exported = run(project, "export")
    assert exported.returncode == 0 and exported.stderr == reading, exported.stderr
    assert (project / "runs/second/checkpoints/best.pt.model.pt").exists()

    named = run(project, "report", "runs/first")  # a run named is read, and nothing is said
    assert named.returncode == 0 and named.stderr == "" and "runs/first/run.json" in named.stdout
    later = (project / "runs/second/run.json").stat().st_mtime + 10
    os.utime(project / "runs/first/run.json", (later, later))  # as a resumed runs/first would
    assert run(project, "report").stderr == reading.replace("second", "first")


def test_a_run_dir_that_is_a_file_is_named_in_one_line(project, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for run_dir in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run"):
        done = run(project, "train", "--run-dir", run_dir, "--max-steps", "5")
        assert done.returncode == 1
        assert done.stderr.splitlines()[-1] == (
            f"error: --run-dir {run_dir}: {tmp_path / 'notes.txt'} is a file: name a folder"
        )
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_folder_for_a_file_is_named_as_a_folder(project, tmp_path):
    done = run(project, "train", "--data", tmp_path, "--run-dir", tmp_path / "r")
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: {tmp_path}: a folder, not a file: expected a .csv, .parquet or .npz file\n"
    )
    assert not (tmp_path / "r").exists()


def test_an_npz_without_labels_is_named(project, tmp_path):
    np.savez(tmp_path / "x_only.npz", x=np.zeros((10, 3)))
    done = run(project, "train", "--data", tmp_path / "x_only.npz", "--run-dir", tmp_path / "r")
    assert done.returncode == 2
    assert "x_only.npz: missing array(s) y" in done.stderr
    assert not (tmp_path / "r").exists()  # refused before the run folder was made


def test_inspect_data_shows_shapes_labels_and_examples(project):
    done = run(project, "inspect-data")
    assert done.returncode == 0, done.stderr
    assert "train: 3,686 examples, x (16,) torch.float32, y torch.int64" in done.stdout
    assert "label counts" in done.stdout and "example 0: label" in done.stdout


def test_early_stopping_ends_the_run_when_validation_stops_improving(project, tmp_path):
    # 64 training examples without dropout: the model memorises them and validation worsens.
    args = (
        "--max-train-examples",
        "64",
        "--batch-size",
        "32",
        "--dropout",
        "0",
        "--lr",
        "1e-2",
        "--eval-every",
        "20",
        "--patience",
        "3",
        "--max-steps",
        "5000",
        "--warmup-steps",
        "0",
    )
    done = run(project, "train", "--run-dir", tmp_path / "run", *args)
    assert done.returncode == 0, done.stderr
    assert "early stop: no better validation in 3 since step" in done.stdout
    val = [r for r in records(tmp_path / "run") if r["split"] == "val"]
    best = min(range(len(val)), key=lambda i: val[i]["loss"])
    assert (
        len(val) == best + 4 and val[-1]["step"] < 5000
    )  # stopped three validations after the best
    assert (tmp_path / "run" / "checkpoints" / f"step-{val[-1]['step']:08d}.pt").exists()
