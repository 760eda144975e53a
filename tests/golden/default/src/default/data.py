"""Yours to edit: the data, feature vectors and class labels, and a held-out validation split.

    python -m default inspect-data                  # the synthetic default
    python -m default inspect-data --data features.csv

Inputs: a .npz with arrays `x` (examples, features) and `y` (integer labels), or a .csv with a
header row, numeric columns, and the integer label in the last column.

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

import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import Config
from .runtime.loader import read_batch

SPLIT_SEED = 20240601  # fixed, so every run (whatever its --seed) validates on the same examples


class DataError(ValueError):
    """Input data that cannot be used, naming the file and the offending line or field."""


class FeatureDataset(Dataset):
    """In-memory features and targets: one example by `ds[i]`, a whole batch by `__getitems__`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x = x  # (N, F) float32
        self.y = y  # (N,) targets

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]  # one gather per batch, not one per example


def digest(*arrays: np.ndarray) -> str:
    """A fingerprint of the data's contents: a resumed run refuses data that changed."""
    hasher = hashlib.sha256()
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).tobytes())
    return hasher.hexdigest()[:16]


def split_indices(n: int, cfg: Config, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation indices: a fixed validation subset, and the rest."""
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = max(1, round(n * cfg.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    if len(train_idx) < cfg.batch_size:
        raise DataError(
            f"{source}: the training split has {len(train_idx)} examples, "
            f"fewer than one batch of {cfg.batch_size}: lower --batch-size"
        )
    return train_idx, val_idx


@dataclass
class Splits:
    train: "FeatureDataset"
    val: "FeatureDataset"
    n_features: int
    n_classes: int
    source: str
    digest: str  # of the whole file's contents

    def describe(self) -> dict:
        """What a resumed run must see again: it refuses to continue on different data."""
        return {
            "source": self.source,
            "digest": self.digest,
            "n_train": len(self.train),
            "n_val": len(self.val),
            "n_features": self.n_features,
            "n_classes": self.n_classes,
        }


def load_splits(cfg: Config) -> Splits:
    """Loads --data (or the synthetic default) and holds out the validation split."""
    if cfg.data is None:
        x, y = synthetic_data()
        source = "synthetic"
    else:
        x, y = read_arrays(Path(cfg.data))
        source = str(cfg.data)
    train_idx, val_idx = split_indices(len(y), cfg, source)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    return Splits(
        train=FeatureDataset(x_t[train_idx], y_t[train_idx]),
        val=FeatureDataset(x_t[val_idx], y_t[val_idx]),
        n_features=x.shape[1],
        n_classes=int(y.max()) + 1,
        source=source,
        digest=digest(x, y),
    )


def synthetic_data(n: int = 4096, n_features: int = 16, n_classes: int = 4):
    """Labels from a fixed random two-layer teacher network: learnable, but not linearly."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n_features)).astype(np.float32)
    w1 = rng.standard_normal((n_features, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, n_classes)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    return x, y


TARGET_NAME = "label"


def read_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads features (N, F) as float32 and targets (N,) from a .npz or .csv file."""
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file: expected a .npz or .csv file")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".npz":
        x, y = _read_npz(path)
    elif path.suffix == ".csv":
        x, y = _read_csv(path)
    else:
        raise DataError(f"{path}: expected a .npz or .csv file")
    if len(y) == 0:
        raise DataError(f"{path}: no examples")
    if x.shape[1] == 0:
        raise DataError(f"{path}: no feature columns, only the last (the {TARGET_NAME}): need at least one")
    check_values(path, "feature", x)
    check_values(path, TARGET_NAME, y)
    return x.astype(np.float32), _targets(path, y)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    arrays = read_npz(path)
    x, y = arrays["x"], arrays["y"]
    if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
        raise DataError(f"{path}: x and y must be numeric, got {x.dtype} and {y.dtype}")
    return x, y


def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if len(rows) < 2:
        raise DataError(f"{path}: need a header row and at least one example")
    header, values = rows[0], []
    if all(_is_number(cell) for cell in header):  # read as names, it would lose the first example
        raise DataError(
            f"{path}:1: every field is a number: the file needs a header row naming its columns, "
            f"the {TARGET_NAME} last"
        )
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{path}:{line}: {len(row)} fields, the header has {len(header)}")
        try:
            values.append([float(cell) for cell in row])
        except ValueError:
            column, cell = next((h, c) for h, c in zip(header, row, strict=True) if not _is_number(c))
            raise DataError(f"{path}:{line}: column {column!r} holds {cell!r}, not a number") from None
    table = np.array(values)
    return table[:, :-1], table[:, -1]


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def read_npz(path: Path, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Arrays x (N, F) and y (N,) of a .npz file, and those of `optional` it holds, never
    unpickled, or a DataError in one line."""
    try:
        with np.load(path, allow_pickle=False) as arrays:  # never unpickle data
            missing = [key for key in ("x", "y") if key not in arrays.files]
            if missing:
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


def _targets(path: Path, y: np.ndarray) -> np.ndarray:
    """Class labels: whole numbers from 0."""
    bad = np.nonzero((y != np.round(y)) | (y < 0))[0]
    if len(bad):
        raise DataError(f"{path}: label of example {bad[0]} is {y[bad[0]]}; labels must be integers >= 0")
    if len(np.unique(y)) == 1:  # it would train to accuracy 1.0 and learn nothing
        raise DataError(f"{path}: one class only (label {int(y[0])}): a classifier needs two or more")
    if y.max() >= len(y):  # more classes than examples: a typo, not a data set
        row = int(np.argmax(y))
        raise DataError(f"{path}: label of example {row} is {int(y[row])}, more classes than examples")
    return y.astype(np.int64)


def summarize(splits: Splits, n_samples: int = 5, n_stats: int = 10_000) -> str:
    """Shapes, dtypes, label counts and a few examples, read as the loader reads them."""
    lines = [f"source: {splits.source}"]
    for name, ds in (("train", splits.train), ("val", splits.val)):
        x, y = read_batch(ds, torch.arange(min(len(ds), n_stats)))
        counts = torch.bincount(y, minlength=splits.n_classes).tolist()
        shown = f" (first {len(y):,})" if len(y) < len(ds) else ""
        lines.append(
            f"{name}: {len(ds):,} examples, x {tuple(x.shape[1:])} {x.dtype}, y {y.dtype}; "
            f"label counts{shown} {dict(enumerate(counts))}"
        )
    x, y = read_batch(splits.train, torch.arange(min(len(splits.train), n_stats)))
    lines.append(f"features: mean {x.mean():.4g}, std {x.std():.4g}, min {x.min():.4g}, max {x.max():.4g}")
    for i in range(min(n_samples, len(y))):
        features = ", ".join(f"{v:.3g}" for v in x[i, :8].tolist())
        more = ", ..." if x.shape[1] > 8 else ""
        lines.append(f"  example {i}: label {int(y[i])}  x [{features}{more}]")
    return "\n".join(lines)
