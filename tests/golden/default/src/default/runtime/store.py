"""Machinery: a run folder on an object store: `--run-dir s3://bucket/prefix` (or gs://, file://).

The run trains in a local staging folder (in the cache, one per URL); the store holds the truth.
Each checkpoint is uploaded in the background once written, with the records whole (a store cannot
append), and is visible only once its manifest (each file's size and SHA-256) is written last (a
store cannot rename). A start takes the store's newest complete checkpoint, digests verified, and its
records, after deleting what a cut-off upload left. So a run whose machine was lost resumes on another:

    pip install -e ".[s3]"  # or ".[gcs]"; credentials and endpoint from the store's usual environment
    python -m default train --run-dir s3://bucket/runs/exp1

The final save, a stop signal and an error wait for the upload in flight, retried as training goes on
while the store is away (--upload-retry-minutes at most). One machine writes a URL at a time: the run
folder's lock holds on the staging folder only.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import fsspec

from .checkpoint import file_digest, step_name
from .stopping import RunLock

PROJECT = "default"
RECORDS = ("run.json", "metrics.jsonl")
BEST = "best.pt"  # replaced in place, so stored under a name of its contents
MANIFEST = re.compile(r"step-(\d+)\.json")

# s3fs runs its requests on asyncio in a thread of its own: one cut off by a stop is logged there as
# "Task exception was never retrieved" with a traceback, after the run has said what happened
logging.getLogger("asyncio").setLevel(logging.CRITICAL)


class StoreError(RuntimeError):
    """The store cannot be reached, read or written, or holds no usable checkpoint; names the URL."""


def is_url(path: str) -> bool:
    """scheme://bucket/key (file:///folder) of a scheme fsspec knows; main() refuses what only looks so."""
    scheme, _, rest = str(path).partition("://")
    bucket = "/?[^/]" if scheme == "file" else "[^/]"  # file:///folder, file://folder: no bucket
    return scheme in fsspec.available_protocols() and re.match(bucket, rest) is not None


def cache_dir(url: str, kind: str) -> Path:
    """This machine's folder for a URL's files: "runs" stages a training run, "reads" the read commands'."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / PROJECT / kind / hashlib.sha256(url.encode()).hexdigest()[:16]


def staging_dir(run_dir: str) -> Path:
    """Where --run-dir's run trains on this machine: the folder itself, or a URL's staging folder."""
    return cache_dir(run_dir.rstrip("/"), "runs") if is_url(run_dir) else Path(run_dir)


class RunStore:
    """A run on a store, staged in `local`; push() uploads a checkpoint in the background."""

    def __init__(self, url: str, keep_last: int = 1, retry_minutes: float = 0) -> None:
        self.url = url.rstrip("/")
        self.local = staging_dir(self.url)
        self.keep_last = keep_last
        with self.reaching("open"):
            options = {"auto_mkdir": True} if self.url.startswith("file://") else {}  # stores have none
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upload")
        self._pending: Future | None = None
        self._newest: int | None = 0  # the newest checkpoint pushed: one older gives way (None: all do)
        self._wake = threading.Event()  # a push: cuts a wait between tries short
        self.retry_s, self._away = retry_minutes * 60, None  # since when the store has been away, if it is
        self.lock: RunLock | None = None  # taken by pull(), on the staging folder

    def name(self, path: Path) -> str:
        """A staged file's name on the store, for the records: the staging folder is this machine's."""
        return f"{self.url}/{path.relative_to(self.local).as_posix()}"

    @contextlib.contextmanager
    def reaching(self, what: str, url: str = ""):
        """Any failure of the store's library (unreachable, refused, missing) as a StoreError naming `url`."""
        try:
            yield
        except StoreError:
            raise
        except Exception as error:  # each store's library raises its own types
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise StoreError(f"cannot {what} {url or self.url}: {reason}") from None

    def pull(self) -> None:
        """Stages the store's run at its newest complete checkpoint (none: empty), cut-off uploads deleted."""
        folder = self.local / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        # Before anything here changes: another start of this URL on this machine would delete
        # the checkpoint a running one has written and not yet uploaded. RunLog holds it on.
        self.lock = RunLock(self.local, name=f"{self.url} (staged in {self.local})")
        kept, problems = {}, []
        with self.reaching("read"):
            self.fs.invalidate_cache()
            manifests = self.manifests(problems)
        with self.reaching("write to"):
            probe = f"{self.root}/.write-test"
            self.fs.pipe_file(probe, b"ok")  # refused credentials fail here, before training
            self.fs.rm_file(probe)
        for at in reversed(range(len(manifests))):
            steps = {path: entry for path, entry in manifests[at][1]["files"].items() if top(path) != BEST}
            try:
                self.download_all(steps, folder, mend=True)
            except StoreError as error:
                problems.append(str(error))
                print(f"warning: {error}; trying the previous checkpoint", file=sys.stderr)
                continue
            kept = manifests[at][1]["files"]
            try:  # lost, it loses the best model alone: resume.py says so, or makes it again
                self.download_all({path: kept[path] for path in kept.keys() - steps.keys()}, folder, True)
            except StoreError as error:
                kept = steps
                print(f"warning: {error}", file=sys.stderr)
            with self.reaching("write to"):  # what a cut-off upload or pruning left
                self._remove_unlisted(manifests[max(0, at + 1 - self.keep_last) :])
            break
        if problems and not kept:
            raise StoreError(f"no usable checkpoint in {self.url}: {'; '.join(problems)}")
        prune(folder, kept)  # what this machine wrote past it (a new run: all of it)
        for name in RECORDS:
            (self.local / name).unlink(missing_ok=True)
            with self.reaching("read", f"{self.url}/{name}"), contextlib.suppress(FileNotFoundError):
                if kept:  # missing: RunLog says so
                    self.fs.get_file(f"{self.root}/{name}", str(self.local / name))

    def manifests(self, problems: list[str] | None = None) -> list[tuple[int, dict]]:
        """The complete checkpoints' manifests, oldest first; an unreadable one is said (and added to
        `problems`) and skipped."""
        try:
            paths = self.fs.ls(f"{self.root}/checkpoints", detail=False)
        except FileNotFoundError:
            return []
        found, problems = [], [] if problems is None else problems
        names = {int(m[1]): m[0] for path in paths if (m := MANIFEST.fullmatch(path.rpartition("/")[2]))}
        for step, name in sorted(names.items()):
            try:
                manifest = json.loads(self.fs.cat_file(f"{self.root}/checkpoints/{name}"))
                if not all({"stored", "size", "sha256"} <= e.keys() for e in manifest["files"].values()):
                    raise KeyError("a file's stored, size or sha256")
                found.append((step, manifest))
            except (ValueError, LookupError, TypeError, AttributeError) as error:  # torn, emptied, edited
                problems.append(f"{self.url}/checkpoints/{name} is unreadable ({error!r})")
                print(f"warning: {problems[-1]}; skipped", file=sys.stderr)
        return found

    def download_all(self, files: dict, folder: Path, mend: bool = False) -> None:
        """A manifest's `files` into `folder`, one there with its digest kept (with `mend`, uploaded
        again where the store lost or damaged it: not its size)."""
        for path, entry in files.items():
            target, url = folder / path, f"{self.url}/checkpoints/{entry['stored']}"
            stored = f"{self.root}/checkpoints/{entry['stored']}"
            if target.is_file() and file_digest(target) == entry["sha256"]:
                with self.reaching("upload to", url):
                    if mend and (not self.fs.exists(stored) or self.fs.size(stored) != entry["size"]):
                        self.fs.put_file(str(target), stored)
                        print(f"warning: {url} was lost or damaged: uploaded again", file=sys.stderr)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.download")
            with self.reaching("read", url):
                self.fs.get_file(stored, str(tmp))
            if file_digest(tmp) != entry["sha256"]:
                tmp.unlink()
                raise StoreError(f"{url} is damaged (not its digest)")
            os.replace(tmp, target)

    def push(self, step: int) -> None:
        """Uploads the checkpoint of `step`, just written, and the records in the background. The
        files are hard-linked aside first: the loop may replace best.pt or delete the step meanwhile."""
        while self._pending is not None and not self._pending.done():  # one upload at a time...
            if self._away is not None and time.monotonic() - self._away < self.retry_s:
                break  # ...but while the store is away, training goes on; away too long, the run stops here
            wait([self._pending], timeout=1)
        self._newest = step
        if self._pending is None or self._pending.done():
            self.wait()  # an upload given up stops the run here
            shutil.rmtree(self.local / ".upload", ignore_errors=True)  # none in flight: a killed run's
        self._wake.set()  # one retrying gives way to this one
        aside = self.local / ".upload" / str(step)
        checkpoints = self.local / "checkpoints"
        paths = [path for name in (step_name(step), BEST) for path in _files(checkpoints, name)]
        for path in paths:
            (aside / path).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(checkpoints / path, aside / path)
            except OSError:  # a file system without hard links
                shutil.copyfile(checkpoints / path, aside / path)
        records = {name: (self.local / name).read_bytes() for name in RECORDS}
        self._pending = self._uploads.submit(self._retried, step, aside, paths, records)

    def _retried(self, step: int, aside: Path, paths: list[str], records: dict[str, bytes]) -> None:
        """_upload(), retried while the store is away (1 s apart, doubling to 30 s) for retry_s at most."""
        while step == self._newest:
            try:
                self._upload(step, aside, paths, records)
                self._away = None
                return
            except StoreError as error:
                if self._away is None:
                    self._away = time.monotonic()
                    print(f"warning: {error}; retrying for {self.retry_s:.0f} s", file=sys.stderr)
                away = time.monotonic() - self._away
                if away >= self.retry_s:
                    lost = f"retried for {away:.0f} s; not stored from step {step} on"
                    raise StoreError(f"{error}; {lost}: run the same command once it is back") from None
                self._wake.wait(min(max(away, 1), 30, self.retry_s - away))
                self._wake.clear()  # after the wait: a push since is seen by the test above
        shutil.rmtree(aside, ignore_errors=True)  # a newer checkpoint took over, or a stop signal ended it
        if self._newest is None:
            print(f"warning: step {step} is not on {self.url}: its upload was cut short", file=sys.stderr)

    def _upload(self, step: int, aside: Path, paths: list[str], records: dict[str, bytes]) -> None:
        with self.reaching("upload to"):
            sizes = {path: (aside / path).stat().st_size for path in paths}
            files = {path: {"size": sizes[path], "sha256": file_digest(aside / path)} for path in paths}
            best = {path: entry["sha256"] for path, entry in files.items() if top(path) == BEST}
            contents = hashlib.sha256(json.dumps(best, sort_keys=True).encode()).hexdigest()[:16]
            for path, entry in files.items():
                is_best = path in best
                entry["stored"] = f"best-{contents}{path.removeprefix('best')}" if is_best else path
                target = f"{self.root}/checkpoints/{entry['stored']}"
                if not is_best or not self.fs.exists(target):  # an unchanged best is there already
                    self.fs.put_file(str(aside / path), target)
            for name, data in records.items():  # before the manifest, so they reach its step
                self.fs.pipe_file(f"{self.root}/{name}", data)
            manifest = json.dumps({"step": step, "files": files}, indent=2).encode()
            self.fs.pipe_file(f"{self.root}/checkpoints/step-{step:08d}.json", manifest)  # now visible
            self._remove_unlisted(self.manifests()[-self.keep_last :])
        shutil.rmtree(aside, ignore_errors=True)

    def _remove_unlisted(self, manifests: list[tuple[int, dict]]) -> None:
        """Deletes stored files no manifest in `manifests` lists (a stored name is one checkpoint's):
        older checkpoints, a cut-off upload's; manifests first, so none is left without its files."""
        listed = {top(entry["stored"]) for _, manifest in manifests for entry in manifest["files"].values()}
        listed |= {f"step-{step:08d}.json" for step, _ in manifests}
        with contextlib.suppress(FileNotFoundError):
            paths = self.fs.ls(f"{self.root}/checkpoints", detail=False)
            for path in sorted(paths, key=lambda path: not path.endswith(".json")):
                if path.rstrip("/").rsplit("/", 1)[-1] not in listed:
                    self.fs.rm(path, recursive=True)

    def wait(self) -> None:
        """Until the upload in flight is done; its failure raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Waits for the upload in flight (a stop signal ends that), then uploads the records as they end."""
        try:
            self.wait()
            if self._away is None:  # the store answered last: nothing given up
                with self.reaching("upload to"):
                    for name in RECORDS:
                        if (self.local / name).exists():
                            self.fs.put_file(str(self.local / name), f"{self.root}/{name}")
        except KeyboardInterrupt:
            self._newest = None  # the upload retrying gives way, saying so
            self._wake.set()
            raise
        finally:
            self._uploads.shutdown()


def top(path: str) -> str:
    """The checkpoint a file's path belongs to: its first part (`step-00000010.pt`, `best`)."""
    return path.split("/", 1)[0]


def _files(folder: Path, name: str) -> list[str]:
    """The paths in `folder` of checkpoint `name`'s files: itself, or those in it; none if absent."""
    if (folder / name).is_file():
        return [name]
    found = (folder / name).rglob("*")
    return sorted(path.relative_to(folder).as_posix() for path in found if path.is_file())


def prune(folder: Path, keep) -> None:
    """Deletes what `folder` holds beyond the files `keep` names by their paths in it."""
    for path in sorted(folder.rglob("*"), reverse=True):  # a folder's contents before the folder
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.relative_to(folder).as_posix() not in keep:
            path.unlink()
