"""Batches in a resumable order: the order is a pure function of (seed, epoch), and a resumed
run skips exactly the batches it already trained on, however many workers load them.
"""

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .config import Config
from .data import Splits


class EpochBatches(Sampler[torch.Tensor]):
    """Training batches of a shuffled epoch, dropping the last partial one.

    `set_epoch(epoch, start)` skips the first `start` batches: those a resumed run trained on.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int) -> None:
        self.n_examples = n_examples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def batches_per_epoch(self) -> int:
        return self.n_examples // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_examples)
        for b in range(self.start, self.batches_per_epoch()):
            yield torch.from_numpy(order[b * self.batch_size : (b + 1) * self.batch_size])


def seed_worker(worker_id: int) -> None:
    """Seeds a loader worker's Python and NumPy from the seed torch gave it."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_loaders(splits: Splits, cfg: Config, device: torch.device):
    """The training loader (resumable order, drop_last) and the validation loader (in order)."""
    batches = EpochBatches(len(splits.train), cfg.batch_size, cfg.seed)
    val_batches = torch.arange(len(splits.val)).split(cfg.batch_size)  # in order, every example once
    common = {
        "batch_size": None,  # the samplers yield whole batches of indices (a tensor indexes fastest)
        "num_workers": cfg.num_workers,
        "pin_memory": device.type == "cuda",  # page-locked batches make non_blocking copies async
        "persistent_workers": cfg.num_workers > 0,
        "prefetch_factor": 4 if cfg.num_workers > 0 else None,
        "worker_init_fn": seed_worker,
    }
    # Each loader has its own generator: a loader without one draws worker seeds from the global
    # RNG whenever an iterator starts, and a resumed run would then drift from the original.
    train = DataLoader(
        splits.train, sampler=batches, generator=torch.Generator().manual_seed(cfg.seed), **common
    )
    val = DataLoader(
        splits.val, sampler=val_batches, generator=torch.Generator().manual_seed(cfg.seed), **common
    )
    return train, val, batches
