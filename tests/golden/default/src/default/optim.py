"""Yours to edit: the optimizer and the learning-rate schedule.

`runtime/engine.py` builds them once for training and for every check; a checkpoint holds their
state, so a resumed run goes on with them exactly.
"""

import math

import torch

from .config import Config


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
