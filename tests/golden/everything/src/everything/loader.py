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
    Each rank takes its slice of every global batch of world_size x batch_size examples, so N
    processes with batch B see exactly the examples one process with batch N x B would.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int, rank: int, world_size: int) -> None:
        self.n_examples = n_examples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def batches_per_epoch(self) -> int:
        return self.n_examples // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_examples)
        for b in range(self.start, self.batches_per_epoch()):
            first = (b * self.world_size + self.rank) * self.batch_size
            yield torch.from_numpy(order[first : first + self.batch_size])


def seed_worker(worker_id: int) -> None:
    """Seeds a loader worker's Python and NumPy from the seed torch gave it."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_loaders(splits: Splits, cfg: Config, device: torch.device, rank: int, world_size: int):
    """The training loader (resumable order, drop_last) and the validation loader (in order).

    Validation batches are dealt out to the ranks in turn: together they cover every example once.
    """
    batches = EpochBatches(len(splits.train), cfg.batch_size, cfg.seed, rank, world_size)
    val_batches = torch.arange(len(splits.val)).split(cfg.batch_size)[rank::world_size]
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
