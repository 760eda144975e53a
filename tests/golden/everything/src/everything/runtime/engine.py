"""Machinery: the run's set-up (device, process group, seeds) and the training objects, built in
one place: the model and what the loop calls, the optimizer (optim.py), autocast and the gradient
scaler. `train` and every check build them as one `Engine` and step it with train.train_step, so a
check proves the code that trains. What differs with the number of processes is in distributed.py."""

import contextlib
import dataclasses
import functools
import random

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from ..config import Config, ConfigError
from ..model import build_model
from ..optim import build_optimizer, lr_factor
from . import distributed
from .device import configure
from .finetune import Freezing, WeightAverage

PRECISION = "fp16"
AMP_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[PRECISION]  # losses stay in fp32


def setup(cfg: Config) -> tuple[torch.device, distributed.Dist]:
    """The device, this process's place in the group, deterministic kernels if asked, global RNGs seeded."""
    device = torch.device(cfg.device)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[device.type]:
        raise ConfigError(f"--device {cfg.device} is not available here: --device cpu runs anywhere")
    configure(cfg.deterministic)
    group = distributed.init_distributed(device.type)
    seed = cfg.seed + group.rank  # each rank its own dropout masks
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return device, group


def recompute(blocks: list[torch.nn.Module], compiled: bool) -> None:
    """Each block's activations recomputed in the backward pass rather than kept (PyTorch's
    non-reentrant checkpointing, dropout masks replayed), for one more forward pass of compute. The
    block's buffers are restored after it: BatchNorm's running statistics update once (compiled,
    the graph sees to that itself)."""
    for block in blocks:

        def contexts(block=block):  # checkpoint's: none for the forward, one for the recomputation
            return contextlib.nullcontext(), _buffers_restored(block)

        kept = {} if compiled else {"context_fn": contexts}
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **kept)


@contextlib.contextmanager
def _buffers_restored(block: torch.nn.Module):
    saved = [buffer.clone() for buffer in block.buffers()]
    try:
        yield
    finally:  # also when checkpoint stops the recomputation early, past what the backward needs
        with torch.no_grad():
            for buffer, value in zip(block.buffers(), saved, strict=True):
                buffer.copy_(value)


class Engine:
    """The objects a step changes, each saving and loading itself through state_dict()."""

    def __init__(self, cfg: Config, splits, device: torch.device) -> None:
        self.model = distributed.build(lambda: build_model(cfg, splits), cfg, device)  # what checkpoints hold
        if cfg.activation_checkpointing:
            from .. import model  # its repeated_blocks(): a model of your own declares them there

            if not hasattr(model, "repeated_blocks"):
                raise ConfigError("--activation-checkpointing: model.py declares no repeated_blocks(model)")
            recompute(model.repeated_blocks(self.model)[:: cfg.activation_checkpointing], cfg.compile)
        self.forward = distributed.wrap(self.model, cfg, device)  # what the loop calls
        self.optimizer = build_optimizer(self.model, cfg)
        # what the step clips, listed once rather than at every step
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg))
        # made once: autocast to AMP_DTYPE (none in fp32); a GradScaler, disabled (no-ops) but in fp16
        autocast = functools.partial(torch.autocast, device.type, dtype=AMP_DTYPE)
        self.autocast = contextlib.nullcontext if AMP_DTYPE is None else autocast
        self.scaler = distributed.grad_scaler(device)
        self.freezing = Freezing(self.model, cfg)  # --freeze, --unfreeze-at
        self.ema = WeightAverage(self.model, cfg.ema)  # --ema

    def set_schedule(self, cfg: Config, horizon: int, step: int) -> None:
        """Decays the learning rate over `horizon` steps, whatever cfg.max_steps now says, for a run
        restored at `step`: its next step trains at this schedule's rate."""
        schedule = lr_factor(dataclasses.replace(cfg, max_steps=horizon))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule, last_epoch=step - 1)

    def state_dict(self) -> dict:
        model, optimizer = distributed.model_state(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        state["scaler"] = self.scaler.state_dict()  # its scale and growth tracker resume exactly
        state["ema"], state["ema_steps"] = self.ema.state_dict(), self.ema.steps
        return state

    def load_state_dict(self, state: dict) -> None:
        distributed.load_model_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.ema.load_state_dict(state["ema"], state["ema_steps"])
