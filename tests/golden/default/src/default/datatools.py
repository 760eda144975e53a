"""Helpers for your data.py and model.py (runtime/ uses them too): a sample's randomness, a batch."""

import hashlib

import torch
from torch.utils.data import Dataset, default_collate


def sample_rng(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator for the randomness inside one sample: keyed, never drawn from global state."""
    key = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def read_batch(dataset: Dataset, indices: torch.Tensor):
    """The examples at `indices` as one batch: through `__getitems__` where the dataset has it (in
    memory, fast), else one `dataset[i]` at a time joined by its `collate` (by default stacked)."""
    collate = getattr(dataset, "collate", default_collate)
    if hasattr(dataset, "__getitems__"):
        samples = dataset.__getitems__(indices)
        return samples if isinstance(samples, tuple) else collate(samples)
    return collate([dataset[i] for i in indices.tolist()])
