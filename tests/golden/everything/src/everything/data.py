"""Data: yours to replace. The example learns a noisy curve, y = sin(2x) + 0.3x, from (x, y) pairs.

    python -m everything inspect-data                  # the synthetic example
    python -m everything inspect-data --data pairs.npz  # x (N, F), y (N,)

What the rest of the project needs from this file, whatever your data is:

- `load_splits(cfg) -> Splits`, with `train` and `val` datasets; the validation split is never
  trained on, and is the same for every --seed;
- each dataset has `len()` and is indexed by a tensor of example indices, returning one batch as
  `(inputs, targets)` (load files lazily here if your data does not fit in memory);
- `Splits.describe()`: the facts a resumed run must see again (sizes, vocabulary, ...);
- `summarize(splits)`: what `inspect-data` prints; `DataError` for input that cannot be used.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import Config

SPLIT_SEED = 20240601  # fixed, so every run (whatever its --seed) validates on the same examples


class DataError(ValueError):
    """Input data that cannot be used, naming the file and the offending field."""


class PairDataset(Dataset):
    """In-memory (input, target) pairs, indexed by a whole batch of indices at once."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs = inputs  # (N, F) float32
        self.targets = targets  # (N,) float32

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]


@dataclass
class Splits:
    train: PairDataset
    val: PairDataset
    source: str
    digest: str  # of the data's contents: a resumed run refuses data that changed

    def describe(self) -> dict:
        return {
            "source": self.source,
            "digest": self.digest,
            "n_train": len(self.train),
            "n_val": len(self.val),
        }


def load_splits(cfg: Config) -> Splits:
    inputs, targets = example_data() if cfg.data is None else read_pairs(Path(cfg.data))
    order = np.random.default_rng(SPLIT_SEED).permutation(len(targets))
    n_val = max(1, round(len(targets) * cfg.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    if cfg.max_train_examples:
        train_idx = train_idx[: cfg.max_train_examples]
    if len(train_idx) < cfg.batch_size:
        raise DataError(f"{len(train_idx)} training examples, fewer than one batch of {cfg.batch_size}")
    contents = hashlib.sha256(inputs.tobytes() + targets.tobytes()).hexdigest()[:16]
    inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
    return Splits(
        train=PairDataset(inputs[train_idx], targets[train_idx]),
        val=PairDataset(inputs[val_idx], targets[val_idx]),
        source=cfg.data or "example",
        digest=contents,
    )


def example_data(n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(n, 1)).astype(np.float32)
    y = np.sin(2 * x[:, 0]) + 0.3 * x[:, 0] + 0.05 * rng.standard_normal(n)
    return x, y.astype(np.float32)


def read_pairs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        arrays = np.load(path, allow_pickle=False)  # never unpickle data
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: not a readable .npz file ({error})") from None
    missing = [key for key in ("x", "y") if key not in arrays]
    if missing:
        raise DataError(f"{path}: missing array(s) {', '.join(missing)}; found {list(arrays)}")
    x, y = arrays["x"], arrays["y"]
    if x.ndim != 2 or y.shape != (len(x),) or not np.isfinite(x).all() or not np.isfinite(y).all():
        raise DataError(f"{path}: need finite x of shape (N, F) and y of shape (N,)")
    return x.astype(np.float32), y.astype(np.float32)


def summarize(splits: Splits, n_samples: int = 5) -> str:
    lines = [f"source: {splits.source}"]
    for name, ds in (("train", splits.train), ("val", splits.val)):
        lines.append(f"{name}: inputs {tuple(ds.inputs.shape)}, targets {tuple(ds.targets.shape)}")
    for i in range(min(n_samples, len(splits.train))):
        inputs, target = splits.train[torch.tensor([i])]
        lines.append(f"  example {i}: inputs {inputs[0].tolist()}  target {float(target[0]):.4g}")
    return "\n".join(lines)
