"""Yours to edit: how pairs are written to shards and read back from them. `prepare` writes them
(write_shards); `train --data DEST` streams them from a shard folder or a URL (load_shards) and
takes any other --data from data.py: load_splits picks.

    python -m everything prepare --data pairs.npz --out data/shards
    python -m everything train --data data/shards --run-dir runs/shards

A shard is a .npz of arrays inputs (n, F) and targets (n,), the splits data.py makes of --data;
its pairs are read as data.py's PairDataset. The index, the cache and the order of an epoch are
the machinery's (runtime/shards.py).
"""

import io
from pathlib import Path

import numpy as np
import torch

from . import data
from .config import Config
from .data import DataError, PairDataset, SequenceDataset, Splits
from .runtime import shards


def load_splits(cfg: Config) -> Splits:
    """Shards when --data names them (a URL, or a folder holding index.json); else data.py's."""
    if shards.is_shards(cfg.data):
        return load_shards(cfg)
    return data.load_splits(cfg)


def load_shards(cfg: Config) -> Splits:
    """A shard folder or URL `prepare` wrote, its shards fetched as training reaches them."""
    index = shards.open_index(cfg.data)
    noise = {"train": cfg.input_noise, "val": 0.0}
    train, val = shards.streamed_splits(cfg, index, lambda split: PairShards(noise[split], cfg.seed))
    return Splits(train, val, cfg.data, shards.index_digest(index))


class PairShards:
    """The shards' reader (runtime/shards.py's ShardReader): .npz files of inputs (n, F) and targets (n,)."""

    def __init__(self, noise: float = 0, seed: int = 0) -> None:
        self.noise, self.seed = noise, seed

    def count(self, entry: dict) -> int:
        return entry["examples"]

    def open(self, path: Path) -> PairDataset:
        with np.load(path, allow_pickle=False) as arrays:
            inputs, targets = torch.from_numpy(arrays["inputs"]), torch.from_numpy(arrays["targets"])
        return PairDataset(inputs, targets, self.noise, self.seed)


def write_shards(cfg: Config, writer: shards.ShardWriter) -> None:
    """`prepare`: the splits data.py makes of --data, as .npz shards of about writer.shard_bytes."""
    splits = data.load_splits(cfg)
    if isinstance(splits.train, SequenceDataset):
        raise DataError(f"{cfg.data}: sequences (lengths) are not written as shards: pairs only")
    for name, split in (("train", splits.train), ("val", splits.val)):
        rows = max(1, writer.shard_bytes // (split.inputs[0].nbytes + split.targets[0].nbytes))
        for first in range(0, len(split), rows):
            inputs, targets = split.inputs[first : first + rows], split.targets[first : first + rows]
            buffer = io.BytesIO()
            np.savez(buffer, inputs=inputs.numpy(), targets=targets.numpy())
            writer.add(name, buffer.getvalue(), len(targets), ".npz")
