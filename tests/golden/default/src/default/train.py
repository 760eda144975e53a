"""The training loop: setup, data, model, optimizer, loop, checkpoints.

    python -m default train  # synthetic data, into runs/default
    python -m default train --data features.csv --run-dir runs/exp1

Run it again with the same --run-dir to resume from the newest valid checkpoint: the run continues
exactly as if it had never stopped.
"""

import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import CheckpointDir, rng_state, set_rng_state
from .config import RESUME_FIXED, Config, ConfigError
from .data import Splits, load_splits
from .loader import build_loaders
from .model import Metrics, build_model, compute_loss
from .runlog import RunLog

PRECISION = "fp32"


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss, say); the message says what to check."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    best_val_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for early stopping


def setup(cfg: Config) -> torch.device:
    device = torch.device(cfg.device)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[device.type]:
        raise ConfigError(f"--device {cfg.device} is not available here: --device cpu runs anywhere")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # CPU reductions then add in one fixed order
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return device


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW that decays weight matrices only: biases and norm gains are left alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)  # fused kernels: cpu, cuda and mps


def lr_factor(cfg: Config):
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at max_steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_step(model, batches, optimizer, cfg: Config, device: torch.device):
    """One optimizer step over cfg.grad_accum_steps micro-batches.

    Returns the mean loss and the gradient norm as tensors: reading them (.item()) waits for the
    device, so the loop does that only on logging steps.
    """
    losses = []  # each micro-batch's share of the step's mean loss
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = compute_loss(model(x), y) / cfg.grad_accum_steps
        loss.backward()
        losses.append(loss.detach())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sum(losses), grad_norm


@torch.no_grad()
def evaluate(model, loader, splits: Splits, device: torch.device) -> dict[str, float]:
    """The loss and the task's metrics over the whole validation split."""
    model.eval()
    metrics = Metrics(splits, device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        metrics.update(model(x), y)
    model.train()
    return metrics.compute()


def micro_batches(loader, sampler, state: TrainState):
    """Training batches without end; keeps state.epoch and state.batch_in_epoch current."""
    while True:
        sampler.set_epoch(state.epoch, start=state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def check_resumable(checkpoint: dict, cfg: Config, splits: Splits) -> None:
    saved = checkpoint["config"]
    changed = [
        f"{k} {saved.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in RESUME_FIXED
        if saved.get(k) != getattr(cfg, k)
    ]
    changed += [
        f"data {k} {checkpoint['data'].get(k)!r} -> {v!r}"
        for k, v in splits.describe().items()
        if checkpoint["data"].get(k) != v
    ]
    if changed:
        raise ConfigError(
            f"{cfg.run_dir} holds a run with another model or data ({'; '.join(changed)}): "
            "resume with its settings, or start a new --run-dir"
        )


def train(cfg: Config, quiet: bool = False) -> dict:
    """Trains (or resumes) the run in cfg.run_dir; returns where it ended and its best validation."""
    device = setup(cfg)
    splits = load_splits(cfg)
    model = build_model(cfg, splits).to(device)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    state = TrainState()
    run = RunLog(Path(cfg.run_dir))
    say = (lambda message: None) if quiet else tqdm.write  # tqdm.write prints above a progress bar
    checkpoints = CheckpointDir(run.dir / "checkpoints", cfg.keep_last)
    latest = checkpoints.load_latest()
    if latest is None:
        run.start(cfg, splits.describe(), PRECISION)
    else:
        path, checkpoint = latest
        check_resumable(checkpoint, cfg, splits)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        state = TrainState(**checkpoint["state"])
        run.resume(state.step, path)
        say(f"resuming from {path} at step {state.step}")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"model: {n_params:,} trainable parameters; device {device}, precision {PRECISION}")
    say(f"data: {splits.source}, {len(splits.train):,} train / {len(splits.val):,} val examples")
    train_loader, val_loader, sampler = build_loaders(splits, cfg, device)
    batches = micro_batches(train_loader, sampler, state)
    if latest is not None:
        set_rng_state(checkpoint["rng"])  # last: nothing above may consume the restored streams

    def payload() -> dict:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "state": asdict(state),
            "rng": rng_state(),
            "config": asdict(cfg),
            "data": splits.describe(),
        }

    model.train()
    examples_per_step = cfg.grad_accum_steps * cfg.batch_size
    progress = Progress(cfg.max_steps, state.step, examples_per_step, quiet)
    started, first_step, stop = time.perf_counter(), state.step, False
    try:
        while state.step < cfg.max_steps and not stop:
            lr = scheduler.get_last_lr()[0]
            loss, grad_norm = train_step(model, batches, optimizer, cfg, device)
            scheduler.step()
            state.step += 1
            progress.update()
            last = state.step == cfg.max_steps
            save = state.step % cfg.ckpt_every == 0 or last
            if state.step % cfg.log_every == 0 or save:  # the loop's only host syncs
                loss, grad_norm = loss.item(), grad_norm.item()
                if not math.isfinite(loss):  # before any checkpoint could hold the damage
                    raise TrainingError(
                        f"loss is {loss} at step {state.step}: lower --lr, check the precision"
                        " (fp16 overflows where bf16 does not), and inspect the data (inspect-data)"
                    )
                run.log(step=state.step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
                progress.log(state.step, loss, lr, grad_norm)
            if state.step % cfg.eval_every == 0 or last:
                metrics = evaluate(model, val_loader, splits, device)
                run.log(step=state.step, split="val", **metrics)
                improved = metrics["loss"] < state.best_val_loss
                if improved:
                    state.best_val_loss, state.best_step = metrics["loss"], state.step
                    state.evals_since_best = 0
                    checkpoints.save_best(payload())
                else:
                    state.evals_since_best += 1
                    stop = cfg.patience > 0 and state.evals_since_best >= cfg.patience
                shown = "  ".join(f"{name} {value:.4f}" for name, value in metrics.items())
                say(f"step {state.step}  val {shown}" + ("  (best)" if improved else ""))
                if stop:
                    say(f"early stop: no better validation in {cfg.patience} since step {state.best_step}")
            if save or stop:
                checkpoints.save(payload(), state.step)
                run.checkpointed(state.step)
    finally:
        progress.close()
        run.close()
    seconds = time.perf_counter() - started
    examples = (state.step - first_step) * examples_per_step
    summary = {
        "step": state.step,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "best_checkpoint": str(checkpoints.path / "best.pt"),
        "seconds": seconds,
        "examples_per_s": examples / seconds if seconds > 0 else math.nan,
    }
    run.finish(summary)
    best = summary["best_checkpoint"]
    say(f"best val loss {state.best_val_loss:.4f} at step {state.best_step}; checkpoint {best}")
    return summary


class Progress:
    """A progress bar with loss, throughput and ETA on a terminal; plain lines when logged to a file."""

    def __init__(self, max_steps: int, step: int, examples_per_step: int, quiet: bool) -> None:
        self.max_steps = max_steps
        self.examples_per_step = examples_per_step
        self.quiet = quiet
        on_terminal = not quiet and sys.stderr.isatty()
        self.bar = tqdm(
            total=max_steps, initial=step, unit="step", dynamic_ncols=True, disable=not on_terminal
        )
        self.clock, self.clock_step = time.perf_counter(), step

    def update(self) -> None:
        self.bar.update()

    def log(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        now = time.perf_counter()
        rate = (step - self.clock_step) * self.examples_per_step / (now - self.clock)
        self.clock, self.clock_step = now, step
        if not self.bar.disable:
            self.bar.set_postfix_str(f"loss {loss:.4f}  lr {lr:.2e}  {rate:,.0f} examples/s")
        elif not self.quiet:
            print(
                f"step {step}/{self.max_steps}  loss {loss:.4f}  lr {lr:.2e}"
                f"  grad_norm {grad_norm:.3f}  {rate:,.0f} examples/s",
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()
