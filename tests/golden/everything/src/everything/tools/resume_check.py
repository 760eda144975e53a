"""Tool: `check resume`, a run resumed from a checkpoint continues exactly as if it had never stopped,
with --ema on and a --freeze lifted between the checkpoint and the end; and the frozen weights do
not move while frozen."""

import os
import random
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..config import Config
from ..data_shards import load_splits
from ..model import build_model
from ..runtime.checkpoint import load, remove, step_name
from ..runtime.distributed import barrier, init_distributed
from ..runtime.finetune import body, under
from ..runtime.loader import training_examples
from ..runtime.records import read_metrics
from ..train import train


def resume_matches(cfg: Config, work: Path) -> tuple[bool, str]:
    """Trains 2N steps with a checkpoint at N, resumes a copy from that checkpoint, compares. The data
    is cut to a few batches an epoch so that N falls mid-epoch with an epoch boundary and validations
    before 2N, loader workers on; the records must show all of that, so every piece of state is exercised."""
    # 3k + 1 micro-batches an epoch for k of them a step: checkpoints then fall mid-epoch.
    per_batch = cfg.batch_size * init_distributed(torch.device(cfg.device).type).world_size
    micro_per_epoch = min(training_examples(load_splits(cfg), cfg) // per_batch, 3 * cfg.grad_accum_steps + 1)
    n, mid_epoch_possible = _resume_point(micro_per_epoch, cfg.grad_accum_steps)
    freeze = cfg.freeze or body(_shape_of(cfg))  # the model's body, unless --freeze names a part
    base = replace(
        cfg,
        max_train_examples=micro_per_epoch * per_batch,
        max_steps=2 * n,
        warmup_steps=n // 3,
        ckpt_every=n,
        ckpt_minutes=0,  # the checkpoints of steps N and 2N alone, however slow the steps
        eval_every=n // 2 + 1,
        log_every=1,
        keep_last=2,
        patience=0,
        num_workers=max(1, cfg.num_workers),
        deterministic=True,
        ema=cfg.ema or 0.9,
        freeze=freeze,
        unfreeze_at=n + n // 2 if freeze else 0,  # after the checkpoint: the resumed run crosses it
    )
    first, second = _train_then_resume(base, work, n)
    same, covered, detail = _compare(first, second, n, mid_epoch_possible)
    held, why = _frozen_held(base, work, first, n)
    same, detail = same and held, f"{detail}; --ema {base.ema:g}; {why}"
    if not mid_epoch_possible:  # one micro-batch an epoch, or steps of whole epochs
        detail += f"; no step ends mid-epoch ({micro_per_epoch} micro-batches an epoch, "
        detail += f"{cfg.grad_accum_steps} a step)"
    if not covered:
        detail += "; the runs did not cover a mid-epoch checkpoint, an epoch boundary and a validation"
    return same and covered, detail


def _resume_point(micro_per_epoch: int, accum: int) -> tuple[int, bool]:
    """The first N >= 10 whose step N ends mid-epoch with an epoch boundary before step 2N, and
    whether one exists: with an epoch of one micro-batch, or steps of whole epochs, none does."""
    for n in range(10, 10 + micro_per_epoch):  # n * accum modulo micro_per_epoch repeats after that
        start, end = n * accum, 2 * n * accum
        if start % micro_per_epoch and (start // micro_per_epoch + 1) * micro_per_epoch < end:
            return n, True
    return 10, False


def _shape_of(cfg: Config) -> torch.nn.Module:
    """The model's modules, without their values (on the meta device): for their names."""
    with torch.device("meta"):
        return build_model(cfg, load_splits(cfg))


def _frozen_held(base: Config, work: Path, first: Path, n: int) -> tuple[bool, str]:
    """Whether the --freeze modules' weights and statistics after step N (frozen to step 1.5 N) are
    bit-identical to those after step 1 (of a run of one step: no checkpoint falls there otherwise),
    and have trained by step 2N; and why."""
    if not base.freeze:
        return True, "freezing not checked: model.HEAD does not split the model into a body and a head"
    one = work / "one-step"
    train(replace(base, run_dir=str(one), max_steps=1, ckpt_every=1), quiet=True)
    barrier()
    at_1 = load(one / "checkpoints" / step_name(1))["model"]
    at_n, at_2n = (load(first / "checkpoints" / step_name(k))["model"] for k in (n, 2 * n))
    frozen = [name for name in at_1 if under(name, base.freeze.split(","))]
    held = all(torch.equal(at_1[name], at_n[name]) for name in frozen)
    trained = any(not torch.equal(at_1[name], at_2n[name]) for name in frozen)
    why = f"--freeze {base.freeze} to step {base.unfreeze_at}: {len(frozen)} tensors "
    why += "bit-identical from step 1 to " if held else "CHANGED between step 1 and "
    why += f"{n}, " + ("trained by " if trained else "NOT TRAINED by ") + f"{2 * n}"
    return held and trained and bool(frozen), why


def _train_then_resume(base: Config, work: Path, n: int) -> tuple[Path, Path]:
    """Trains 2N steps, copies that run as a crash just after step N's checkpoint leaves it (records past N,
    which the resume must drop; no later checkpoint), resumes the copy to 2N: (uninterrupted, resumed)."""
    first, second = work / "uninterrupted", work / "resumed"
    is_main = init_distributed(torch.device(base.device).type).is_main
    if is_main:
        shutil.rmtree(work, ignore_errors=True)
    barrier()
    train(replace(base, run_dir=str(first)), quiet=True)
    barrier()  # rank 0 has written everything
    if is_main:
        shutil.copytree(first, second)
        for path in (second / "checkpoints").iterdir():
            if path.name != step_name(n):
                remove(path)
    barrier()
    noise = int.from_bytes(os.urandom(4), "little")  # the resumed run must restore every RNG state
    random.seed(noise)
    np.random.seed(noise)
    torch.manual_seed(noise)
    train(replace(base, run_dir=str(second)), quiet=True)
    barrier()
    return first, second


def _compare(first: Path, second: Path, n: int, mid_epoch_possible: bool) -> tuple[bool, bool, str]:
    """Whether the resumed run's steps N+1 to 2N, validations and final state equal the uninterrupted
    run's; whether they covered a mid-epoch checkpoint, an epoch boundary and a validation; and why."""

    def losses(run: Path, split: str, after: int = 0) -> list[float]:
        return [r["loss"] for r in read_metrics(run) if r["split"] == split and r["step"] > after]

    expected, got = losses(first, "train"), losses(second, "train")
    val_expected, val_got = losses(first, "val", n), losses(second, "val", n)  # the runs end at step 2N
    end = Path("checkpoints") / step_name(2 * n)
    a, b = load(first / end), load(second / end)
    same_state = all(_equal(a[part], b[part]) for part in ("model", "optimizer", "ema", "ema_steps"))
    equal = sum(x == y for x, y in zip(expected[n:], got[n:], strict=False))
    at_n = load(second / "checkpoints" / step_name(n))["state"]
    crossed = b["state"]["epoch"] - at_n["epoch"]
    covered = crossed > 0 and len(val_got) > 0 and (at_n["batch_in_epoch"] > 0 or not mid_epoch_possible)
    detail = (
        f"checkpoint at step {n} of {2 * n} (micro-batch {at_n['batch_in_epoch']} of epoch {at_n['epoch']}), "
        f"then {crossed} epoch boundaries and {len(val_got)} validations; losses of steps {n + 1}-{2 * n}: "
        f"{equal}/{n} equal, validation losses {'equal' if val_got == val_expected else 'DIFFER'}; "
        f"{len(got)} train records for {2 * n} steps; final model, optimizer and --ema average "
        + ("equal" if same_state else "DIFFER")
    )
    same = got == expected and val_got == val_expected and len(got) == 2 * n and same_state
    return same, covered, detail


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b
