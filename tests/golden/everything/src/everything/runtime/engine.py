"""Machinery: the training objects, built in one place: the model, what the loop calls, the
optimizer (optim.py), the gradient scaler; one optimizer step; one pass over the validation split.

`train` and every check build them as one `Engine`, so a check proves the code that trains.
"""

import dataclasses
import os
import random
import warnings

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..config import Config, ConfigError
from ..model import Metrics, build_model, compute_loss
from ..optim import build_optimizer, lr_factor
from .distributed import all_reduce_sum, init_distributed

PRECISION = "fp16"
# ShardedGradScaler's overflow flag has shape (1,), which DTensor warns of at each process's first
# unscale beside sharded gradients; the flag is all-reduced over the ranks as it should be.
warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1", UserWarning)
AMP_DTYPE = torch.float16  # autocast dtype; losses stay in fp32


def setup(cfg: Config) -> torch.device:
    """The device, deterministic kernels if asked, and every global RNG seeded."""
    device = torch.device(cfg.device)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[device.type]:
        raise ConfigError(f"--device {cfg.device} is not available here: --device cpu runs anywhere")
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # CPU reductions then add in one fixed order
    # Each rank draws its own dropout masks; every rank builds the model from cfg.seed (Engine).
    seed = cfg.seed + init_distributed(device.type).rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return device


def wrap(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model sharded by FSDP2, in place: each of shard_units(model) is one unit whose
    parameters are gathered for its forward and backward only, the root holds the rest; with
    --compile each unit's forward is compiled, FSDP's gathers staying outside the graphs."""
    mesh = init_device_mesh(device.type, (init_distributed(device.type).world_size,))
    # Compiled for static shapes, each shape once: a unit compiled for dynamic shapes (after its
    # first recompile) failed in inductor's lowering on the image task's residual blocks (torch
    # 2.13 on the CPU: "Cannot convert expression to float").
    # fp16 weights gathered for compute, gradients reduced in fp32 into the fp32 shards.
    policy = MixedPrecisionPolicy(param_dtype=AMP_DTYPE, reduce_dtype=torch.float32)
    batch_norms = torch.nn.BatchNorm1d | torch.nn.BatchNorm2d | torch.nn.BatchNorm3d
    for norm in (m for m in model.modules() if isinstance(m, batch_norms)):
        fully_shard(norm, mesh=mesh)  # fp32 weights, as its running statistics: batch_norm wants one dtype
    for unit in (u for u in shard_units(model) if not isinstance(u, batch_norms)):
        if cfg.compile:  # static shapes: see the note above
            unit.forward = torch.compile(unit.forward, dynamic=False)
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each module with parameters that an nn.Sequential or nn.ModuleList of the model holds
    (a transformer block, a residual block, an MLP's layer), outermost first: the units FSDP
    gathers one at a time. Parameters outside them (embeddings, a head) belong to the root."""
    units = []

    def visit(module: torch.nn.Module) -> None:
        container = isinstance(module, torch.nn.Sequential | torch.nn.ModuleList)
        for child in module.children():
            if container and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


class Engine:
    """The objects a step changes, each saving and loading itself through state_dict()."""

    def __init__(self, cfg: Config, splits, device: torch.device) -> None:
        with torch.random.fork_rng(devices=[]):  # the same weights on every rank, each keeps its shard
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, splits)
        self.model = wrap(model.to(device), cfg, device)  # sharded in place: also what the loop calls
        self.forward = self.model
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg))
        self.scaler = ShardedGradScaler(device.type)  # every rank skips a step if any shard overflowed

    def keep_schedule(self, cfg: Config, horizon: int) -> None:
        """Decays the learning rate over `horizon` steps, whatever cfg.max_steps now says."""
        schedule = lr_factor(dataclasses.replace(cfg, max_steps=horizon))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def parts(self) -> dict:
        """What a checkpoint holds of the engine, by name."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
        }

    def state_dict(self) -> dict:
        """The model's and optimizer's states as this rank's shards (DTensors keyed by parameter
        name, which any number of processes can load: checkpoint.py), the rest whole."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        rest = {name: part for name, part in self.parts().items() if name not in ("model", "optimizer")}
        return {"model": model, "optimizer": optimizer, **{name: p.state_dict() for name, p in rest.items()}}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        for name, part in self.parts().items():
            if name not in ("model", "optimizer"):
                part.load_state_dict(state[name])


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
        # FSDP reduce-scatters gradients to their shards once, after the step's last micro-batch.
        engine.forward.set_requires_gradient_sync(i == cfg.grad_accum_steps - 1)
        with torch.autocast(device.type, dtype=AMP_DTYPE):
            output = engine.forward(x)
        loss = compute_loss(output, y) / cfg.grad_accum_steps
        mark("backward")
        engine.scaler.scale(loss).backward()
        losses.append(loss.detach())
    mark("optimizer")
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    engine.scaler.unscale_(engine.optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip).full_tensor()  # over every shard
    engine.scaler.step(engine.optimizer)  # skipped when the gradients overflowed; the scale then shrinks
    engine.scaler.update()
    engine.optimizer.zero_grad(set_to_none=True)
    mark("done")
    return sum(losses), grad_norm


@torch.no_grad()
def evaluate(engine: Engine, loader, splits, device: torch.device) -> dict[str, float]:
    """The validation loss (compute_loss, averaged over examples) and the task's metrics."""
    engine.model.eval()
    metrics = Metrics(splits, device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=AMP_DTYPE):
            output = engine.forward(x)
        metrics.update(output, y, compute_loss(output, y))
    engine.model.train()
    all_reduce_sum(metrics.sums)  # each rank evaluated its share of the batches
    all_reduce_sum(metrics.count)
    return metrics.compute()
