"""Data: yours to replace. The example learns a noisy curve, y = sin(2x) + 0.3x, from (x, y) pairs.

    python -m everything inspect-data                  # the synthetic example
    python -m everything inspect-data --data pairs.npz  # x (N, F), y (N,)

What the rest of the project needs from `data.py` (the loop, the checks and `inspect-data` use
nothing else, so a dataset of your own works if it keeps to this):

- `load_splits(cfg) -> Splits`, whose `train` and `val` are map-style datasets of single
  examples: `len(ds)`, and `ds[i] -> (input, target)` as tensors (an ImageFolder-style dataset
  is one). The validation split is never trained on and is the same for every --seed.
- Optionally `ds.__getitems__(indices)`: a whole batch at once (an int64 tensor of indices in,
  the stacked `(inputs, targets)` out), which keeps in-memory data fast; or `ds.collate(samples)`:
  how a list of `ds[i]` becomes a batch where stacking cannot (examples of different lengths).
- Randomness inside a sample (augmentation, random crops) drawn from
  `loader.sample_rng(seed, self.epoch, i)`, never from the global RNGs: the loader sets
  `ds.epoch` before each batch, so the numbers stay the same for any number of workers and
  after a resume. Open files in `__getitem__`, not in `__init__`: each worker has its own copy.
- `Splits.describe()`: the facts a resumed run must see again; `summarize(splits)`: what
  `inspect-data` prints; `DataError` for input that cannot be used.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import Config
from .loader import read_batch, sample_rng

SPLIT_SEED = 20240601  # fixed, so every run (whatever its --seed) validates on the same examples


class DataError(ValueError):
    """Input data that cannot be used, naming the file and the offending field."""


class PairDataset(Dataset):
    """In-memory (input, target) pairs; training inputs get noise keyed by (seed, epoch, index)."""

    epoch = 0  # the loader sets it before each batch

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, noise: float = 0, seed: int = 0) -> None:
        self.inputs = inputs  # (N, F) float32
        self.targets = targets  # (N,) float32
        self.noise = noise  # std of the Gaussian noise added to each input (augmentation); 0: none
        self.seed = seed

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i] + self._noise(i), self.targets[i]

    def __getitems__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.inputs[indices]  # (B, F): one gather per batch, not one per example
        if self.noise:
            inputs = inputs + torch.stack([self._noise(i) for i in indices.tolist()])
        return inputs, self.targets[indices]

    def _noise(self, i: int) -> torch.Tensor | float:
        if not self.noise:
            return 0.0
        shape = self.inputs.shape[1:]
        return self.noise * torch.randn(shape, generator=sample_rng(self.seed, self.epoch, i))


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
    if len(train_idx) < cfg.batch_size:
        raise DataError(f"{len(train_idx)} training examples, fewer than one batch of {cfg.batch_size}")
    contents = hashlib.sha256(inputs.tobytes() + targets.tobytes()).hexdigest()[:16]
    inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
    return Splits(
        train=PairDataset(inputs[train_idx], targets[train_idx], cfg.input_noise, cfg.seed),
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
    """Inputs x (N, F) and targets y (N,) from a .npz, as float32."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix != ".npz":
        raise DataError(f"{path}: expected a .npz file with arrays x and y")
    x, y = read_npz_pair(path)
    check_values(path, "input", x)
    check_values(path, "target", y)
    return x.astype(np.float32), y.astype(np.float32)


def read_npz_pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays x (N, F) and y (N,) of a .npz file, never unpickled, or a DataError in one line."""
    try:
        with np.load(path, allow_pickle=False) as arrays:  # never unpickle data
            missing = [key for key in ("x", "y") if key not in arrays.files]
            if missing:
                found = ", ".join(arrays.files[:10]) or "none"
                raise DataError(f"{path}: missing array(s) {', '.join(missing)}; found {found}")
            x, y = arrays["x"], arrays["y"]
    except DataError:
        raise
    except Exception as error:  # not a zip, a truncated one, or object arrays (refused unread)
        raise DataError(f"{path}: not a readable .npz file of numeric arrays ({error})") from None
    if x.ndim != 2 or y.shape != (len(x),):
        raise DataError(f"{path}: need x of shape (N, F) and y of shape (N,), got {x.shape} and {y.shape}")
    return x, y


# Values beyond this magnitude are refused: float32 statistics of them (sums of squares over a
# million examples) overflow, and a loss over them is NaN from the first step.
LARGEST_VALUE = 1e15


def check_values(path: Path, name: str, values: np.ndarray) -> None:
    """A DataError naming the first example whose `name` is not a real, finite number within
    ±LARGEST_VALUE (complex, text, NaN, infinite and huge values are refused, not cast)."""
    if values.dtype.kind not in "biuf":
        raise DataError(f"{path}: the {name}s are {values.dtype} values; they must be real numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        wide = values.astype(np.float64)
        bad = ~(np.abs(wide) <= LARGEST_VALUE)  # NaN compares False: bad too
    if bad.any():
        where = np.unravel_index(np.argmax(bad), bad.shape)  # the first, in example order
        raise DataError(
            f"{path}: example {where[0]} has {name} {wide[where]:g}; {name}s must be finite and"
            f" within ±{LARGEST_VALUE:g}"
        )


def summarize(splits: Splits, n_samples: int = 5) -> str:
    """Sizes and shapes of both splits and a few training examples, read as the loader reads them."""
    lines = [f"source: {splits.source}"]
    for name, ds in (("train", splits.train), ("val", splits.val)):
        inputs, targets = read_batch(ds, torch.arange(min(len(ds), n_samples)))
        shapes = f"inputs {tuple(inputs.shape[1:])}, targets {tuple(targets.shape[1:])}"
        lines.append(f"{name}: {len(ds):,} examples, {shapes}")
    inputs, targets = read_batch(splits.train, torch.arange(min(len(splits.train), n_samples)))
    for i in range(len(targets)):
        lines.append(f"  example {i}: inputs {inputs[i].tolist()}  target {targets[i].tolist()}")
    return "\n".join(lines)
