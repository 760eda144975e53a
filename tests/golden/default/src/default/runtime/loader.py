"""Machinery: batches in a resumable order, for any map-style dataset of single examples.

The order is a pure function of (seed, epoch); a resumed run skips exactly the batches it trained
on. The loader sets `dataset.epoch` before each batch, so augmentation can key its randomness by
(seed, epoch, index) with `datatools.sample_rng`: the same for any number of workers, and resumed."""

import hashlib
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import Config, ConfigError
from ..datatools import read_batch
from .distributed import WORKER_START, Dist, init_distributed, validation_batches
from .stopping import ignore_stop_signals


class Shuffle:
    """A random permutation of range(n) keyed by (seed, epoch), worked out for the positions asked:
    no memory whatever n is (a billion window starts shuffled would take 8 GB and seconds an epoch).
    `order[positions]`: a 4-round Feistel network over the smallest even power of two >= n, a result
    outside range(n) sent through again until it lands inside (a bijection still)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        key = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * self.ROUNDS).digest()
        self.keys = np.frombuffer(key, dtype=np.uint64)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        out = self._permute(np.asarray(positions, dtype=np.uint64))
        while (outside := out >= self.n).any():
            out[outside] = self._permute(out[outside])
        return out.astype(np.int64)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every bit of x (uint64 wraps, as it should)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(13787848793156543929)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(10723151780598845931)
    return x ^ (x >> np.uint64(31))


class EpochBatches(Sampler[tuple[int, torch.Tensor]]):
    """Training batches of a shuffled epoch as (epoch, indices), dropping the last partial one, of
    the first `n_examples` (--max-train-examples). `set_epoch(epoch, start)` skips the `start` batches
    a resumed run trained on. Each rank takes its slice of every global batch of world_size x
    batch_size examples: N processes of batch B see exactly what one of batch N x B would."""

    AHEAD = 64  # batches whose examples are worked out at once: numpy's cost is per call

    def __init__(
        self, n_examples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.n_examples, self.batch_size, self.seed = n_examples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def batches_per_epoch(self) -> int:
        return self.n_examples // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start

    def __iter__(self):
        order = Shuffle(self.n_examples, self.seed, self.epoch)
        batches = range(self.start, self.batches_per_epoch())
        for i in range(0, len(batches), self.AHEAD):
            ahead = batches[i : i + self.AHEAD]
            firsts = [(b * self.world_size + self.rank) * self.batch_size for b in ahead]
            positions = np.add.outer(firsts, np.arange(self.batch_size))  # (batches, B)
            yield from ((self.epoch, indices) for indices in torch.from_numpy(order[positions]))


class EpochDataset(Dataset):
    """What the loaders read: the dataset, told the epoch of each batch before reading it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: tuple[int, torch.Tensor]):
        epoch, indices = batch
        self.dataset.epoch = epoch  # in whichever process reads this batch
        return read_batch(self.dataset, indices)


def training_examples(splits, cfg: Config) -> int:
    """How many training examples the sampler draws from: the first --max-train-examples, or all."""
    return min(len(splits.train), cfg.max_train_examples or len(splits.train))


def _as_read(batch):
    """The collate_fn: EpochDataset returns whole batches already."""
    return batch


def epoch_batches(loader: DataLoader):
    """One epoch of `loader`'s batches; with no workers and nothing to pin, read here without the
    DataLoader's own work for each batch (about 20 us, 1% of the default model's step on a CPU)."""
    if loader.num_workers > 0 or loader.pin_memory:
        return iter(loader)
    return (loader.dataset.__getitems__(batch) for batch in loader.batch_sampler)


def close(loader: DataLoader) -> None:
    """Ends a loader's persistent workers now (no public call): after an error in a worker torch
    keeps them to the exit, where they (ignoring stop signals) would hang it."""
    if loader._iterator is not None:
        loader._iterator._shutdown_workers()


def seed_worker(worker_id: int) -> None:
    """Seeds a loader worker's Python and NumPy from torch's seed for it; stopping is the main process's."""
    ignore_stop_signals()
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_loaders(splits, cfg: Config, device: torch.device, group: Dist | None = None):
    """The training loader (resumable order, drop_last) and the validation loader (in order), for
    this process's rank of `group` (by default init_distributed's: rank 0 of 1 in a plain process)."""
    group = group or init_distributed(device.type)
    n_train = training_examples(splits, cfg)
    batches = EpochBatches(n_train, cfg.batch_size, cfg.seed, group.rank, group.world_size)
    if batches.batches_per_epoch() == 0:
        raise ConfigError(
            f"{n_train} training examples make no full batch of {cfg.batch_size} x {group.world_size}"
            " processes: lower --batch-size"
        )
    val_batches = [(0, b) for b in validation_batches(len(splits.val), cfg.batch_size, group)]

    def loader(split, batch_sampler) -> DataLoader:
        # its own generator: without one, worker seeds come from the global RNG and a resume drifts
        return DataLoader(
            EpochDataset(split),
            batch_sampler=batch_sampler,
            generator=torch.Generator().manual_seed(cfg.seed),
            collate_fn=_as_read,
            num_workers=cfg.num_workers,
            pin_memory=device.type == "cuda",  # page-locked batches make non_blocking copies async
            persistent_workers=cfg.num_workers > 0,
            prefetch_factor=4 if cfg.num_workers > 0 else None,
            worker_init_fn=seed_worker,
            multiprocessing_context=WORKER_START if cfg.num_workers > 0 else None,
        )

    return loader(splits.train, batches), loader(splits.val, val_batches), batches
