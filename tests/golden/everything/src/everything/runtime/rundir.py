"""Machinery: --run-dir, a local folder or an object-store URL (store.py): opened for training, the
store's newest checkpoint pulled into the staging folder first, or fetched for the read commands.

Every rank writes its shards into the staging folder, and rank 0 alone pulls and uploads, so all
ranks must see one folder: on several machines, set XDG_CACHE_HOME to a folder they all share.
"""

import secrets
from pathlib import Path

from ..config import ConfigError
from .distributed import Dist, all_gather, barrier
from .store import RECORDS, RunStore, StoreError, cache_dir, fresh, is_url, top


def open_run(run_dir: str, keep_last: int, group: Dist) -> "LocalRun | RunStore":
    """--run-dir's run: a local folder as it is, or a URL staged here and pulled from its store."""
    if not is_url(run_dir):
        return LocalRun(Path(run_dir))
    store = RunStore(run_dir, keep_last)
    check_shared(store.local, group, run_dir)
    if group.is_main:  # one staging folder for all ranks
        store.pull()
    barrier()  # the other processes read the checkpoint it pulled
    return store


def check_shared(folder: Path, group: Dist, run_dir: str) -> None:
    """Refuses a staging folder that not every rank sees: rank 0 writes a random token there, and
    every rank must read it back."""
    marker = folder / ".shared-by-ranks"
    token = secrets.token_hex(16)
    if group.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    token = all_gather(token)[0]  # rank 0's, written before it joined
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    if not all(all_gather(seen)):
        raise ConfigError(
            f"--run-dir {run_dir}: not every rank sees the staging folder {folder}: set"
            " XDG_CACHE_HOME to a folder all machines share, or give a shared local --run-dir"
        )
    if group.is_main:
        marker.unlink()


def fetch_run(run_dir: str) -> str:
    """A run to read: a local folder as it is, or a URL's run.json and metrics.jsonl copied here."""
    if not is_url(run_dir):
        return run_dir
    store = RunStore(run_dir)
    local = cache_dir(store.url, "reads")
    with store.reaching("read"):
        for name in RECORDS:
            store.fs.get_file(f"{store.root}/{name}", str(fresh(local / name)))
    return str(local)


def fetch_checkpoint(path: str) -> str:
    """A checkpoint to read: a local one as it is, or `URL/checkpoints/NAME` (a step's or best)
    from the newest complete checkpoint that holds it, its digests verified."""
    if not is_url(path):
        return path
    run_url, _, name = path.rstrip("/").rpartition("/checkpoints/")
    store = RunStore(run_url)
    local = cache_dir(path.rstrip("/"), "reads") / "checkpoints"  # this checkpoint's alone
    with store.reaching("read"):
        for _, manifest in reversed(store.manifests()):
            files = {file: entry for file, entry in manifest["files"].items() if top(file) == name}
            if files:
                store.download_all(files, local)
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

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
