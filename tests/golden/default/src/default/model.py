"""Yours to edit: the model, its loss and its validation metrics: an MLP that returns class logits."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config
from .data import Splits


class MLP(nn.Module):
    """Encoded features (data.py standardised them), then hidden Linear, LayerNorm, GELU, dropout layers."""

    def __init__(
        self, n_features: int, n_outputs: int, hidden_dim: int, n_layers: int, dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = n_features
        for _ in range(n_layers):
            layer = [nn.Linear(width, hidden_dim), nn.LayerNorm(hidden_dim), nn.GELU(), nn.Dropout(dropout)]
            layers.append(nn.Sequential(*layer))
            width = hidden_dim
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # x (B, F) -> (B, n_outputs)


def repeated_blocks(model: MLP) -> list[nn.Module]:
    """The blocks that --activation-checkpointing recomputes in the backward pass: the hidden layers."""
    return list(model.body)


def build_model(cfg: Config, splits: Splits) -> MLP:
    """The model of `splits` (Splits, or `predict`'s record of one: only its sizes are read)."""
    return MLP(splits.n_features, splits.n_classes, cfg.hidden_dim, cfg.n_layers, cfg.dropout)


def compute_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss, defined here only: training minimises it and validation averages it over examples.
    Cross-entropy in fp32, whatever precision the model ran in."""
    return F.cross_entropy(logits.float(), y)  # logits (B, C), y (B,)


def initial_loss(splits: Splits) -> float:
    """What compute_loss should be before training: ln C, as a model that knows nothing spreads its
    probability evenly over the C classes. Far above it: a wrong output layer or misread labels."""
    return math.log(splits.n_classes)


def overfit_target(first_loss: float) -> float:
    """The loss `check overfit` must reach on one batch of 8 examples: near zero, for a loss whose
    minimum is 0. If you change compute_loss so that its minimum is above 0 (label smoothing,
    a penalty term added to it), add that floor here, or the check fails a sound model: label
    smoothing e over C classes, for example, cannot go below the entropy of its smoothed targets,
    -(1 - e + e / C) ln(1 - e + e / C) - (C - 1) (e / C) ln(e / C)."""
    return max(0.05, 0.02 * first_loss)


class Metrics:
    """Validation loss and accuracy, summed on the device (and over ranks): `compute()` alone syncs."""

    def __init__(self, splits: Splits, device: torch.device) -> None:
        self.sums = torch.zeros(2, device=device)  # cross-entropy, correct predictions
        self.count = torch.zeros((), device=device, dtype=torch.long)

    def update(self, logits: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
        """Adds one batch; `loss` is compute_loss of the batch (its mean over the examples)."""
        self.sums += torch.stack([loss * len(y), (logits.argmax(dim=-1) == y).sum().float()])
        self.count += len(y)

    def compute(self) -> dict[str, float]:
        (loss, correct), count = self.sums.tolist(), self.count.item()
        return {"loss": loss / count, "accuracy": correct / count}
