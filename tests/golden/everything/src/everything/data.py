"""Yours to edit (or replace): the data. The example learns a noisy curve, y = sin(2x) + 0.3x,
from (x, y) pairs.

    python -m everything inspect-data                  # the synthetic example
    python -m everything inspect-data --data pairs.npz  # x (N, F), y (N,)
    python -m everything inspect-data --data seqs.npz   # and lengths (N,)

A .npz with `lengths` holds variable-length sequences, example i being the next lengths[i] rows
of x, with a target per sequence (y of shape (N,)) or per row (y of shape (len(x),)).

Pairs written as shards (`prepare --data pairs.npz --out DEST`: .npz files of arrays inputs (n, F)
and targets (n,)) stream from a folder or a URL: `train --data DEST`. data_shards.py writes and
reads them, and its load_splits hands any other --data to this file's.

What the rest of the project needs from `data.py` (the loop, the checks and `inspect-data` use
nothing else, so a dataset of your own works if it keeps to this):

- `load_splits(cfg) -> Splits`, whose `train` and `val` are map-style datasets of single
  examples: `len(ds)`, and `ds[i] -> (input, target)` as tensors (an ImageFolder-style dataset
  is one). The validation split is never trained on and is the same for every --seed.
- Optionally `ds.__getitems__(indices)`: a whole batch at once (an int64 tensor of indices in,
  the stacked `(inputs, targets)` out), which keeps in-memory data fast; or `ds.collate(samples)`:
  how a list of `ds[i]` becomes a batch where stacking cannot (examples of different lengths).
- Randomness inside a sample (augmentation, random crops) drawn from
  `datatools.sample_rng(seed, self.epoch, i)`, never from the global RNGs: the loader sets
  `ds.epoch` before each batch, so the numbers stay the same for any number of workers and
  after a resume. Open files in `__getitem__`, not in `__init__`: each worker has its own copy.
- `Splits.describe()`: the facts a resumed run must see again; `summarize(splits)`: what
  `inspect-data` prints; `DataError` for input that cannot be used.
"""

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import Config
from .datatools import read_batch, sample_rng

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
        return input_noise(self.noise, self.inputs.shape[1:], sample_rng(self.seed, self.epoch, i))


def input_noise(std: float, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor | float:
    return std * torch.randn(shape, generator=generator) if std else 0.0


# Padded lengths of a batch of variable-length examples: a compiled model builds one graph a length,
# not one for each longest example a batch happens to hold. Bigger gaps waste more padding.
BUCKET_RATIO = 2  # each length twice the one before it, up to the longest
MIN_BUCKET = 8


def bucket_lengths(longest: int) -> list[int]:
    lengths = [longest]
    while -(-lengths[-1] // BUCKET_RATIO) >= MIN_BUCKET:
        lengths.append(-(-lengths[-1] // BUCKET_RATIO))
    return lengths[::-1]  # longest 64: [8, 16, 32, 64]; 40: [10, 20, 40]


class SequenceDataset(Dataset):
    """Variable-length sequences: example i is rows starts[i]:ends[i] of `inputs`, (n, F), with
    their targets (n,), NaN at a row without one (a target per sequence sits at its last row).
    `collate` pads a batch at the end to the shortest of `bucket_lengths` that holds the longest."""

    epoch = 0  # the loader sets it before each batch

    def __init__(self, inputs, targets, starts, ends, longest: int, noise: float = 0, seed: int = 0) -> None:
        self.inputs = inputs  # (rows, F) float32, every sequence's rows one after another
        self.targets = targets  # (rows,) float32, NaN: no target
        self.starts, self.ends = starts, ends  # (N,) int64: the rows of each example
        self.lengths = bucket_lengths(longest)  # the same for both splits
        self.noise = noise
        self.seed = seed

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(int(self.starts[i]), int(self.ends[i]))
        noise = input_noise(self.noise, self.inputs[rows].shape, sample_rng(self.seed, self.epoch, i))
        return self.inputs[rows] + noise, self.targets[rows]  # (n, F), (n,)

    def collate(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pads the inputs with 0 (a causal model never reads them from an earlier row) and the
        targets with NaN (no loss)."""
        longest = max(len(x) for x, _ in samples)
        length = next(n for n in self.lengths if n >= longest)
        x = torch.zeros(len(samples), length, self.inputs.shape[1])
        y = torch.full((len(samples), length), math.nan)
        for row, (inputs, targets) in enumerate(samples):
            x[row, : len(inputs)], y[row, : len(targets)] = inputs, targets
        return x, y  # (B, length, F), (B, length)


@dataclass
class Splits:
    train: PairDataset | SequenceDataset | Dataset
    val: PairDataset | SequenceDataset | Dataset
    source: str
    digest: str  # of the data's contents: a resumed run refuses data that changed

    def describe(self) -> dict:
        return {
            "source": self.source,
            "digest": self.digest,
            "n_train": len(self.train),
            "n_val": len(self.val),
        }

    def trains_on(self) -> str:
        """What the model learns, in a few words: the first lines of a run say it."""
        return f"real targets from inputs of width {self.train[0][0].shape[-1]}"


def load_splits(cfg: Config) -> Splits:
    inputs, targets, lengths = (*example_data(), None) if cfg.data is None else read_pairs(Path(cfg.data))
    n = len(targets) if lengths is None else len(lengths)
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = max(1, round(n * cfg.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    if len(train_idx) < cfg.batch_size:
        raise DataError(f"{len(train_idx)} training examples, fewer than one batch of {cfg.batch_size}")
    arrays = (inputs, targets) if lengths is None else (inputs, targets, lengths)
    contents = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:16]
    source = cfg.data or "example"
    inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
    if lengths is None:
        train = PairDataset(inputs[train_idx], targets[train_idx], cfg.input_noise, cfg.seed)
        return Splits(train, PairDataset(inputs[val_idx], targets[val_idx]), source, contents)
    ends = np.cumsum(lengths)
    starts, longest = ends - lengths, int(lengths.max())
    train = SequenceDataset(
        inputs, targets, starts[train_idx], ends[train_idx], longest, cfg.input_noise, cfg.seed
    )
    val = SequenceDataset(inputs, targets, starts[val_idx], ends[val_idx], longest)
    return Splits(train, val, source, contents)


def example_data(n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(n, 1)).astype(np.float32)
    y = np.sin(2 * x[:, 0]) + 0.3 * x[:, 0] + 0.05 * rng.standard_normal(n)
    return x, y.astype(np.float32)


def read_pairs(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Inputs x (rows, F) and targets y (rows,) from a .npz, as float32, and the lengths (N,) of
    its sequences where it holds them (None: each row an example)."""
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file: expected a .npz file with arrays x and y")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix != ".npz":
        raise DataError(f"{path}: expected a .npz file with arrays x and y")
    arrays = read_npz(path, optional=("lengths",))
    x, y, lengths = arrays["x"], arrays["y"], arrays.get("lengths")
    check_values(path, "input", x)
    check_values(path, "target", y)
    x, y = x.astype(np.float32), y.astype(np.float32)
    if lengths is None:
        return x, y, None
    lengths = check_lengths(path, lengths, len(x))
    if len(y) == len(lengths) != len(x):  # a target per sequence: at its last row
        per_row = np.full(len(x), np.nan, dtype=np.float32)
        per_row[np.cumsum(lengths) - 1] = y
        y = per_row
    elif len(y) != len(x):
        need = f"one per sequence ({len(lengths)}) or one per row ({len(x)})"
        raise DataError(f"{path}: y has {len(y)} values; need {need}")
    return x, y, lengths


def check_lengths(path: Path, lengths: np.ndarray, rows: int) -> np.ndarray:
    if lengths.dtype.kind not in "iu" or lengths.ndim != 1:
        raise DataError(f"{path}: lengths must be (N,) integers, not {lengths.dtype} {lengths.shape}")
    if len(lengths) == 0 or lengths.min() < 1:
        raise DataError(f"{path}: every sequence needs at least one row (lengths must be >= 1)")
    if int(lengths.sum()) != rows:
        raise DataError(f"{path}: lengths add up to {int(lengths.sum())} rows; x has {rows}")
    return lengths.astype(np.int64)


def read_npz(path: Path, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Arrays x (N, F) and y (N,) of a .npz file, and those of `optional` it holds, or a DataError."""
    try:
        with np.load(path, allow_pickle=False) as arrays:  # never unpickle data
            if missing := [key for key in ("x", "y") if key not in arrays.files]:
                found = ", ".join(arrays.files[:10]) or "none"
                raise DataError(f"{path}: missing array(s) {', '.join(missing)}; found {found}")
            found = {key: arrays[key] for key in ("x", "y", *optional) if key in arrays.files}
    except DataError:
        raise
    except Exception as error:  # not a zip, a truncated one, or object arrays (refused unread)
        raise DataError(f"{path}: not a readable .npz file of numeric arrays ({error})") from None
    x, y = found["x"], found["y"]
    if x.ndim != 2 or y.ndim != 1 or (len(found) == 2 and len(y) != len(x)):  # else its caller checks
        raise DataError(f"{path}: need x of shape (N, F) and y of shape (N,), got {x.shape} and {y.shape}")
    return found


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
        padded = " (padded)" if isinstance(ds, SequenceDataset) else ""
        lines.append(f"{name}: {len(ds):,} examples, {shapes}{padded}")
    for i in range(min(len(splits.train), n_samples)):
        inputs, targets = splits.train[i]
        if isinstance(splits.train, SequenceDataset):
            labelled = targets[~targets.isnan()]
            rows = f"{len(inputs)} rows, inputs {_rounded(inputs[:3])}{' ...' if len(inputs) > 3 else ''}"
            lines.append(f"  example {i}: {rows}  targets {_rounded(labelled[:3])} on {len(labelled)} rows")
        else:
            lines.append(f"  example {i}: inputs {_rounded(inputs)}  target {_rounded(targets)}")
    return "\n".join(lines)


def _rounded(values: torch.Tensor) -> list | float:
    return np.round(values.double().numpy(), 4).tolist()
