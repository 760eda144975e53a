"""Fine-tuning renders (finetune: yes): --freeze and --unfreeze-at, the body's lower learning rate,
and --ema. `check resume` crosses the unfreeze step with the average on and proves the frozen
weights unchanged, under one process, ddp and fsdp; edits that break freezing or the average's
resume make it fail; the average leaves training alone, validates and is exported."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import warm_python
from test_ddp import _env_ddp, _torchrun
from test_project import SMALL_RUN, _env, kill_at_step, records, render, run

MOVED = "CHANGED between step 1 and 10"
SHORT = ("--max-train-examples", "1024", "--batch-size", "32", "--eval-every", "5",
         "--log-every", "1", "--ckpt-every", "100", "--deterministic",
         "--num-workers", "0")  # fmt: skip


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("ft") / "ft-tables", finetune=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("ft") / "ft-images", task="image", finetune=True)


def _python(project: Path, code: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    package = next((project / "src").iterdir()).name
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code).replace("PKG", package)],
        cwd=project, env=env or _env(project), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _edited(project: Path, tmp_path: Path, old: str, new: str) -> Path:
    """A copy of `project` whose runtime/finetune.py has `old` replaced by `new`."""
    copy = tmp_path / project.name
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("runs", ".checks"))
    path = next((copy / "src").iterdir()) / "runtime" / "finetune.py"
    source = path.read_text()
    assert old in source
    path.write_text(source.replace(old, new))
    return copy


@pytest.mark.parametrize("fixture", ["tables", "images"])
def test_check_resume_crosses_the_unfreeze_with_the_average_on(fixture, request):
    """The image model's body holds BatchNorm layers: their statistics are among the tensors that
    must not move while frozen (in training mode they would)."""
    done = run(request.getfixturevalue(fixture), "check", "resume")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("resume: "))
    assert line.startswith("resume: PASS"), line
    assert "final model, optimizer and --ema average equal; --ema 0.9" in line
    body = "body" if fixture == "tables" else "stem,stages"
    assert (
        f"--freeze {body} to step 15: " in line
        and "bit-identical from step 1 to 10, trained by 20" in line
    )


@pytest.mark.parametrize(
    ("fixture", "old", "new", "says"),
    [
        ("images", "norm.train(not self.frozen)", "norm.train(True)", MOVED),
        ("tables", "p.grad = None", "pass", MOVED),
        ("tables", "self.steps.copy_(steps)", "pass", "average DIFFER"),
        ("tables", "average.copy_(averages[name])", "pass", "validation losses DIFFER"),
    ],
    ids=["frozen-batchnorm-trains", "frozen-weights-step", "average-steps-lost", "average-lost"],
)  # fmt: skip
def test_check_resume_fails_when_freezing_or_the_average_breaks(
    fixture, old, new, says, request, tmp_path
):
    broken = _edited(request.getfixturevalue(fixture), tmp_path, old, new)
    done = run(broken, "check", "resume")
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("resume: "))
    assert line.startswith("resume: FAIL") and says in line, line


def test_frozen_parameters_are_neither_updated_nor_decayed_and_the_body_learns_slower(tables):
    done = _python(
        tables,
        """
        import itertools
        import torch
        from PKG.config import Config
        from PKG.data import load_splits
        from PKG.runtime.engine import Engine, setup
        from PKG.tools.checks import first_batches
        from PKG.train import train_step

        cfg = Config(freeze="body", unfreeze_at=3, init_from="w.pt", weight_decay=0.5, batch_size=8)
        device, _ = setup(cfg)
        splits = load_splits(cfg)
        engine = Engine(cfg, splits, device)
        groups = engine.optimizer.param_groups
        assert [g["initial_lr"] for g in groups] == [cfg.lr, cfg.lr, cfg.lr * 0.1, cfg.lr * 0.1]
        head = {id(p) for p in engine.model.head.parameters()}
        assert {id(p) for g in groups[:2] for p in g["params"]} == head
        fresh = Engine(Config(batch_size=8), splits, device).optimizer.param_groups
        assert {g["initial_lr"] for g in fresh} == {cfg.lr}  # no --init-from: no pretrained body
        x, y = first_batches(splits, device, 8)[0]
        start = {k: v.clone() for k, v in engine.model.state_dict().items()}
        batches = itertools.repeat((x, y))
        for step in range(5):
            engine.freezing.at_step(step)
            train_step(engine, batches, cfg, device)
            now = engine.model.state_dict()
            body = [k for k in start if k.startswith("body.")]
            body_same = all(torch.equal(now[k], start[k]) for k in body)
            assert body_same == (step < 3), step
            assert not torch.equal(now["head.weight"], start["head.weight"])
            moments = {id(p) for p in engine.optimizer.state}
            body_moments = [id(p) in moments for p in engine.model.body.parameters()]
            assert (step < 3) == (not any(body_moments))
        print("ok")
        """,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_average_leaves_training_alone_validates_and_is_exported(tables):
    for decay in ("0", "0.9"):
        args = (
            "train",
            "--run-dir",
            f"runs/ema-{decay}",
            "--max-steps",
            "20",
            *SHORT,
            "--ema",
            decay,
        )
        done = run(tables, *args)
        assert done.returncode == 0, done.stderr
    plain, averaged = records(tables / "runs" / "ema-0"), records(tables / "runs" / "ema-0.9")
    assert [r for r in plain if r["split"] == "train"] == [
        r for r in averaged if r["split"] == "train"
    ]
    val = [
        (a["loss"], b["loss"]) for a, b in zip(plain, averaged, strict=True) if a["split"] == "val"
    ]
    assert len(val) == 4 and all(
        a != b for a, b in val
    )  # validated with other weights: the average's
    best = tables / "runs" / "ema-0.9" / "checkpoints" / "best.pt"
    done = run(tables, "export", "--checkpoint", str(best), "--out", "averaged.pt")
    assert done.returncode == 0, done.stderr
    exported = torch.load(tables / "averaged.pt", weights_only=True)
    checkpoint = torch.load(best, weights_only=True)
    assert (
        exported.keys() == checkpoint["model"].keys()
        and checkpoint["ema"].keys() <= exported.keys()
    )
    assert all(torch.equal(exported[k], checkpoint["ema"][k]) for k in checkpoint["ema"])
    assert not torch.equal(exported["head.weight"], checkpoint["model"]["head.weight"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ("--freeze", "body,nope"),
            "--freeze nope: no parameter of the model is under it; its modules: body, head",
        ),
        (("--unfreeze-at", "5"), "--unfreeze-at needs --freeze: nothing is frozen"),
        (
            ("--freeze", "head,body"),
            "--freeze head,body freezes every parameter of the model: nothing would train",
        ),
        (("--ema", "1"), "ema must be in [0, 1), got 1.0"),
    ],
)
def test_bad_fine_tuning_options_are_one_line_and_exit_2(tables, args, says):
    done = run(tables, "train", "--run-dir", "runs/bad", "--max-steps", "2", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().endswith(says) and len(done.stderr.strip().splitlines()) == 1, (
        done.stderr
    )


def test_a_step_the_grad_scaler_skipped_leaves_the_average_alone(tmp_path):
    project = render(tmp_path / "ft-fp16", finetune=True, precision="fp16")
    done = _python(
        project,
        """
        import torch
        from PKG.runtime.finetune import WeightAverage

        model = torch.nn.Linear(3, 2)
        average = WeightAverage(model, 0.9)
        with torch.no_grad():
            model.weight.add_(1.0)
        for skipped in (float("inf"), float("nan")):  # gradient norms of steps the scaler skips
            average.update(torch.tensor(skipped))  # nothing moves, the step is not counted
        assert average.steps.item() == 0 and not torch.equal(average.average[0], model.weight)
        average.update(torch.tensor(2.5))  # the first step taken: the average is the weights
        assert average.steps.item() == 1 and torch.equal(average.average[0], model.weight)
        print("ok")
        """,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_check_resume_with_ranks_crosses_the_unfreeze_with_the_average_on(distributed, tmp_path):
    """Two processes (check runs them under torchrun): fsdp's average is each rank's shard's, and
    a frozen parameter's optimizer state, absent until the unfreeze, is absent after resuming."""
    project = render(tmp_path / f"ft-{distributed}", distributed=distributed, finetune=True)
    done = run(project, "check", "resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("resume: "))
    assert (
        line.startswith("resume: PASS") and "bit-identical from step 1 to 10, trained by 20" in line
    ), line
    if distributed == "fsdp":  # the average swapped in for validation leaves no weights behind
        runs = []
        for decay in ("0", "0.9"):
            args = (
                "train",
                "--run-dir",
                f"runs/ema-{decay}",
                "--max-steps",
                "12",
                *SHORT,
                "--ema",
                decay,
            )
            command = _torchrun(project, *args, extra=("--nnodes", "1"))
            ran = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
            assert ran.returncode == 0, ran.stderr[-3000:]
            runs.append(
                [r for r in records(project / "runs" / f"ema-{decay}") if r["split"] == "train"]
            )
        assert runs[0] == runs[1] and len(runs[0]) == 12


def test_a_run_killed_before_the_unfreeze_resumes_to_the_same_records(tables):
    """SIGKILL at step 25, past the checkpoint of step 20, before --unfreeze-at 30, with --ema on:
    the resumed run crosses the unfreeze and ends with every record an uninterrupted run's."""
    tuning = ("--freeze", "body", "--unfreeze-at", "30", "--ema", "0.9")
    args = ["--max-steps", "60", *SMALL_RUN, *tuning]
    done = run(tables, "train", "--run-dir", "runs/whole", *args)
    assert done.returncode == 0, done.stderr
    kill_at_step(tables, ["train", "--run-dir", "runs/killed", *args], 25)
    done = run(tables, "train", "--run-dir", "runs/killed", *args)
    assert done.returncode == 0, done.stderr
    assert "at step 20" in done.stdout and "step 30: --freeze body lifted" in done.stdout
    assert records(tables / "runs" / "killed") == records(tables / "runs" / "whole")
    assert (tables / "runs" / "killed" / "metrics.jsonl").read_bytes() == (
        tables / "runs" / "whole" / "metrics.jsonl"
    ).read_bytes()
