"""Machinery: --run-dir, a local folder or an object-store URL (store.py): opened for training, the
store's newest checkpoint pulled into the staging folder first, or fetched for the read commands.
"""

from pathlib import Path

from .distributed import Dist, stage_run
from .store import RECORDS, RunStore, StoreError, cache_dir, is_url, top


def open_run(run_dir: str, keep_last: int, group: Dist) -> "LocalRun | RunStore":
    """--run-dir's run: a local folder as it is, or a URL staged here and pulled from its store."""
    if not is_url(run_dir):
        return LocalRun(Path(run_dir))
    store = RunStore(run_dir, keep_last)
    stage_run(store, group)  # by the processes the distributed strategy names
    return store


def fetch_run(run_dir: str) -> str:
    """A run to read: a local folder as it is, or a URL's run.json and metrics.jsonl copied here."""
    if not is_url(run_dir):
        return run_dir
    store = RunStore(run_dir)
    local = cache_dir(store.url, "reads")
    local.mkdir(parents=True, exist_ok=True)
    with store.reaching("read"):
        for name in RECORDS:
            (local / name).unlink(missing_ok=True)  # no earlier copy read if this one fails
            store.fs.get_file(f"{store.root}/{name}", str(local / name))
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

    def close(self) -> None:
        pass
