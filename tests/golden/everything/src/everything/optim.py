"""Yours to edit: the optimizer and the learning-rate schedule.

`runtime/engine.py` builds them once for training and for every check; a checkpoint holds their
state, so a resumed run goes on with them exactly.
"""

import math

import torch

from .config import Config
from .model import HEAD

# With --init-from, the pretrained body learns at this share of --lr and the new head (model.HEAD)
# at --lr itself: the head's large first updates would otherwise drift what the body has learnt.
BODY_LR_FACTOR = 0.1


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW that decays weight matrices only (biases and norm gains are left alone), the head's
    parameter groups first (the lr logged is the first group's), then the body's."""
    body_lr = cfg.lr * BODY_LR_FACTOR if cfg.init_from else cfg.lr
    named = model.named_parameters(remove_duplicate=False)  # a tied weight is the head's under any name
    head = {id(p) for name, p in named if any(name == h or name.startswith(f"{h}.") for h in HEAD)}
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for in_head, lr in ((True, cfg.lr), (False, body_lr)):
        params = [p for p in trained if (id(p) in head) == in_head]
        groups += [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr": lr},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": lr},
        ]
    groups = [group for group in groups if group["params"]]  # a head without biases, say
    # foreach, not fused: the fused step rejects the sharded scaler's overflow flag beside sharded
    # (DTensor) parameters (a shape error, measured on torch 2.13).
    return torch.optim.AdamW(groups, lr=cfg.lr, foreach=True)


def lr_factor(cfg: Config):
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at max_steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
