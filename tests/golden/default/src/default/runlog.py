"""The run folder's records: run.json (what ran, where, with what) and metrics.jsonl.

metrics.jsonl holds one JSON object a line: `step`, `split` ("train" or "val") and `loss`; train
records add `lr` and `grad_norm`, validation records add `accuracy`. Floats are written in full.
"""

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .config import Config
from .stopping import RunLock

PROJECT = "default"


class RunDirError(RuntimeError):
    """The run folder cannot be written."""


class RunLog:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.run_json = run_dir / "run.json"
        self.metrics_path = run_dir / "metrics.jsonl"
        try:  # fail before training, not at the first checkpoint
            run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(run_dir)  # held until close(): one writer per run folder
            probe = run_dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as error:
            raise RunDirError(f"cannot write to run folder {run_dir}: {error.strerror}") from None
        self._metrics = None

    def start(self, cfg: Config, data: dict, precision: str) -> None:
        record = {
            "project": PROJECT,
            "config": asdict(cfg),
            "seed": cfg.seed,
            "precision": precision,
            "data": data,
            "git": git_state(),
            "versions": library_versions(),
            "command": sys.argv,
            "started": _now(),
            "resumed": [],
        }
        _write_json_atomically(self.run_json, record)
        self.metrics_path.unlink(missing_ok=True)
        self._open_metrics()

    def resume(self, step: int, checkpoint: Path) -> None:
        """Keeps the records up to `step` and notes the restart in run.json."""
        kept = []
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a crash
                    continue
                if record["step"] <= step:
                    kept.append(line + "\n")
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.metrics_path)
        if self.run_json.exists():
            record = json.loads(self.run_json.read_text())
            record["resumed"].append(
                {
                    "at_step": step,
                    "checkpoint": str(checkpoint),
                    "git": git_state(),
                    "command": sys.argv,
                    "time": _now(),
                }
            )
            _write_json_atomically(self.run_json, record)
        self._open_metrics()

    def log(self, **record) -> None:
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        except OSError as error:  # a full disk: stop with the checkpoints written so far intact
            raise RunDirError(f"cannot write {self.metrics_path}: {error.strerror}") from None

    def checkpointed(self, step: int) -> None:
        """Everything up to `step` is in a checkpoint: make its records durable too."""
        try:
            os.fsync(self._metrics.fileno())
        except OSError as error:
            raise RunDirError(f"cannot write {self.metrics_path}: {error.strerror}") from None

    def finish(self, summary: dict) -> None:
        """Records where this session of the run ended (or was stopped), and how fast it went."""
        record = json.loads(self.run_json.read_text())
        record["finished"] = {**summary, "time": _now()}
        _write_json_atomically(self.run_json, record)

    def close(self) -> None:
        """Closes the records and releases the run folder; call it last."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self.lock.release()

    def _open_metrics(self) -> None:
        self._metrics = self.metrics_path.open("a", encoding="utf-8")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def library_versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json_atomically(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
