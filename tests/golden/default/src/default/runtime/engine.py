"""Machinery: the training objects, built in one place: the model and what the loop calls, the
optimizer (optim.py); one optimizer step; one pass over the validation split.

`train` and every check build them as one `Engine`, so a check proves the code that trains. What
differs with the number of processes is in distributed.py.
"""

import dataclasses
import random

import numpy as np
import torch

from ..config import Config, ConfigError
from ..model import Metrics, build_model, compute_loss
from ..optim import build_optimizer, lr_factor
from . import distributed
from .progress import announced

PRECISION = "fp32"


def setup(cfg: Config) -> torch.device:
    """The device, deterministic kernels if asked, and every global RNG seeded."""
    device = torch.device(cfg.device)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[device.type]:
        raise ConfigError(f"--device {cfg.device} is not available here: --device cpu runs anywhere")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # CPU reductions then add in one fixed order
    seed = cfg.seed + distributed.init_distributed(device.type).rank  # each rank its own dropout masks
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return device


class Engine:
    """The objects a step changes, each saving and loading itself through state_dict()."""

    def __init__(self, cfg: Config, splits, device: torch.device) -> None:
        with distributed.model_init_rng(cfg):
            self.model = build_model(cfg, splits).to(device)  # what checkpoints hold
        self.forward = distributed.wrap(self.model, cfg, device)  # what the loop calls
        self.optimizer = build_optimizer(self.model, cfg)
        # what the step clips, listed once rather than at every step
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg))

    def set_schedule(self, cfg: Config, horizon: int, step: int) -> None:
        """Decays the learning rate over `horizon` steps, whatever cfg.max_steps now says, for a run
        restored at `step`: its next step trains at this schedule's rate."""
        schedule = lr_factor(dataclasses.replace(cfg, max_steps=horizon))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule, last_epoch=step - 1)

    def state_dict(self) -> dict:
        model, optimizer = distributed.model_state(self.model, self.optimizer)
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        distributed.load_model_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])


def _unmarked(phase: str) -> None:
    """train_step's `mark` in training: nothing is timed inside a step."""


def train_step(engine: Engine, batches, cfg: Config, device: torch.device, mark=_unmarked):
    """One optimizer step over cfg.grad_accum_steps micro-batches.

    Returns the mean loss and the gradient norm as tensors: reading them (.item()) waits for the
    device, so the loop does that only on logging steps. `mark(phase)` is called as each phase
    begins (data, copy, forward, backward, optimizer) and with "done" at the end: `profile`
    times the phases with it.
    """
    losses = []  # each micro-batch's share of the step's mean loss
    for i in range(cfg.grad_accum_steps):
        mark("data")
        x, y = next(batches)
        mark("copy")
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        mark("forward")
        with distributed.gradient_sync(engine.forward, last=i == cfg.grad_accum_steps - 1):
            output = engine.forward(x)
            loss = compute_loss(output, y)
            if cfg.grad_accum_steps > 1:  # one more operation forward and backward: not for one
                loss = loss / cfg.grad_accum_steps
            mark("backward")
            loss.backward()
        losses.append(loss.detach())
    mark("optimizer")
    grad_norm = distributed.clip_grad_norm(engine.params, cfg.grad_clip)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    mark("done")
    return sum(losses[1:], start=losses[0]), grad_norm  # sum(losses) would add a 0 first


@torch.no_grad()
def evaluate(engine: Engine, loader, splits, device: torch.device) -> dict[str, float]:
    """The validation loss (compute_loss, averaged over examples) and the task's metrics."""
    engine.model.eval()
    metrics = Metrics(splits, device)
    batches = announced(loader, "validating") if distributed.is_main_process() else loader
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        output = engine.forward(x)
        metrics.update(output, y, compute_loss(output, y))
    engine.model.train()
    distributed.all_reduce_sum(metrics.sums)  # each rank evaluated its share of the batches
    distributed.all_reduce_sum(metrics.count)
    return metrics.compute()
