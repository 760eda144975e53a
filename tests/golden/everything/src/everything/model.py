"""Model, loss and validation metrics: yours to replace. The example is a small MLP for the curve
in data.py, trained with mean squared error.

What the rest of the project needs from this file:

- `build_model(cfg, splits) -> nn.Module`, whose output for a batch of inputs goes to the loss;
- `compute_loss(output, targets)`: a scalar to minimise, computed in fp32, the mean over the
  examples of the batch; it is the only definition of the loss (validation averages it too);
- `initial_loss(splits)`: what compute_loss should be before any training (`check init`);
- `overfit_target(first_loss)`: the loss `check overfit` must reach on one batch of 8 examples;
- `Metrics`: adds validation results up on the device in two tensors, `sums` and `count`
  (summed over processes when training is distributed); `update(output, targets, loss)` gets
  each batch with its compute_loss; `compute()` returns a dict with "loss" (used for early
  stopping and best.pt) and any other figures you want logged.
- The output's first dimension is the batch, and no example's output may depend on another
  example's input (`check batch` proves it).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config
from .data import Splits


class CurveModel(nn.Module):
    def __init__(self, n_inputs: int, hidden_dim: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = n_inputs
        for _ in range(n_layers):
            layers += [nn.Linear(width, hidden_dim), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_dim
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(-1)  # (B, F) -> (B,)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return CurveModel(splits.train.inputs.shape[1], cfg.hidden_dim, cfg.n_layers, cfg.dropout)


def compute_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), targets)


def initial_loss(splits: Splits) -> float:
    """The mean squared target: the outputs of the untrained model start near 0."""
    return float(splits.train.targets.square().mean())


def overfit_target(first_loss: float) -> float:
    """Near zero for a loss whose minimum is 0; add the floor of a loss that cannot reach 0."""
    return max(1e-3, 0.02 * first_loss)


class Metrics:
    def __init__(self, splits: Splits, device: torch.device) -> None:
        self.sums = torch.zeros(2, device=device)  # loss x examples, absolute error
        self.count = torch.zeros((), device=device, dtype=torch.long)

    def update(self, output: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> None:
        error = output.float() - targets
        self.sums += torch.stack([loss * len(targets), error.abs().sum()])
        self.count += len(targets)

    def compute(self) -> dict[str, float]:
        (loss, absolute), count = self.sums.tolist(), self.count.item()
        return {"loss": loss / count, "mae": absolute / count}
