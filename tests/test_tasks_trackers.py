"""Every task passes its checks, and every tracker holds exactly one value per step after a run
that was killed and resumed, read back from the tracker's own files, without network."""

from __future__ import annotations

import glob
import json
import struct

import pytest
from test_project import kill_then_resume, records, render, run

# Each task's `check all` is the matrix's: every task, with every distributed and precision answer,
# runs it there (scaffold/matrix/plan.py), compiled and accumulating too; not repeated here.


def test_generation_samples_text_from_a_checkpoint(tmp_path):
    project = render(tmp_path / "gen", task="generation")
    trained = run(
        project, "train", "--run-dir", "runs/g", "--max-steps", "30", "--eval-every", "15"
    )
    assert trained.returncode == 0, trained.stderr
    done = run(
        project,
        "sample",
        "--checkpoint",
        "runs/g/checkpoints/best.pt",
        "--prompt",
        "The ",
        "--max-new-tokens",
        "40",
        "--top-k",
        "5",
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout.rstrip("\n")
    assert text.startswith("The ") and len(text) == 44
    refused = run(
        project, "sample", "--checkpoint", "runs/g/checkpoints/best.pt", "--prompt", "Zürich"
    )
    assert refused.returncode == 2 and "never saw" in refused.stderr


def test_report_and_plot_summarise_runs(tmp_path):
    project = render(tmp_path / "rep", task="regression")
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        done = run(
            project,
            "train",
            "--run-dir",
            f"runs/{name}",
            "--max-steps",
            "40",
            "--eval-every",
            "20",
            "--lr",
            lr,
        )
        assert done.returncode == 0, done.stderr
    report = run(project, "report", "runs/a")
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "**Run:**",
        "**Sanity:**",
        "**Throughput:**",
        "**Results:**",
    ]
    best = min(
        (r for r in records(project / "runs" / "a") if r["split"] == "val"), key=lambda r: r["loss"]
    )
    assert f"at step {best['step']}" in lines[3] and "r2" in lines[3] and "mae" in lines[3]
    plotted = run(project, "plot", "runs/a", "runs/b", "-o", "curves.png")
    assert plotted.returncode == 0, plotted.stderr
    assert (project / "curves.png").read_bytes()[:4] == b"\x89PNG"


def _kill_then_resume(project, run_dir: str) -> None:
    """Runs 60 steps, killed after step 35 is logged, then resumed to the end."""
    done = kill_then_resume(project, run_dir, kill_after=35, WANDB_SILENT="true")
    assert "resuming from" in done.stdout


def _expected(project, run_dir: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records(project / run_dir):
        for name, value in record.items():
            if name not in ("step", "split"):
                series.setdefault(f"{record['split']}/{name}", []).append((record["step"], value))
    return series


@pytest.mark.slow
def test_tensorboard_has_one_value_per_step_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = render(tmp_path / "tb", tracker="tensorboard")
    _kill_then_resume(project, "runs/tb")
    events = EventAccumulator(str(project / "runs" / "tb" / "tensorboard"))
    events.Reload()
    for tag, expected in _expected(project, "runs/tb").items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], tag  # each step once, in order
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), (
            tag
        )  # float32


@pytest.mark.slow
def test_mlflow_has_one_value_per_step_after_a_resume(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the project's tracker does
    project = render(tmp_path / "ml", tracker="mlflow")
    _kill_then_resume(project, "runs/ml")
    client = MlflowClient(tracking_uri=(project / "runs" / "ml" / "mlruns").as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1  # the resumed process continued the same MLflow run
    run_id = runs[0].info.run_id
    assert json.loads(runs[0].data.params["seed"]) == 0 and "git" in runs[0].data.params
    for tag, expected in _expected(project, "runs/ml").items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
        assert got == expected, tag


def _wandb_history(path: str) -> list[dict]:
    """History rows of an offline W&B run file (a log of 32 KiB blocks of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    rows, pos, pending = [], 7, b""  # 7: the file header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room left in a block for a record header
            pos += 32768 - pos % 32768
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


@pytest.mark.slow
def test_wandb_offline_has_one_value_per_step_after_a_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    project = render(tmp_path / "wb", tracker="wandb")
    _kill_then_resume(project, "runs/wb")
    files = sorted(
        glob.glob(str(project / "runs" / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    )
    assert len(files) == 2 and len({f.rsplit("-", 1)[1] for f in files}) == 1  # one run id, resumed
    rows = [row for path in files for row in _wandb_history(path)]
    resumed_at = json.loads((project / "runs" / "wb" / "run.json").read_text())["resumed"][0][
        "at_step"
    ]
    for tag, expected in _expected(project, "runs/wb").items():
        got = [(row["_step"], row[tag]) for row in rows if tag in row]
        steps = [step for step, _ in got]
        assert steps == sorted(set(steps)), (
            tag
        )  # strictly increasing: "Step must only increase" never
        assert set(got) <= set(expected), tag  # every value is the one metrics.jsonl holds
        # W&B's service writes offline files when a run ends, so a SIGKILL loses what the killed
        # process had sent; everything from the resumed checkpoint on is there.
        assert [p for p in expected if p[0] > resumed_at] == [
            p for p in got if p[0] > resumed_at
        ], tag
