"""Machinery: the run folder's records: run.json (what ran, where, with what) and metrics.jsonl, which
also go to MLflow (tracking.py).

metrics.jsonl holds one JSON object a line (floats in full): `step`, `split` ("train" or "val") and
`loss`; train records add `lr` and `grad_norm`, validation records add those of model.Metrics."""

import contextlib
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..config import Config
from .records import RunRecordError, parse_metrics, read_record
from .rundir import LocalRun, RunDirError
from .stopping import RunLock
from .store import PROJECT, RunStore
from .tracking import Tracker


class RunLog:
    def __init__(self, store: LocalRun | RunStore) -> None:
        self.store = store  # where a checkpoint and the records go once written: nowhere, or a URL
        self.dir = run_dir = store.local
        self.run_json = run_dir / "run.json"
        self.metrics_path = run_dir / "metrics.jsonl"
        self._metrics = None
        self.record: dict = {}  # run.json's, kept here and written whole on every change
        self.tracker: Tracker | None = None
        self.sent_through = 0  # records up to this step are the tracker's already
        checkpoints = run_dir / "checkpoints"
        if checkpoints.exists() and not checkpoints.is_dir():  # checked before anything is made
            raise RunDirError(f"{checkpoints} is a file, where the checkpoints go: move it away")
        self._made: Path | None = None  # a failed start removes what it made: the outermost folder
        self._had: set[str] | None = None  # or else the names the run folder held before: all kept
        try:  # fail before training, not at the first checkpoint
            self._made = make_folders(run_dir)
            self._had = set(os.listdir(run_dir))
            self.lock = store.lock or RunLock(run_dir)  # held until close(): one writer per run folder
            checkpoints.mkdir(exist_ok=True)
            probe = checkpoints / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as error:
            self._remove_made()
            if isinstance(error, FileExistsError):  # a file where a folder of the path goes
                raise RunDirError(f"--run-dir {run_dir}: {error.filename} is a file: name a folder") from None
            raise RunDirError(f"cannot write to run folder {run_dir}: {error.strerror}") from None

    def start(self, record: dict) -> None:
        """A new run: run.json written, metrics.jsonl started afresh, and a tracker run (one that a
        start killed before its first checkpoint left open is closed, or continued, see tracking.py)."""
        try:  # a start killed before its first checkpoint leaves its tracker run behind
            earlier = read_record(self.dir).get("tracker")
        except RunRecordError:
            earlier = None
        self.record = record
        try:
            write_json_atomically(self.run_json, record)
            self._open_metrics("w")  # afresh
            self.tracker = Tracker(self.dir, record, resume=None, earlier=earlier)
            self._tracked(0)
        except RunDirError:  # a full disk, say: the run never started, and leaves nothing behind
            self.abandon()
            raise

    def resume(self, record: dict, path: Path, checkpoint: dict) -> None:
        """Keeps the records up to the step of `checkpoint` (read from `path`) and notes the restart
        in run.json; a damaged run.json is rebuilt from `record` (this command's), with a warning.
        The tracker gets the records the stopped process never sent it: those after its last
        flush (run.json's "tracker") up to the checkpoint."""
        step = checkpoint["state"]["step"]
        kept = self._keep_metrics(step)
        try:
            self.record = read_record(self.dir)
        except RunRecordError as error:
            print(f"warning: {error}: rebuilt from this command's settings", file=sys.stderr)
            self.record = {**record, "rebuilt_at_step": step}
        restart = {"at_step": step, "checkpoint": self.store.name(path), "git": git_state()}
        restart |= {"command": sys.argv, "source_digest": source_digest()}  # the code that runs from here
        self.record.setdefault("resumed", []).append({**restart, "time": now_utc()})
        write_json_atomically(self.run_json, self.record)
        self._open_metrics()
        # Without a record of the tracker's last flush, take it that it had everything checkpointed.
        flushed = self.record.get("tracker", {}).get("logged_through", step)
        since = min(flushed, step)
        self.tracker = Tracker(self.dir, self.record, resume={"step": since, "state": checkpoint["tracker"]})
        for kept_record in kept:
            if kept_record["step"] > since:
                self.tracker.log(kept_record)
        self.tracker.checkpointed(step)
        # Steps past the checkpoint that the tracker already holds (when an older checkpoint was
        # resumed) are the same values again, as the resume is exact: not sent twice.
        self.sent_through = step if Tracker.PURGES else max(flushed, step)
        self._tracked(step)

    def _keep_metrics(self, step: int) -> list[dict]:
        """Rewrites metrics.jsonl with its records up to `step`, warning of damaged lines; returns them."""
        try:
            data = self.metrics_path.read_bytes()
        except FileNotFoundError:
            lost = f"the records up to step {step} are lost"
            print(f"warning: {self.store.name(self.metrics_path)} is missing: {lost}", file=sys.stderr)
            data = b""
        except OSError as error:
            raise RunDirError(f"cannot read {self.metrics_path}: {error.strerror}") from None
        kept = [r for r in parse_metrics(data, self.metrics_path, "dropped") if r["step"] <= step]
        _write_atomically(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def log(self, **record) -> None:
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        except OSError as error:  # a full disk: stop with the checkpoints written so far intact
            raise RunDirError(f"cannot write {self.metrics_path}: {error.strerror}") from None
        if record["step"] > self.sent_through:
            self.tracker.log(record)

    def checkpointed(self, step: int) -> None:
        """Everything up to `step` is in a checkpoint: make its records durable too."""
        try:
            os.fsync(self._metrics.fileno())
        except OSError as error:
            raise RunDirError(f"cannot write {self.metrics_path}: {error.strerror}") from None
        self.store.push(step)  # in the background: the loop goes on
        self.tracker.checkpointed(step)
        self._tracked(step)

    def tracker_state(self) -> dict:
        return self.tracker.state()

    def _tracked(self, step: int) -> None:
        """Notes in run.json that the tracker holds every record up to `step`: a resume sends it
        the ones after that."""
        self.record["tracker"] = {**self.tracker.state(), "logged_through": step}
        write_json_atomically(self.run_json, self.record)

    def finish(self, summary: dict) -> None:
        """Records where this session of the run ended (or was stopped), and how fast it went."""
        self.record["finished"] = {**summary, "time": now_utc()}
        write_json_atomically(self.run_json, self.record)

    def close(self) -> None:
        """Closes the records, waits for the store's uploads and releases the run folder; call it last."""
        self._close_records()
        try:
            self.store.close()
        finally:
            self.lock.release()

    def abandon(self) -> None:
        """Ends a failed start: records closed, what it made removed while the folder is locked, unlocked."""
        self._close_records()
        self._remove_made()
        self.lock.release()

    def _remove_made(self) -> None:
        with contextlib.suppress(OSError):  # what cannot be removed (a read-only disk) was not made
            if self._made is not None:
                shutil.rmtree(self._made)
            elif self._had is not None:
                for path in (self.dir / name for name in set(os.listdir(self.dir)) - self._had):
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()

    def _close_records(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def _open_metrics(self, mode: str = "a") -> None:
        try:
            self._metrics = self.metrics_path.open(mode, encoding="utf-8")
        except OSError as error:
            raise RunDirError(f"cannot write {self.metrics_path}: {error.strerror}") from None


def run_record(cfg: Config, data: dict, precision: str) -> dict:
    """run.json for a run started by this command."""
    return {
        "project": PROJECT,
        "config": asdict(cfg),
        "seed": cfg.seed,
        "precision": precision,
        "data": data,
        "git": git_state(),
        "source_digest": source_digest(),  # the code that ran, committed or not (report matches checks by it)
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "platform": platform.platform(),
        },
        "command": sys.argv,
        "started": now_utc(),
        "resumed": [],
    }


def git_state() -> dict:
    """The commit of this project's source, and whether it had uncommitted changes."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


@functools.cache
def source_files() -> dict[str, str]:
    """Each Python file of the package and its digest, as this process first read them (at its start)."""
    root = Path(__file__).resolve().parent.parent
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.py")}


def source_digest() -> str:
    """One digest of source_files(), edits included: `report` matches a run's to its checks'."""
    return hashlib.sha256(json.dumps(source_files(), sort_keys=True).encode()).hexdigest()[:16]


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def make_folders(path: Path) -> Path | None:
    """Makes the folder `path` and its missing parents; returns the outermost one it made."""
    made = None
    for folder in [*reversed(path.parents), path]:
        if not folder.is_dir():
            folder.mkdir()  # FileExistsError where a file is
            made = made or folder
    return made


def write_json_atomically(path: Path, record: dict) -> None:
    _write_atomically(path, json.dumps(record, indent=2) + "\n")


def _write_atomically(path: Path, text: str) -> None:
    """Writes `path` whole or not at all (a full disk leaves the previous version and says so in a line)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise RunDirError(f"cannot write {path}: {error.strerror}") from None
