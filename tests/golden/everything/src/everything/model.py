"""Model, loss and validation metrics: yours to replace. The example is a small MLP for the curve
in data.py, trained with mean squared error.

What the rest of the project needs from this file:

- `build_model(cfg, splits) -> nn.Module`, whose output for a batch of inputs goes to the loss;
- `compute_loss(output, targets)`: a scalar to minimise, computed in fp32;
- `overfit_target(first_loss)`: the loss `check overfit` must reach on one batch of 8 examples;
- `Metrics`: adds validation results up on the device in two tensors, `sums` and `count`
  (summed over processes when training is distributed); `compute()` returns a dict with "loss"
  (used for early stopping and best.pt) and any other figures you want logged.
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


def overfit_target(first_loss: float) -> float:
    return max(1e-3, 0.02 * first_loss)


class Metrics:
    def __init__(self, splits: Splits, device: torch.device) -> None:
        self.sums = torch.zeros(2, device=device)  # squared error, absolute error
        self.count = torch.zeros((), device=device, dtype=torch.long)

    def update(self, output: torch.Tensor, targets: torch.Tensor) -> None:
        error = output.float() - targets
        self.sums += torch.stack([error.square().sum(), error.abs().sum()])
        self.count += len(targets)

    def compute(self) -> dict[str, float]:
        (squared, absolute), count = self.sums.tolist(), self.count.item()
        return {"loss": squared / count, "mae": absolute / count}
