"""Machinery: the cache of a streamed data set's shards (shards.py): a folder's read in place, a URL's
fetched, verified and renamed in, retried while the store is away; its errors, which a loader
worker raises and the main process reads alike."""

import contextlib
import fcntl
import hashlib
import os
import re
import sys
import threading
import time
from pathlib import Path

import fsspec

from ..config import Config, ConfigError
from .checkpoint import file_digest
from .store import StoreError, cache_dir, is_url

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class WorkerSafe:
    """An error raised in a loader worker reaches the main process with the worker's traceback in
    its message: only its own last line is kept, so that it is still one line."""

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__}"):
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


class ShardError(WorkerSafe, ConfigError):
    """A missing index or shard, or a damaged one: one line, exit 2."""


class StoreAway(WorkerSafe, StoreError):
    """The store stayed unreachable past --fetch-retry-minutes: one line, exit 1."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def url_to_fs(url: str, **options):
    with reaching(url):
        return fsspec.core.url_to_fs(url, **options)


@contextlib.contextmanager
def reaching(url: str):
    """A store library's failure (each raises its own types) as a StoreError naming `url`."""
    try:
        yield
    except (ShardError, StoreError, FileNotFoundError):
        raise
    except Exception as error:
        raise StoreError(f"cannot reach {url}: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def size(n: int) -> str:
    """Bytes as --cache-size takes them: 22.1KB, 1.5GB."""
    unit = next((unit for unit in "TGMK" if n >= UNITS[unit]), "")
    return f"{n / UNITS[unit]:,.1f}{unit}B" if unit else f"{n}B"


def cache_bytes(text: str) -> int:
    """--cache-size ("20GB", "500MB", "1.5T") in bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"--cache-size {text!r}: give a size such as 20GB or 500MB")
    return int(float(match[1]) * UNITS[match[2].upper()])


class Shards:
    """Where one source's shards are read: a folder's in place; a URL's through the local cache,
    fetched (retried while the store is away), verified and renamed in."""

    def __init__(self, source: str, index: dict, cfg: Config) -> None:
        self.source = source.rstrip("/")
        self.remote = is_url(self.source)
        self.folder = cache_dir(self.source, "shards") if self.remote else Path(self.source)
        self.entries = {e["name"]: e for s in index["splits"].values() for e in s} | index["files"]
        self.retry_s = cfg.fetch_retry_minutes * 60
        self.peak = 0  # the most bytes the cache held, measured after each fetch
        self.fetching = 0.0  # seconds this process spent fetching (the loader check compares it)
        self.away: float | None = None  # since when the store has not answered, if it has not
        self.pid = self.lock = self.store = None  # this process's: see here()
        if self.remote:
            self.folder.mkdir(parents=True, exist_ok=True)
            for part in self.folder.glob(".*.download"):  # .NAME.PID-THREAD.download: a killed fetch's
                if not _alive(int(part.name.rsplit(".", 2)[1].split("-")[0])):
                    part.unlink(missing_ok=True)
            for refused in self.folder.glob(".*.refused"):  # an earlier run's: the store may hold it mended
                refused.unlink(missing_ok=True)
        self.here()  # before the prefetch thread starts: the two share this process's lock

    def __getstate__(self) -> dict:  # for spawned loader workers: a lock does not pickle
        return self.__dict__ | {"pid": None, "lock": None, "store": None}

    def here(self) -> None:
        """This process's own lock and store connection: a forked loader worker inherits its
        parent's, the lock maybe held by the prefetch, the connection not fork-safe."""
        if self.pid != os.getpid():
            self.pid, self.lock = os.getpid(), threading.Lock()
            self.store = url_to_fs(self.source, skip_instance_cache=True) if self.remote else None

    def get(self, name: str, local: Path) -> None:
        fs, root = self.store
        fs.get_file(f"{root}/{name}", str(local))

    @contextlib.contextmanager
    def locked(self):
        """One fetch at a time into the cache: of this process's threads (the prefetch, a read), and
        of every process on this machine (loader workers, other ranks) by a POSIX lock, which a fork
        does not inherit. Whoever comes second for a shard finds it there."""
        self.here()
        with self.lock, (self.folder / ".lock").open("a") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)  # released as the file closes
            yield

    def cached_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.folder.iterdir()) if self.remote else 0

    def path(self, name: str) -> Path:
        """The local file of shard `name`, fetched first if a URL's and not in the cache."""
        path = self.folder / name
        if self.remote and not path.exists():
            with self.locked():
                if (refused := self.folder / f".{name}.refused").exists():  # by this run, in any process
                    raise ShardError(refused.read_text())
                if not path.exists():  # fetched by the prefetch meanwhile
                    self.fetch(name)
        return path

    def fetch(self, name: str) -> None:
        """Fetches `name` into the cache, its digest checked: a mismatch is fetched again once."""
        entry, url = self.entries[name], f"{self.source}/{name}"
        part = self.folder / f".{name}.{os.getpid()}-{threading.get_ident()}.download"
        for attempt in (1, 2):
            started = time.perf_counter()
            self.retried(url, lambda: self.get(name, part))
            self.fetching += time.perf_counter() - started
            found = file_digest(part)
            if found == entry["sha256"]:
                self.peak = max(self.peak, self.cached_bytes())  # the download counted
                os.replace(part, self.folder / name)
                return
            part.unlink()
            if attempt == 1:
                print(f"warning: {url} does not match its digest: fetching it again", file=sys.stderr)
        digests = f"its SHA-256 is {found[:12]}..., the index says {entry['sha256'][:12]}..."
        refused = f"{url} is damaged (fetched twice): {digests}"
        (self.folder / f".{name}.refused").write_text(refused)
        raise ShardError(refused)

    def retried(self, url: str, action) -> None:
        """`action`, retried while the store is away (1 s apart, doubling to 30 s) for --fetch-retry-minutes
        from when it went away: a read that comes to it later waits out what is left, no more."""
        wait = 1.0
        while True:
            try:
                with reaching(url):
                    action()
                if self.away is not None:
                    away, self.away = time.monotonic() - self.away, None
                    print(f"the data store is back after {away:.0f} s", file=sys.stderr)
                return
            except FileNotFoundError:
                raise ShardError(f"{url} is missing: the index names it (prepare the data again)") from None
            except StoreError as error:
                if self.away is None:
                    self.away = time.monotonic()
                    print(f"warning: {error}; retrying for {self.retry_s:.0f} s", file=sys.stderr)
                away = time.monotonic() - self.away
                if away >= self.retry_s:
                    raise StoreAway(f"{error}; retried for {away:.0f} s") from None
                time.sleep(min(wait, self.retry_s - away))
                wait = min(2 * wait, 30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True
