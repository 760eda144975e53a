"""Machinery: a run folder on an object store: `--run-dir s3://bucket/prefix` (or gs://, file://).

The run trains in a local staging folder (in the cache, one per URL) as in a local --run-dir, and
the store holds the truth. Each checkpoint is uploaded in the background once written, with
run.json and metrics.jsonl whole (a store cannot append), and becomes visible only when its
manifest, every file's size and SHA-256, is written last (a store cannot rename). A start takes the
store's newest complete checkpoint, its digests verified, deletes what a cut-off upload left, and
takes the records from the store (the resume cuts metrics.jsonl back to the checkpoint's step). So
a run whose machine was lost with its disk resumes on another exactly where the store left off:

    pip install -e ".[s3]"  # or ".[gcs]"; credentials and endpoint from the store's usual environment
    python -m everything train --run-dir s3://bucket/runs/exp1

The final save, a stop signal and an error wait for the upload in flight. One machine writes a URL
at a time: the run folder's lock holds on the staging folder only.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import fsspec

from ..config import ConfigError
from .checkpoint import file_digest, step_name

PROJECT = "everything"
RECORDS = ("run.json", "metrics.jsonl")
BEST = "best.pt"
MANIFEST = re.compile(r"step-(\d+)\.json")


class StoreError(RuntimeError):
    """The store cannot be reached, read or written, or holds no usable checkpoint; names the URL."""


def is_url(path: str) -> bool:
    return "://" in str(path)


def cache_dir(url: str, kind: str) -> Path:
    """This machine's folder for a URL's files: "runs" stages a training run, "reads" holds the
    copies the read commands (report, export, ...) take."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / PROJECT / kind / hashlib.sha256(url.encode()).hexdigest()[:16]


def staging_dir(run_dir: str) -> Path:
    """Where --run-dir's run trains on this machine: the folder itself, or a URL's staging folder."""
    return cache_dir(run_dir.rstrip("/"), "runs") if is_url(run_dir) else Path(run_dir)


def open_run(run_dir: str, keep_last: int, local_rank: int) -> "LocalRun | RunStore":
    """--run-dir's run: a local folder as it is, or a URL staged here and pulled from its store."""
    if not is_url(run_dir):
        return LocalRun(Path(run_dir))
    raise ConfigError(f"--run-dir {run_dir}: a store URL is not supported under fsdp: give a local folder")


def fetch_run(run_dir: str) -> str:
    """A run to read: a local folder as it is, or a URL's run.json and metrics.jsonl copied here."""
    if not is_url(run_dir):
        return run_dir
    store = RunStore(run_dir)
    local = cache_dir(store.url, "reads")
    with store.reaching("read"):
        for name in RECORDS:
            store.fs.get_file(f"{store.root}/{name}", str(_fresh(local / name)))
    return str(local)


def fetch_checkpoint(path: str) -> str:
    """A checkpoint to read: a local file as it is, or `URL/checkpoints/NAME` (a step's or best.pt)
    from the newest complete checkpoint that holds it, its digest verified."""
    if not is_url(path):
        return path
    run_url, _, name = path.rpartition("/checkpoints/")
    store = RunStore(run_url)
    local = cache_dir(store.url, "reads") / "checkpoints"
    with store.reaching("read"):
        for _, manifest in reversed(store.manifests()):
            if name in manifest["files"]:
                store.download(manifest["files"][name], local / name)
                return str(local / name)
    raise StoreError(f"{path}: no complete checkpoint in {run_url} holds {name}")


class LocalRun:
    """A local --run-dir: trained in place, nothing to upload."""

    def __init__(self, path: Path) -> None:
        self.local = path

    def name(self, path: Path) -> str:
        return str(path)

    def push(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class RunStore:
    """A run on a store, staged in `local`; push() uploads a checkpoint in the background."""

    def __init__(self, url: str, keep_last: int = 1) -> None:
        self.url = url.rstrip("/")
        self.local = staging_dir(self.url)
        self.keep_last = keep_last
        with self.reaching("open"):
            options = {"auto_mkdir": True} if self.url.startswith("file://") else {}  # stores have none
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upload")
        self._pending: Future | None = None

    def name(self, path: Path) -> str:
        """A staged file's name on the store, for the records: the staging folder is this machine's."""
        return f"{self.url}/{path.relative_to(self.local).as_posix()}"

    @contextlib.contextmanager
    def reaching(self, what: str):
        """Any failure of the store's library (unreachable, refused, missing) as one StoreError."""
        try:
            yield
        except StoreError:
            raise
        except Exception as error:  # each store's library raises its own types
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise StoreError(f"cannot {what} {self.url}: {reason}") from None

    def pull(self) -> None:
        """Makes the staging folder the store's run at its newest complete checkpoint (or empty, for
        a new run), after deleting what a cut-off upload left in the store."""
        folder = self.local / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        with self.reaching("read"):
            self.fs.invalidate_cache()
            manifests = self.manifests()
        with self.reaching("write to"):
            self._remove_unlisted(manifests)
            probe = f"{self.root}/.write-test"
            self.fs.pipe_file(probe, b"ok")  # refused credentials fail here, before training
            self.fs.rm_file(probe)
        kept, problems = {}, []
        for _, manifest in reversed(manifests):
            try:
                files = manifest["files"].items()
                kept = {name: self.download(entry, folder / name) for name, entry in files}
                break
            except StoreError as error:
                problems.append(str(error))
                print(f"warning: {error}; trying the previous checkpoint", file=sys.stderr)
        if problems and not kept:
            raise StoreError(f"no usable checkpoint in {self.url}: {'; '.join(problems)}")
        for path in folder.iterdir():  # what this machine wrote past the store's checkpoint
            if path.name not in kept:
                path.unlink()
        for name in RECORDS:
            (self.local / name).unlink(missing_ok=True)
            if kept:
                with self.reaching("read"):
                    self.fs.get_file(f"{self.root}/{name}", str(self.local / name))

    def manifests(self) -> list[tuple[int, dict]]:
        """The complete checkpoints' manifests, oldest first."""
        try:
            paths = self.fs.ls(f"{self.root}/checkpoints", detail=False)
        except FileNotFoundError:
            return []
        steps = sorted((int(m.group(1)), p) for p in paths if (m := MANIFEST.fullmatch(p.rsplit("/", 1)[-1])))
        return [(step, json.loads(self.fs.cat_file(path))) for step, path in steps]

    def download(self, entry: dict, target: Path) -> Path:
        """The stored file of a manifest's `entry` as `target`, unless it is there already."""
        if target.is_file() and file_digest(target) == entry["sha256"]:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.download")
        with self.reaching("read"):
            self.fs.get_file(f"{self.root}/checkpoints/{entry['stored']}", str(tmp))
        if file_digest(tmp) != entry["sha256"]:
            tmp.unlink()
            raise StoreError(f"{self.url}/checkpoints/{entry['stored']} is damaged (not its digest)")
        os.replace(tmp, target)
        return target

    def push(self, step: int) -> None:
        """Uploads the checkpoint of `step`, just written, and the records in the background. The
        files are hard-linked aside first: the loop may replace best.pt or delete the step meanwhile."""
        self.wait()  # one upload at a time
        aside = self.local / ".upload"
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir()
        names = [name for name in (step_name(step), BEST) if (self.local / "checkpoints" / name).exists()]
        for name in names:
            try:
                os.link(self.local / "checkpoints" / name, aside / name)
            except OSError:  # a file system without hard links
                shutil.copyfile(self.local / "checkpoints" / name, aside / name)
        records = {name: (self.local / name).read_bytes() for name in RECORDS}
        self._pending = self._uploads.submit(self._upload, step, aside, names, records)

    def _upload(self, step: int, aside: Path, names: list[str], records: dict[str, bytes]) -> None:
        with self.reaching("upload to"):
            files = {}
            for name in names:
                digest = file_digest(aside / name)
                stored = f"best-{digest[:16]}.pt" if name == BEST else name  # best.pt is replaced
                target = f"{self.root}/checkpoints/{stored}"
                if name != BEST or not self.fs.exists(target):
                    self.fs.put_file(str(aside / name), target)
                files[name] = {"stored": stored, "size": (aside / name).stat().st_size, "sha256": digest}
            for name, data in records.items():  # before the manifest, so they reach its step
                self.fs.pipe_file(f"{self.root}/{name}", data)
            manifest = json.dumps({"step": step, "files": files}, indent=2).encode()
            self.fs.pipe_file(f"{self.root}/checkpoints/step-{step:08d}.json", manifest)  # now visible
            manifests = self.manifests()
            for old, _ in manifests[: -self.keep_last]:
                self.fs.rm_file(f"{self.root}/checkpoints/step-{old:08d}.json")  # before its files
            self._remove_unlisted(manifests[-self.keep_last :])
        shutil.rmtree(aside, ignore_errors=True)

    def _remove_unlisted(self, manifests: list[tuple[int, dict]]) -> None:
        """Deletes the stored checkpoint files no complete checkpoint lists: a cut-off upload's."""
        listed = {entry["stored"] for _, manifest in manifests for entry in manifest["files"].values()}
        listed |= {f"step-{step:08d}.json" for step, _ in manifests}
        with contextlib.suppress(FileNotFoundError):
            for path in self.fs.ls(f"{self.root}/checkpoints", detail=False):
                if path.rsplit("/", 1)[-1] not in listed:
                    self.fs.rm_file(path)

    def wait(self) -> None:
        """Until the upload in flight is done; its failure raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Waits for the upload in flight, then uploads the records as they end."""
        try:
            self.wait()
            with self.reaching("upload to"):
                for name in RECORDS:
                    if (self.local / name).exists():
                        self.fs.put_file(str(self.local / name), f"{self.root}/{name}")
        finally:
            self._uploads.shutdown()


def _fresh(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path
