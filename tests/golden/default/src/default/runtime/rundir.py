"""Machinery: --run-dir, a local folder or an object-store URL (store.py): opened for training, the
store's newest checkpoint pulled into the staging folder first, or fetched for the read commands."""

import sys
from pathlib import Path

from ..config import ConfigError
from .distributed import Dist
from .store import RECORDS, RunStore, StoreError, cache_dir, is_url, prune, top


class RunDirError(RuntimeError):
    """The run folder cannot be written, or there is no run to read."""


def open_run(run_dir: str, keep_last: int, group: Dist, retry_minutes: float) -> "LocalRun | RunStore":
    """--run-dir's run: a local folder as it is, or a URL staged here and pulled from its store."""
    if not is_url(run_dir):
        return LocalRun(Path(run_dir))
    store = RunStore(run_dir, keep_last, retry_minutes)
    stage_run(store, group)  # by the processes the distributed strategy names
    return store


def stage_run(store: RunStore, group: Dist) -> None:
    store.pull()


def newest_run() -> str:
    """The run a read command naming none reads: the one under runs/ whose run.json changed last."""
    runs = sorted(Path("runs").glob("*/run.json"), key=lambda path: path.stat().st_mtime)
    if not runs:
        command = f"python -m {__package__.rpartition('.')[0]} train"
        raise RunDirError(f"no run under runs/ to read: train one first ({command})")
    print(f"reading {runs[-1].parent} (the newest run under runs/)", file=sys.stderr)
    return str(runs[-1].parent)


def fetch_run(run_dir: str | None) -> str:
    """A run to read (None: the newest): a local folder as it is, or a URL's records copied here."""
    run_dir = run_dir or newest_run()
    if not is_url(run_dir):
        return run_dir
    store = RunStore(run_dir)
    local = cache_dir(store.url, "reads")
    local.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        (local / name).unlink(missing_ok=True)  # no earlier copy read if this one fails
        with store.reaching("read", f"{store.url}/{name}"):
            store.fs.get_file(f"{store.root}/{name}", str(local / name))
    return str(local)


def fetch_checkpoint(path: str | None) -> str:
    """A checkpoint to read (None: the newest run's best.pt): a local one as it is, or `URL/checkpoints/NAME`
    (a step's or best.pt) from the newest complete checkpoint that holds it, its digests verified."""
    path = path or f"{newest_run()}/checkpoints/best.pt"
    if not is_url(path):
        return path
    run_url, _, name = path.rstrip("/").rpartition("/checkpoints/")
    if not run_url:
        raise ConfigError(f"{path}: a checkpoint on a store is RUN_URL/checkpoints/NAME")
    store = RunStore(run_url)
    local = cache_dir(path.rstrip("/"), "reads") / "checkpoints"  # this checkpoint's alone
    with store.reaching("read"):
        for _, manifest in reversed(store.manifests()):
            if files := {file: entry for file, entry in manifest["files"].items() if top(file) == name}:
                store.download_all(files, local)
                prune(local, files)
                print(f"reading {path} (its copy here: {local / name})", file=sys.stderr)
                return str(local / name)
    raise StoreError(f"{path}: no complete checkpoint in {run_url} holds {name}")


class LocalRun:
    """A local --run-dir: trained in place, nothing to upload."""

    def __init__(self, path: Path) -> None:
        self.local = path
        self.lock = None  # RunLog takes the folder's

    def name(self, path: Path) -> str:
        return str(path)

    def push(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
