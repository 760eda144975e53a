"""`diagnose` reads a run's records and names what the training rules' triage table would.

The fast tests write run folders by hand (run.json and metrics.jsonl shaped as `train` writes
them), one with each symptom and one healthy, and run the rendered project's own diagnose on
them; the slow ones train real runs with a planted cause and assert the finding it produced, and
that the default run of every task has none.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from test_project import render, run

from scaffold.render import new_project

MAX_STEPS = 2000
CONFIG = {  # the fields diagnose reads, at the default project's values
    "max_steps": MAX_STEPS,
    "warmup_steps": 100,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "grad_clip": 1.0,
    "patience": 10,
    "dropout": 0.1,
    "num_workers": 0,
}


def _diagnose_module(folder: Path, name: str, answers: dict):
    """A fresh render's diagnose module, imported (and forgotten after)."""
    project = new_project(folder / name, answers, git=False).path
    sys.path.insert(0, str(project / "src"))
    try:
        yield importlib.import_module(f"{name}.tools.diagnose")
    finally:
        sys.path.remove(str(project / "src"))
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


@pytest.fixture(scope="module")
def diag(tmp_path_factory):
    """The default project's diagnose module."""
    yield from _diagnose_module(tmp_path_factory.mktemp("d"), "diagproj", {})


@pytest.fixture(scope="module")
def diag16(tmp_path_factory):
    """An fp16 project's: only it reads the gradient scaler's skipped steps."""
    yield from _diagnose_module(tmp_path_factory.mktemp("d16"), "diagproj16", {"precision": "fp16"})


def lr_at(step: int, cfg: dict) -> float:
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
    progress = min(1.0, (step - cfg["warmup_steps"]) / (cfg["max_steps"] - cfg["warmup_steps"]))
    return cfg["min_lr"] + (cfg["lr"] - cfg["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))


def healthy_loss(step: int) -> float:
    return 0.3 + 1.1 * math.exp(-step / 300)


def write_run(
    run_dir: Path,
    *,
    train=healthy_loss,
    val=lambda step: healthy_loss(step) + 0.05,
    grad_norm=lambda step: 0.6,
    last_step: int = MAX_STEPS,
    finished: dict | None = None,
    extra=lambda step: {},
    accuracy=lambda step: 0.7,
    **config,
) -> Path:
    """A run folder as `train` leaves it: train records every 10 steps, validation every 100."""
    cfg = {**CONFIG, **config}
    rng = np.random.default_rng(0)
    lines = []
    for step in range(10, last_step + 1, 10):
        loss = train(step) * (1 + 0.02 * rng.standard_normal())
        record = {"step": step, "split": "train", "loss": loss, "lr": lr_at(step - 1, cfg)}
        lines.append({**record, "grad_norm": grad_norm(step), **extra(step)})
        if step % 100 == 0:
            lines.append(
                {"step": step, "split": "val", "loss": val(step), "accuracy": accuracy(step)}
            )
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    done = {"step": last_step, "seconds": 10.0, "examples_per_s": 50_000.0, "data_wait_share": 0.02}
    record = {
        "project": "demo",
        "config": cfg,
        "seed": 0,
        "precision": "fp32",
        "git": {"commit": "a" * 40, "dirty": False},
        "versions": {"torch": "2.13.0"},
        "finished": done,
    }
    if finished is not None:
        record["finished"] = {**done, **finished}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def names(diag, run_dir: Path) -> list[str]:
    return [f.name for f in diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)]


def test_a_healthy_run_has_no_finding(diag, tmp_path):
    assert names(diag, write_run(tmp_path / "ok")) == []


def test_nan_names_the_step_and_what_came_before(diag, tmp_path):
    run_dir = write_run(tmp_path / "nan", train=lambda s: math.nan if s >= 500 else healthy_loss(s))
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "nan" and finding.step == 500
    assert "loss nan at step 500" in finding.evidence and "before it, step 490" in finding.evidence
    assert "learning rate too high" in finding.line()


def test_fp16_skips_are_nan_only_past_a_few(diag16, tmp_path):
    few = write_run(tmp_path / "few", grad_norm=lambda s: math.inf if s == 10 else 0.6,
                    extra=lambda s: {"skipped_steps": 3})  # fmt: skip
    assert names(diag16, few) == []  # the scaler finding its scale at the start
    many = write_run(tmp_path / "many", extra=lambda s: {"skipped_steps": s // 5})
    [finding] = diag16.diagnose(diag16.load_run(str(many)), leak_test=False)
    assert finding.name == "nan" and "skipped by the gradient scaler" in finding.evidence
    assert "check the scaler" in finding.line()


def test_without_fp16_an_infinite_gradient_norm_is_nan_and_no_scaler_is_named(diag, tmp_path):
    run_dir = write_run(tmp_path / "inf", grad_norm=lambda s: math.inf if s == 10 else 0.6)
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "nan" and "grad_norm inf at step 10" in finding.evidence
    assert "scaler" not in finding.line() and "fp16" not in finding.line()


def test_flat_from_step_zero(diag, tmp_path):
    run_dir = write_run(
        tmp_path / "flat", train=lambda s: 1.386, val=lambda s: 1.386, grad_norm=lambda s: 0.0
    )
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "flat"
    assert "no gradient reaches the parameters" in finding.evidence  # grad_norm 0 throughout


def overfit_val(step: int) -> float:
    return 0.9 - step / 1000 if step <= 300 else 0.6 + (step - 300) / 1000


def test_overfitting_from_the_best_validation(diag, tmp_path):
    run_dir = write_run(tmp_path / "over", val=overfit_val, patience=0)
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "overfitting" and finding.step == 300
    assert "best 0.6 at step 300" in finding.evidence


def test_overfitting_that_early_stopping_ended_is_not_a_finding(diag, tmp_path):
    run_dir = write_run(
        tmp_path / "stopped", val=overfit_val, last_step=1300, finished={"step": 1300}
    )
    assert names(diag, run_dir) == []


def with_classes(run_dir: Path, classes: int) -> Path:
    """The run's data as image and classification runs record it: the class names."""
    record = json.loads((run_dir / "run.json").read_text())
    record["data"] = {"classes": [f"c{i}" for i in range(classes)]}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def test_a_run_at_chance_accuracy_is_near_chance(diag, tmp_path):
    """Train falls, validation stays at chance: 0.30 on 4 classes, under a fifth of the way to 1."""
    run_dir = with_classes(
        write_run(tmp_path / "chance", val=lambda s: 1.0, accuracy=lambda s: 0.3), 4
    )
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "near-chance"
    assert "best val accuracy 0.300 against chance 0.250 (4 classes)" in finding.evidence
    assert "inspect-data" in finding.line() and "find-lr" in finding.line()
    healthy = with_classes(write_run(tmp_path / "learnt", accuracy=lambda s: 0.45), 4)
    assert names(diag, healthy) == []  # past 0.40, with its loss well below ln 4


def test_the_image_defaults_first_run_as_the_issue_found_it_is_near_chance(diag, tmp_path):
    """Stopped early at step 230 of 2,000 with val loss 1.32 against ln 4 = 1.386, accuracy 0.43 at
    best: diagnose said nothing."""
    run_dir = write_run(
        tmp_path / "first", train=lambda s: 1.4 - s / 1000, val=lambda s: 1.324,
        accuracy=lambda s: 0.43, last_step=230, finished={"step": 230},
    )  # fmt: skip
    [finding] = diag.diagnose(diag.load_run(str(with_classes(run_dir, 4))), leak_test=False)
    assert finding.name == "near-chance" and finding.step == 100
    assert (
        "best val loss 1.324 at step 100, 96% of the 1.386 before training (ln 4)"
        in finding.evidence
    )
    assert "early stopping ended it at step 230 of 2000" in finding.evidence


def test_an_early_stop_with_the_loss_still_high_is_stopped_early(diag, tmp_path):
    def falling(step: int) -> float:  # without classes: against the first logged train loss
        return 1.4 - step / 1000

    run_dir = write_run(
        tmp_path / "high", train=falling, val=lambda s: 0.9, last_step=400, finished={"step": 400}
    )
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "stopped-early" and finding.step == 400
    assert "before training (the first logged)" in finding.evidence
    assert "--patience" in finding.line()
    low = write_run(tmp_path / "low", last_step=1300, finished={"step": 1300})
    assert names(diag, low) == []  # early stopping after the loss fell: its purpose


def test_val_better_than_train_is_normal_only_with_dropout(diag, tmp_path):
    low_val = lambda s: 0.5 * healthy_loss(s)  # noqa: E731
    run_dir = write_run(tmp_path / "vbt", val=low_val, dropout=0.0)
    [finding] = diag.diagnose(diag.load_run(str(run_dir)))  # the leak test reads the synthetic data
    assert finding.name == "val-better-than-train"
    assert "no validation input is in train by hash and dropout is off" in finding.evidence
    normal = diag.load_run(str(write_run(tmp_path / "dropout", val=low_val)))
    assert diag.diagnose(normal) == []  # dropout 0.1 and no shared input: the rules' normal case


def test_spiky_against_a_running_median(diag, tmp_path):
    spiky = write_run(
        tmp_path / "spiky", train=lambda s: 3 * healthy_loss(s) if s % 400 == 0 else healthy_loss(s)
    )
    [finding] = diag.diagnose(diag.load_run(str(spiky)), leak_test=False)
    assert (
        finding.name == "spiky" and finding.step == 400 and finding.evidence.startswith("5 spikes")
    )
    once = write_run(
        tmp_path / "once", train=lambda s: 3 * healthy_loss(s) if s == 400 else healthy_loss(s)
    )
    assert names(diag, once) == []  # one bad batch is not a spiky run


def test_loader_bound_from_the_runs_own_wait(diag, tmp_path):
    run_dir = write_run(tmp_path / "slow", finished={"data_wait_share": 0.7})
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "loader-bound" and "waited for data 70%" in finding.evidence


def test_loader_bound_from_a_failed_loader_check_of_the_runs_code(diag, tmp_path):
    run_dir = write_run(tmp_path / "runs" / "a")
    record = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**record, "source_digest": "abc"}))
    summary = {"overfit_loss": 0.01, "resume_matched": True, "loader_share": 0.6}
    summary["checks"] = {"loader": False}  # as `check all` writes it, with what it checked:
    summary.update(source_digest="abc", data=record.get("data", {}), config=record["config"])
    (tmp_path / "runs" / "check").mkdir()
    (tmp_path / "runs" / "check" / "summary.json").write_text(json.dumps(summary))
    assert names(diag, run_dir) == ["loader-bound"]

    summary["source_digest"] = "edited"  # the checks of other code say nothing of this run
    (tmp_path / "runs" / "check" / "summary.json").write_text(json.dumps(summary))
    assert names(diag, run_dir) == []


def test_lr_still_in_warmup_when_the_run_ended(diag, tmp_path):
    run_dir = write_run(tmp_path / "short", last_step=60, max_steps=60)
    assert names(diag, run_dir) == ["lr-in-warmup"]


def test_a_schedule_that_ended_before_the_run(diag, tmp_path):
    # built for 1000 steps, then resumed to 2000: the second half runs at the floor
    run_dir = write_run(tmp_path / "sched", max_steps=1000)
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "schedule-ended-early"
    assert "it trained past the 1000 steps it was planned for: a resume with a higher" in (
        finding.evidence
    )  # the cause, which run.json's first plan tells


def test_a_schedule_edited_to_end_early_is_not_blamed_on_a_resume(diag, tmp_path):
    run_dir = write_run(tmp_path / "edited", max_steps=1000)  # the lr of a 1000-step plan...
    record = json.loads((run_dir / "run.json").read_text())
    record["config"]["max_steps"] = MAX_STEPS  # ...in a run planned for 2000: an edited lr_factor
    (run_dir / "run.json").write_text(json.dumps(record))
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert finding.name == "schedule-ended-early" and "planned for" not in finding.evidence


def test_a_schedule_restarted_by_a_resume(diag, tmp_path):
    # built for 300 steps, resumed at 300 with --max-steps 2000: the cosine starts again at its peak
    run_dir = write_run(tmp_path / "jump", train=healthy_loss)
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if r["split"] == "train":
            r["lr"] = lr_at(
                r["step"] - 1, {**CONFIG, "max_steps": 300 if r["step"] <= 300 else MAX_STEPS}
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    record = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**record, "resumed": [{"at_step": 300}]}))
    [finding] = diag.diagnose(diag.load_run(str(run_dir)), leak_test=False)
    assert (
        finding.name == "lr-jump"
        and finding.step == 310
        and "resumed at step 300" in finding.evidence
    )


def test_a_gradient_norm_pinned_at_the_clip(diag, tmp_path):
    run_dir = write_run(tmp_path / "clip", grad_norm=lambda s: 15.0)
    assert names(diag, run_dir) == ["grad-norm-pinned"]
    # just over the clip on every step, as the default language model's norms run: AdamW's
    # updates barely change, and the clip stays the safety the rules ask for
    assert names(diag, write_run(tmp_path / "near", grad_norm=lambda s: 1.5)) == []


def test_two_runs_name_the_fix(diag, tmp_path, capsys):
    before = write_run(
        tmp_path / "low", train=lambda s: 1.386, val=lambda s: 1.386, lr=1e-7, min_lr=0.0
    )
    after = write_run(tmp_path / "fixed")
    assert diag.run_diagnose([str(before), str(after)]) == 1  # the first run has a finding
    out = capsys.readouterr().out
    [fixed] = [line for line in out.splitlines() if line.startswith("**Issues fixed:**")]
    assert fixed.startswith(f"**Issues fixed:** flat in {before} -> train loss")
    assert "--lr 1e-07 -> 0.003" in fixed and "--min-lr 0.0 -> 0.0003" in fixed
    assert diag.run_diagnose([str(after)], as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["findings"] == []


def test_a_run_stopped_early_fixes_nothing(diag, tmp_path, capsys):
    """A finding absent from a run that a signal stopped may only not have shown yet."""
    before = write_run(
        tmp_path / "low", train=lambda s: 1.386, val=lambda s: 1.386, lr=1e-7, min_lr=0.0
    )
    after = write_run(tmp_path / "stopped", finished={"stopped_by": "SIGTERM", "step": 40})

    diag.run_diagnose([str(before), str(after)])

    out = capsys.readouterr().out
    assert "**Issues fixed:**" not in out
    assert f"flat not shown, but not fixed: {after} was stopped by SIGTERM at step 40" in out
    report = importlib.import_module(diag.__name__.replace(".diagnose", ".report"))
    lines = report.report(str(after), since=str(before)).splitlines()
    [line] = [ln for ln in lines if ln.startswith("**Issues fixed:**")]
    assert line == (
        f"**Issues fixed:** not judged: {after} was stopped by SIGTERM at step 40; "
        "compare a run that ran its course"
    )


def test_the_command_line_exit_status_and_json(tmp_path):
    project = render(tmp_path / "cli")
    flat = write_run(  # a non-ASCII name, once printed as "\u043f\u043b..."
        tmp_path / "плоский", train=lambda s: 1.386, val=lambda s: 1.386, grad_norm=lambda s: 0.0
    )
    done = run(project, "diagnose", flat, "--json")
    assert done.returncode == 1, done.stderr
    assert f'"run_dir": "{flat}"' in done.stdout
    [finding] = json.loads(done.stdout)["runs"][0]["findings"]
    assert finding["name"] == "flat" and finding["checks"].startswith("gradients not flowing")
    missing = run(project, "diagnose", tmp_path / "nowhere")
    assert (
        missing.returncode == 2
        and missing.stderr.startswith("error: ")
        and "Traceback" not in missing.stderr
    )
    report = run(project, "report", flat)
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[-1].startswith("**Issues found:** flat: train loss")


# --- real runs with a planted cause (slow: each trains a project) -------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default project, and a function that trains a run in it and diagnoses the run."""
    project = render(tmp_path_factory.mktemp("real") / "real")

    def train_and_diagnose(name: str, *options) -> list[dict]:
        done = run(project, "train", "--run-dir", f"runs/{name}", *options)
        assert done.returncode in (0, 1), done.stderr  # 1: stopped by a NaN, as planted
        diagnosed = run(project, "diagnose", f"runs/{name}", "--json")
        assert diagnosed.returncode in (0, 1), diagnosed.stderr
        return json.loads(diagnosed.stdout)["runs"][0]["findings"]

    return project, train_and_diagnose


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cause", "options", "expected"),
    [
        ("healthy", (), []),
        ("lr-far-too-high", ("--lr", "30", "--warmup-steps", "0"), ["nan"]),
        ("lr-far-too-low", ("--lr", "1e-7", "--min-lr", "0", "--max-steps", "300"), ["flat"]),
        (
            "tiny-split-trained-long",
            (
                "--max-train-examples",
                "256",
                "--patience",
                "0",
                "--dropout",
                "0",
                "--max-steps",
                "600",
            ),
            ["overfitting"],
        ),
        ("ends-in-warmup", ("--max-steps", "50"), ["lr-in-warmup"]),
    ],
)
def test_a_planted_cause_gives_its_finding(trained, cause, options, expected):
    _, train_and_diagnose = trained
    assert [f["name"] for f in train_and_diagnose(cause, *options)] == expected


@pytest.mark.slow
def test_detached_logits_are_flat_with_no_gradient(trained):
    project, train_and_diagnose = trained
    model = project / "src" / "real" / "model.py"
    text = model.read_text()
    detached = "F.cross_entropy(logits.float().detach().requires_grad_(), y)"
    model.write_text(text.replace("F.cross_entropy(logits.float(), y)", detached))
    try:
        [finding] = train_and_diagnose("detached", "--max-steps", "200")
    finally:
        model.write_text(text)
    assert finding["name"] == "flat" and "no gradient reaches the parameters" in finding["evidence"]


@pytest.mark.slow
def test_rows_duplicated_in_the_file_are_a_split_leak(trained, tmp_path):
    _, train_and_diagnose = trained
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "dup.npz", x=np.concatenate([x, x]), y=np.concatenate([y, y]))
    findings = train_and_diagnose("leak", "--data", tmp_path / "dup.npz", "--max-steps", "100")
    [leak] = [f for f in findings if f["name"] == "split-leak"]
    shared, n_val = map(
        int, leak["evidence"].split(" validation")[0].replace(",", "").split(" of ")
    )
    assert n_val == 200 and shared > 150  # each held-out row's twin is in train 90% of the time


@pytest.mark.slow
def test_find_lr_suggests_a_rate_and_leaves_no_run_folder(trained, tmp_path):
    project, _ = trained
    before = (
        sorted(p.name for p in (project / "runs").iterdir()) if (project / "runs").exists() else []
    )
    done = run(project, "find-lr", "-o", tmp_path / "lr.png", "--range-steps", "100")
    assert done.returncode == 0, done.stderr
    suggested = float(done.stdout.split("suggested --lr ")[1].split()[0])
    assert 1e-5 < suggested < 1.0  # between the flat start and the divergence of the sweep
    assert (tmp_path / "lr.png").stat().st_size > 0
    after = (
        sorted(p.name for p in (project / "runs").iterdir()) if (project / "runs").exists() else []
    )
    assert after == before
