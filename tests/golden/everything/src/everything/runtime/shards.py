"""Machinery: data in shards with an index, in a folder or at a URL, streamed through a bounded cache.

    python -m everything prepare --data SOURCE --out s3://bucket/data
    python -m everything train --data s3://bucket/data --cache-size 20GB

The folder (--out a folder, or a URL prefix) holds the shards and index.json, written last (JSON,
readable without the project): {"format": "scaffold-shards", "version": 1, "task", "meta" (what the
task's reader needs), "files" (extra files by name: {"bytes", "sha256"}), "splits": {"train": [...],
"val": [...]}}, each shard {"name", "bytes", "examples", "sha256"}. A folder is read in place. A
URL's shards are fetched and verified into a cache folder
($XDG_CACHE_HOME/everything/shards/), a window ahead of need,
by a thread of the main process, and deleted once every batch that reads them is read: the disk
holds --cache-size at most, so a data set larger than the disk trains. A missing index or shard,
or one fetched twice and damaged both times, is one line and exit 2.

The order of an epoch is keyed by (seed, epoch) alone: the shards shuffled, cut into windows of
--shuffle-window shards, the examples of each window shuffled. Global batch b is positions
[b G, (b + 1) G) of it (G: processes x batch size), each rank its slice, so a run resumed at any
number of processes sees the global batches of one that never stopped.

A store that goes away is retried (1 s doubling to 30 s) for --fetch-retry-minutes while training
goes on with what is cached; then the run stops at the end of its step with a checkpoint, as a
stop signal (SIGUSR1, exit 138) stops it, and the same command resumes it once the store is back.
A read that cannot wait for the prefetch (the cache ran dry) fetches the shard itself, retried as
long; given up, it ends the run in one line (exit 1): the last checkpoint stands.
"""

import json
import os
import shutil
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import Protocol

import fsspec
import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import Config, ConfigError
from .loader import Shuffle
from .shardcache import ShardError, Shards, StoreAway, cache_bytes, reaching, sha256, size, url_to_fs
from .stopping import request_stop
from .store import StoreError, is_url

FORMAT, VERSION = "scaffold-shards", 1
INDEX = "index.json"
IN_FLIGHT = 2  # batches read besides those the loader's workers hold, before a shard may be evicted


class ShardReader(Protocol):
    """What a task gives for each split (data_shards.py): how to count and open one of its shards."""

    def count(self, entry: dict) -> int:
        """Examples in the shard `entry` of the index names (its "examples", or worked out from it)."""

    def open(self, path: Path) -> Dataset:
        """A map-style dataset of the shard's examples, read from the local file `path`."""


def index_digest(index: dict) -> str:
    """The data's digest for Splits.digest: a resume refuses shards that changed."""
    shards = [entry["sha256"] for split in ("train", "val") for entry in index["splits"][split]]
    return sha256(" ".join(shards).encode())[:16]


def is_shards(source: str | None) -> bool:
    """A URL (a store's data is always sharded), or a folder holding index.json."""
    return source is not None and (is_url(source) or (Path(source) / INDEX).is_file())


class ShardWriter:
    """Writes shards and their index to `dest`, a folder or a URL, so that an index names only
    complete shards: a folder is written as .NAME.partial and renamed at the end; a URL's shards
    are uploaded first and index.json last. A destination holding an index is refused.

        with ShardWriter(dest, "custom", meta) as writer:
            writer.add("train", data, examples=1000, suffix=".npz")
        print(writer.close())
    """

    def __init__(
        self, dest: str, task: str, meta: dict | None = None, files: dict[str, bytes] | None = None,
        shard_mb: float = 64,
    ) -> None:  # fmt: skip
        self.dest = dest.rstrip("/")
        self.shard_bytes = int(shard_mb * 2**20)  # the size a task's write_shards aims its shards at
        self.index = {"format": FORMAT, "version": VERSION, "task": task, "meta": meta or {}, "files": {}}
        self.index["splits"] = {"train": [], "val": []}
        self.closed = False
        if is_url(self.dest):
            self.fs, self.root = url_to_fs(self.dest)
            with reaching(self.dest):
                taken = self.fs.exists(f"{self.root}/{INDEX}")
        else:
            final = Path(self.dest)
            taken = (final / INDEX).exists()
            if not taken and final.exists() and (not final.is_dir() or any(final.iterdir())):
                raise ShardError(f"{final} exists and is not an empty folder: prepare into a new --out")
            self.fs, self.root = fsspec.filesystem("file"), str(final.with_name(f".{final.name}.partial"))
            shutil.rmtree(self.root, ignore_errors=True)  # a cut-off prepare's
            Path(self.root).mkdir(parents=True)
        if taken:
            raise ShardError(f"{self.dest} holds a shard index already: prepare into another --out")
        for name, data in (files or {}).items():
            self.add_file(name, data)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None and not is_url(self.dest):
            shutil.rmtree(self.root, ignore_errors=True)  # a URL's shards stay unnamed: no index
        elif kind is None and not self.closed:
            self.close()

    def add_file(self, name: str, data: bytes) -> None:
        """An extra file the task's reader needs (a tokenizer), fetched at the start of a run."""
        self._put(name, data)
        self.index["files"][name] = {"bytes": len(data), "sha256": sha256(data)}

    def add(self, split: str, data: bytes, examples: int, suffix: str) -> None:
        """One shard of `split` ("train" or "val"): `examples` examples in `data`, named NAME`suffix`."""
        shards = self.index["splits"][split]
        name = f"{split}-{len(shards):05d}{suffix}"
        self._put(name, data)
        shards.append({"name": name, "bytes": len(data), "examples": examples, "sha256": sha256(data)})

    def _put(self, name: str, data: bytes) -> None:
        with reaching(f"{self.dest}/{name}"):
            self.fs.pipe_file(f"{self.root}/{name}", data)

    def close(self) -> str:
        """Writes the index (a folder: renames it into place); says what it wrote."""
        self.closed = True
        self._put(INDEX, json.dumps(self.index, indent=1).encode())
        if not is_url(self.dest):
            os.replace(self.root, self.dest)  # a folder is renamed over an empty one
        said = []
        for split, shards in self.index["splits"].items():
            examples = sum(entry["examples"] for entry in shards)
            plural = "" if len(shards) == 1 else "s"
            said.append(f"{len(shards)} {split} shard{plural} ({examples:,} examples)")
        return f"wrote {' and '.join(said)} to {self.dest}"


def open_index(source: str) -> dict:
    """The index of the shards at `source`, a folder or a URL, every shard it names present with
    its size: or a ShardError, before training."""
    where = source.rstrip("/")
    fs, root = url_to_fs(where) if is_url(where) else (fsspec.filesystem("file"), str(Path(where).resolve()))
    try:
        with reaching(where):
            text = fs.cat_file(f"{root}/{INDEX}")
            listed = {info["name"].rsplit("/", 1)[-1]: info["size"] for info in fs.ls(root, detail=True)}
    except FileNotFoundError:
        raise ShardError(f"{where}: no {INDEX}: not a shard folder (`prepare --out` writes one)") from None
    try:
        index = json.loads(text)
    except ValueError as error:
        raise ShardError(f"{where}/{INDEX} is unreadable ({error})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ShardError(f"{where}/{INDEX} is not a {FORMAT} index of version {VERSION}")
    entries = [*index["files"].items(), *((e["name"], e) for s in index["splits"].values() for e in s)]
    for name, entry in entries:
        if name not in listed:
            raise ShardError(f"{where}/{name} is missing: the index names it (prepare the data again)")
        if listed[name] != entry["bytes"]:
            raise ShardError(f"{where}/{name} holds {listed[name]} bytes; the index says {entry['bytes']}")
    return index


class Order:
    """An epoch's order of a ShardedSplit's examples, like loader.Shuffle: order[positions] -> ids.
    The shards permuted, cut into windows of `window` shards, each window's examples permuted."""

    def __init__(self, split: "ShardedSplit", seed: int, epoch: int) -> None:
        self.split, self.seed, self.epoch = split, seed, epoch
        n = len(split.counts)
        self.shards = Shuffle(n, seed, epoch)[np.arange(n)]  # the shards in the order read
        counts = split.counts[self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # of each shard read, in positions
        self.windows = self.starts[:: split.window]  # each window's first position, and the end's
        if self.windows[-1] != self.starts[-1]:
            self.windows = np.append(self.windows, self.starts[-1])

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        window = np.searchsorted(self.windows, positions, "right") - 1
        shuffled = positions.copy()
        for w in np.unique(window):  # a few windows a batch at most: one Shuffle each
            here = window == w
            first, size = self.windows[w], self.windows[w + 1] - self.windows[w]
            within = Shuffle(int(size), self.seed, f"{self.epoch}:{w}")  # keyed by the window too
            shuffled[here] = first + within[positions[here] - first]
        read = np.searchsorted(self.starts, shuffled, "right") - 1  # the shard read, of self.shards
        shard = self.shards[read]
        return self.split.firsts[shard] + shuffled - self.starts[read]

    def window_shards(self, w: int) -> list[int]:
        """The shards of window w, in the order read."""
        return self.shards[w * self.split.window : (w + 1) * self.split.window].tolist()

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.windows, position, "right") - 1)

    def sampled(self, position: int) -> None:
        """The sampler is at `position` of this epoch: the prefetch fetches ahead and evicts behind."""
        if self.split.prefetch is not None:
            self.split.prefetch.sampled(self, position)


class ShardedSplit(Dataset):
    """A split of shards as one map-style dataset: example ids run through the shards in index
    order; a batch's examples are read from the shards that hold them, each opened by the task's
    reader (a few kept open in each process)."""

    epoch = 0  # the loader sets it before each batch

    def __init__(
        self, shards: Shards, entries: list[dict], reader: ShardReader, window: int, limit: int = 0
    ) -> None:
        counts = np.array([reader.count(entry) for entry in entries], dtype=np.int64)
        if 0 < limit < counts.sum():  # --max-train-examples: the first shards holding that many, the last cut
            kept = int(np.searchsorted(np.cumsum(counts), limit)) + 1
            entries, counts = entries[:kept], counts[:kept]
            counts[-1] -= counts.sum() - limit
        self.shards, self.entries, self.reader, self.window = shards, entries, reader, window
        self.counts = counts
        self.firsts = np.concatenate([[0], np.cumsum(self.counts)])  # each shard's first example id
        self.open: OrderedDict[int, Dataset] = OrderedDict()
        self.prefetch: Prefetch | None = None  # the training split's, in the main process

    def __getstate__(self) -> dict:  # a loader worker opens its own shards and fetches no more ahead
        return self.__dict__ | {"open": OrderedDict(), "prefetch": None}

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def shuffle(self, seed: int, epoch: int) -> Order:
        return Order(self, seed, epoch)

    def dataset(self, shard: int) -> Dataset:
        """Shard `shard` as the reader's dataset, opened (and fetched) if not open in this process."""
        if shard not in self.open:
            self.open[shard] = self.reader.open(self.shards.path(self.entries[shard]["name"]))
            if len(self.open) > self.window + 1:  # the window read, and the next's first shard
                self.open.popitem(last=False)
        self.open.move_to_end(shard)
        return self.open[shard]

    def __getitem__(self, i: int):
        shard = int(np.searchsorted(self.firsts, i, "right") - 1)
        data = self.dataset(shard)
        data.epoch = self.epoch
        return data[i - int(self.firsts[shard])]

    def __getitems__(self, ids: torch.Tensor):
        """A batch: each shard's examples read at once (its __getitems__ or collate), then put in order."""
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self.firsts, ids, "right") - 1
        parts, order = [], []
        for s in np.unique(shard):
            data, at = self.dataset(int(s)), np.flatnonzero(shard == s)
            data.epoch = self.epoch
            local = torch.from_numpy(ids[at] - self.firsts[s])
            parts.append(_read(data, local))
            order.append(at)
        inverse = torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))
        return tuple(torch.cat(part)[inverse] for part in zip(*parts, strict=True))


def _read(data: Dataset, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if hasattr(data, "__getitems__"):
        return tuple(data.__getitems__(ids))
    collate = getattr(data, "collate", torch.utils.data.default_collate)
    return tuple(collate([data[i] for i in ids.tolist()]))


class Prefetch:
    """The thread of the main process that fetches the training shards one window ahead of the
    sampler and evicts those every position has read; --cache-size bounds what it fetches."""

    def __init__(self, split: ShardedSplit, limit: int, in_flight: int, keep: set[str]) -> None:
        self.split, self.shards, self.limit = split, split.shards, limit
        self.keep = keep  # the validation shards and the extra files: read again and again
        self.recent = deque(maxlen=in_flight + IN_FLIGHT)  # (order, position) of the batches sampled last
        self.span = None  # the windows of the oldest and the newest of them
        self.wake = threading.Event()
        self.wake.set()  # the kept files first, at the start: validation must not wait for the store
        threading.Thread(target=self._run, daemon=True, name="prefetch").start()

    def sampled(self, order: Order, position: int) -> None:
        self.recent.append((order, position))
        (old, first), (new, last) = self.recent[0], self.recent[-1]
        span = (id(old), old.window_of(first), id(new), new.window_of(last))
        if span != self.span:  # a window to fetch ahead, or one to evict: not a wake a batch
            self.span = span
            self.wake.set()

    def wanted(self) -> list[str]:
        """The shards still to be read, in order of need: from the window of the oldest batch that
        may be in flight to the one after the newest sampled."""
        names = []
        for order in dict.fromkeys(order for order, _ in list(self.recent)):
            read = [position for o, position in list(self.recent) if o is order]
            first, last = order.window_of(min(read)), order.window_of(max(read)) + 1
            for w in range(first, min(last, len(order.windows) - 2) + 1):
                names += [self.split.entries[s]["name"] for s in order.window_shards(w)]
        return list(dict.fromkeys(names))

    def _run(self) -> None:
        try:
            while True:
                self.wake.wait()
                self.wake.clear()
                wanted = self.wanted()
                for path in self.shards.folder.iterdir() if wanted else ():  # none before training
                    if path.name not in {*wanted, *self.keep} and not path.name.startswith("."):
                        path.unlink(missing_ok=True)  # every batch that reads it is read
                for name in [*sorted(self.keep), *wanted]:
                    if (self.shards.folder / name).exists():
                        continue
                    if self.shards.cached_bytes() + self.shards.entries[name]["bytes"] > self.limit:
                        break  # until a window is read and evicted
                    with self.shards.locked():
                        if not (self.shards.folder / name).exists():
                            self.shards.fetch(name)
                    if self.wake.is_set():
                        break  # the sampler moved on: what is wanted now
        except StoreAway as error:  # the loop stops at the end of its step, with a checkpoint
            request_stop(f"an unreachable data store ({error})")
        except (ShardError, StoreError):
            pass  # a missing or damaged shard: the read that needs it says so


def streamed_splits(cfg: Config, index: dict, reader_for) -> tuple[ShardedSplit, ShardedSplit]:
    """The training and validation splits of the shards at cfg.data; reader_for(split) -> ShardReader."""
    shards = Shards(cfg.data, index, cfg)
    splits = index["splits"]
    train = ShardedSplit(
        shards, splits["train"], reader_for("train"), cfg.shuffle_window, cfg.max_train_examples
    )
    val = ShardedSplit(shards, splits["val"], reader_for("val"), cfg.shuffle_window)
    if shards.remote:
        limit = cache_bytes(cfg.cache_size)
        largest = max(entry["bytes"] for entry in train.entries)
        keep = {entry["name"] for entry in val.entries} | index["files"].keys()
        needs = 2 * cfg.shuffle_window * largest + sum(shards.entries[name]["bytes"] for name in keep)
        if needs > limit:
            raise ConfigError(
                f"--cache-size {cfg.cache_size} cannot hold two windows of --shuffle-window"
                f" {cfg.shuffle_window} shards and the validation shards ({size(needs)}): raise it,"
                " or lower --shuffle-window"
            )
        train.prefetch = Prefetch(train, limit, cfg.num_workers * 4, keep)  # 4: the loader's prefetch_factor
    return train, val
