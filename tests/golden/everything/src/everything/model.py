"""Yours to edit (or replace): the model, its loss and validation metrics. The example is a small
MLP for the curve in data.py, trained with mean squared error; for sequences, an MLP over the
running mean of the encoded rows, a causal model, so the padding after a sequence never reaches
its outputs.

What the rest of the project needs from this file:

- `build_model(cfg, splits) -> nn.Module`, whose output for a batch of inputs goes to the loss;
- `compute_loss(output, targets)`: a scalar to minimise, computed in fp32, the mean over the
  examples of the batch; it is the only definition of the loss (validation averages it too);
- `initial_loss(splits)`: what compute_loss should be before any training (`check init`);
- `overfit_target(first_loss)`: the loss `check overfit` must reach on one batch of 8 examples;
- `Metrics`: adds validation results up on the device in two tensors, `sums` and `count`
  (summed over processes when training is distributed); `update(output, targets, loss)` gets
  each batch with its compute_loss; `compute()` returns a dict with "loss" (used for early
  stopping and best) and any other figures you want logged.
- The output's first dimension is the batch, and no example's output may depend on another
  example's input, nor on the padding after it (`check batch` proves both).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config
from .data import SequenceDataset, Splits
from .datatools import read_batch

SAMPLED = 4096  # training examples initial_loss reads


def mlp(width: int, hidden_dim: int, n_layers: int, dropout: float, out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        layers.append(nn.Sequential(nn.Linear(width, hidden_dim), nn.GELU(), nn.Dropout(dropout)))
        width = hidden_dim
    return nn.Sequential(*layers, nn.Linear(width, out))


class CurveModel(nn.Module):
    def __init__(self, n_inputs: int, hidden_dim: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        self.net = mlp(n_inputs, hidden_dim, n_layers, dropout, out=1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(-1)  # (B, F) -> (B,)


class SequenceModel(nn.Module):
    """Row t's output from the mean of the encoded rows 1..t: it reads no later row."""

    def __init__(self, n_inputs: int, hidden_dim: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        self.encode = mlp(n_inputs, hidden_dim, 1, dropout, out=hidden_dim)
        self.head = mlp(hidden_dim, hidden_dim, n_layers - 1, dropout, out=1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        encoded = self.encode(inputs)  # (B, T, F) -> (B, T, H)
        rows = torch.arange(1, inputs.shape[1] + 1, device=inputs.device)
        running = encoded.cumsum(dim=1) / rows[:, None]
        return self.head(running).squeeze(-1)  # (B, T)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    model = SequenceModel if isinstance(splits.train, SequenceDataset) else CurveModel
    return model(splits.train[0][0].shape[-1], cfg.hidden_dim, cfg.n_layers, cfg.dropout)


# --init-from: the output layer's module names, kept freshly initialised where the weights given
# have another shape; every other parameter and buffer must load, or the run refuses. Each example
# model predicts one value, so none is named: name yours (("head",), say) to fine-tune it onto
# another number of outputs.
HEAD: tuple[str, ...] = ()


def from_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """--init-from's weights renamed into this model's layout: edit it to read another layout (a
    published model's names and shapes). This model's own layout is returned as it is."""
    return state


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks that --activation-checkpointing recomputes in the backward pass: the hidden layers
    of each mlp() (all but its output layer). A model of your own names its repeated blocks here."""
    return [layer for net in model.children() for layer in list(net)[:-1]]


def compute_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Of sequences, (B, T): the mean over each one's rows with a target (NaN: none, the padding
    included), then over the batch, so a long sequence weighs as much as a short one."""
    if targets.ndim == 1:
        return F.mse_loss(output.float(), targets)
    labelled = ~targets.isnan()
    squared = torch.where(labelled, output.float() - targets, 0).square()
    return (squared.sum(dim=1) / labelled.sum(dim=1)).mean()


def initial_loss(splits: Splits) -> float:
    """The mean squared target of the first examples (streamed data is not read whole): the outputs
    of the untrained model start near 0."""
    targets = read_batch(splits.train, torch.arange(min(len(splits.train), SAMPLED)))[1]
    return float(targets.square().nanmean())


def overfit_target(first_loss: float) -> float:
    """Near zero for a loss whose minimum is 0; add the floor of a loss that cannot reach 0."""
    return max(1e-3, 0.02 * first_loss)


class Metrics:
    def __init__(self, splits: Splits, device: torch.device) -> None:
        self.sums = torch.zeros(3, device=device)  # loss x examples, absolute error, targets
        self.count = torch.zeros((), device=device, dtype=torch.long)

    def update(self, output: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> None:
        labelled = ~targets.isnan()  # all of them but a sequence's rows without a target
        error = torch.where(labelled, output.float() - targets, 0).abs()
        self.sums += torch.stack([loss * len(targets), error.sum(), labelled.sum()])
        self.count += len(targets)

    def compute(self) -> dict[str, float]:
        (loss, absolute, targets), count = self.sums.tolist(), self.count.item()
        return {"loss": loss / count, "mae": absolute / targets}
