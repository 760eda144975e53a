"""Yours to edit: the data, a table of features and a class label, and a held-out validation split.

    python -m default inspect-data                  # the synthetic default
    python -m default inspect-data --data penguins.csv --label species

Inputs: a .csv with a header row or a .parquet file, the label in the last column or the one
--label names (text or whole numbers); or a .npz with arrays `x` (examples, features) and `y`
(integer labels). columns.py types and encodes the other columns, fitted on the training split.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from . import columns
from .columns import Column, DataError, note
from .config import Config
from .datatools import read_batch

TARGET_NAME = "label"
# A label with more classes than this share of the training rows, or more than MAX_NUMBER_CLASSES
# numbers that are not class indices (from 0 or 1, gaps in under half of the range), is likelier a
# measurement (a price, a weight) or an id than classes.
MAX_CLASS_SHARE = 0.1
MAX_NUMBER_CLASSES = 20
SPLIT_SEED = 20240601  # fixed, so every run (whatever its --seed) validates on the same examples


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


@dataclass
class Splits:
    train: FeatureDataset
    val: FeatureDataset
    n_features: int
    n_classes: int
    classes: list[str]  # the label's values, by class index: those of the training split
    label: str  # the column predicted
    columns: list[dict]  # how each feature column is encoded (columns.fit), from the training split
    ids: list[str]  # columns unique on every row, left out
    source: str
    digest: str  # of the whole file's contents

    def describe(self) -> dict:
        """What a resumed run must see again, and what `predict` needs to encode new rows."""
        sizes = {"n_train": len(self.train), "n_val": len(self.val)}
        fields = ("n_features", "n_classes", "classes", "label", "columns", "ids")
        return {"source": self.source, "digest": self.digest, **sizes} | {f: getattr(self, f) for f in fields}

    def trains_on(self) -> str:
        """What the model learns, in a few words: the first lines of a run say it."""
        return f"label {self.label!r}, {self.n_classes} classes"


def load_splits(cfg: Config) -> Splits:
    """Loads --data (or the synthetic default), holds out validation, fits the encoding on the rest."""
    table = read_source(cfg)
    train_idx, val_idx = labelled_split(table, cfg)
    y, classes = class_indices(table, train_idx, cfg)
    if n_unseen := int((y[val_idx] < 0).sum()):
        note(f"{table.source}: {n_unseen:,} validation rows of classes training never saw: left out")
        val_idx = val_idx[y[val_idx] >= 0]
    specs = columns.fit(table.features, train_idx)
    x, y = torch.from_numpy(columns.encode(Path(table.source), table.features, specs)), torch.from_numpy(y)
    return Splits(
        train=FeatureDataset(x[train_idx], y[train_idx]),
        val=FeatureDataset(x[val_idx], y[val_idx]),
        n_features=x.shape[1],
        n_classes=len(classes),
        classes=classes,
        label=table.label.name,
        columns=specs,
        ids=table.ids,
        source=table.source,
        digest=table.digest,
    )


def synthetic_data(n: int = 4096, n_features: int = 16, n_classes: int = 4):
    """Labels from a fixed random two-layer teacher network: learnable, but not linearly."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n_features)).astype(np.float32)
    w1 = rng.standard_normal((n_features, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, n_classes)).astype(np.float32)
    return x, np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)


@dataclass
class Table:
    """A data file as read: feature columns, the label column, and the id columns left out."""

    features: list[Column]
    label: Column
    ids: list[str]
    source: str
    digest: str  # of the whole file's contents
    inputs: list[Column]  # every column but the label, as read: diagnose's split-leak compares rows by them


def read_source(cfg: Config) -> Table:
    """--data (or the synthetic default) as columns: the --label column apart, ids left out."""
    if cfg.data is None:
        if cfg.label is not None:
            raise DataError(f"--label {cfg.label} names a column of a table: give the table with --data")
        return _from_arrays(*synthetic_data(), "synthetic")
    path = Path(cfg.data)
    columns.check_file(path, (*columns.SUFFIXES, ".npz"))
    if path.suffix == ".npz":
        if cfg.label is not None:
            raise DataError(f"{path}: --label names a column of a table; a .npz holds its {TARGET_NAME} in y")
        return _from_arrays(*_read_npz(path), str(path))
    in_file = columns.table_columns(path, columns.read_table(path))
    names = [column.name for column in in_file]
    label = cfg.label or names[-1]
    if label not in names:
        shown = ", ".join(map(repr, names[:20])) + (", ..." if len(names) > 20 else "")
        raise DataError(f"{path}: no column {label!r} (--label) among {shown}")
    target = in_file[names.index(label)]
    if target.missing().all():
        which = "" if cfg.label else " (the last column: no --label given)"
        raise DataError(f"{path}: {label!r}{which} has no values: name the column to predict with --label")
    check_label(path, target)
    others = [column for column in in_file if column.name != label]
    ids, features = [], []
    for column in others:
        if column.is_id():
            ids.append(column.name)
            why = "is unique on every row, an id"
        elif column.missing().all():
            why = "has no values"
        elif column.near_unique():
            why = f"has {len(column.names):,} distinct values in {len(column.values):,} rows, nearly an id"
        else:
            features.append(column)
            continue
        note(f"{path}: column {column.name!r} {why}: left out of the features")
    if not features:
        raise DataError(f"{path}: no feature columns, only the {TARGET_NAME} {label!r}: need at least one")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]  # the length earlier runs' checkpoints hold
    return Table(features, target, ids, str(path), digest, others)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    arrays = columns.read_npz(path)
    x, y = arrays["x"], arrays["y"]
    if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf":
        raise DataError(f"{path}: x and y must be numeric, real: got {x.dtype} values and {y.dtype} values")
    if len(y) == 0:
        raise DataError(f"{path}: no examples")
    if x.shape[1] == 0:
        raise DataError(f"{path}: no feature columns, only the {TARGET_NAME}: need at least one")
    return x, y


def _from_arrays(x: np.ndarray, y: np.ndarray, source: str) -> Table:
    """Arrays x (N, F) and y (N,) as a table of numeric columns x0, x1, ... and the label."""
    features = [Column(f"x{i}", x[:, i].astype(np.float64)) for i in range(x.shape[1])]
    label = Column(TARGET_NAME, y.astype(np.float64))
    for column in (*features, label):
        columns.check_numbers(Path(source), column)
    check_label(Path(source), label)
    digest = hashlib.sha256(np.ascontiguousarray(x))  # of the contents: a resumed run refuses changed data
    digest.update(np.ascontiguousarray(y))
    return Table(features, label, [], source, digest.hexdigest()[:16], features)


def labelled_split(table: Table, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation rows (a fixed validation subset, and the rest) among those with a label."""
    rows = np.nonzero(~table.label.missing())[0]
    if n := len(table.label.values) - len(rows):
        note(f"{table.source}: {n:,} rows without a {TARGET_NAME} ({table.label.name!r}): left out")
    order = rows[np.random.default_rng(SPLIT_SEED).permutation(len(rows))]
    n_val = max(1, round(len(rows) * cfg.val_fraction))
    val, train = order[:n_val], order[n_val:]
    if len(train) < cfg.batch_size:
        raise DataError(
            f"{table.source}: the training split has {len(train)} examples, "
            f"fewer than one batch of {cfg.batch_size}: lower --batch-size"
        )
    return train, val


def check_label(path: Path, label: Column) -> None:
    """Refuses a label of fractional numbers (a target to regress?) or of a single class."""
    if label.names is None:  # whole numbers, each a class named by its value
        bad = np.nonzero(label.values != np.round(label.values))[0]
        bad = bad[~np.isnan(label.values[bad])]  # NaN: no label, a row left out
        if len(bad):
            value = label.values[bad[0]]
            raise DataError(f"{path}: label of example {bad[0]} is {value:g}; labels must be whole or text")
        names = [str(int(v)) for v in np.unique(label.values[~label.missing()])]
    else:
        names = sorted({label.names[code] for code in np.unique(label.values) if code >= 0})
    if len(names) == 1:  # it would train to accuracy 1.0 and learn nothing
        raise DataError(f"{path}: one class only (label {names[0]}): a classifier needs two or more")


def class_indices(table: "Table", train_idx: np.ndarray, cfg: Config) -> tuple[np.ndarray, list[str]]:
    """Each row's class index (-1: unseen in training), the sorted class names; refuses a measurement."""
    label = table.label
    if label.names is None:
        seen = np.unique(label.values[train_idx])
        index = np.searchsorted(seen, label.values).clip(max=len(seen) - 1)
        y = np.where(seen[index] == label.values, index, -1)
        classes = [str(int(v)) for v in seen]
    else:
        seen = sorted(np.unique(label.values[train_idx]), key=lambda code: label.names[code])
        lookup = np.full(len(label.names) + 1, -1)
        lookup[seen] = np.arange(len(seen))
        y = lookup[label.values]
        classes = [label.names[code] for code in seen]
    numbers = label.names is None and not (seen[0] in (0, 1) and seen[-1] < 2 * len(seen))  # not indices
    many = len(classes) > MAX_CLASS_SHARE * len(train_idx) or (numbers and len(classes) > MAX_NUMBER_CLASSES)
    if many and not cfg.many_classes:
        which = "" if cfg.label else " (the last column: no --label given)"
        raise DataError(
            f"{table.source}: {label.name!r}{which} has {len(classes):,} values in {len(train_idx):,}"
            " training rows, like a measurement or an id: name the column to predict with --label, or"
            " confirm these classes with --many-classes"
        )
    return y.astype(np.int64), classes


def summarize(splits: Splits, n_samples: int = 5, n_stats: int = 10_000) -> str:
    """Sizes, label counts, each column's encoding and a few examples, read as the loader reads them."""
    lines = [f"source: {splits.source}"]
    for name, ds in (("train", splits.train), ("val", splits.val)):
        x, y = read_batch(ds, torch.arange(min(len(ds), n_stats)))
        counts = torch.bincount(y, minlength=splits.n_classes).tolist()
        shown = f" (first {len(y):,})" if len(y) < len(ds) else ""
        lines.append(
            f"{name}: {len(ds):,} examples, x {tuple(x.shape[1:])} {x.dtype}, y {y.dtype}; "
            f"label counts{shown} {dict(zip(splits.classes, counts, strict=True))}"
        )
    ids = f"; ids left out: {', '.join(splits.ids)}" if splits.ids else ""
    lines.append(f"label: {splits.label!r}; columns, fitted on the training split{ids}:")
    lines += columns.show(splits.columns)
    x, y = read_batch(splits.train, torch.arange(min(len(splits.train), n_samples)))
    for i in range(len(y)):
        features = ", ".join(f"{v:.3g}" for v in x[i, :8].tolist())
        more = ", ..." if x.shape[1] > 8 else ""
        lines.append(f"  example {i}: label {splits.classes[int(y[i])]}  x [{features}{more}]")
    return "\n".join(lines)
