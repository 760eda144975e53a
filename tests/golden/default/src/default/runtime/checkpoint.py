"""Machinery: checkpoints that resume a run exactly, written so that a crash never corrupts one.

Each holds the model (unwrapped), optimizer, scheduler, training position, RNG states,
config and early-stopping state: tensors and plain values only, so `torch.load(weights_only=True)`
runs no pickled code. Written to a temporary file, fsynced and renamed, none is ever half written;
a SHA-256 digest checked on load reports a flipped bit and falls back, as for a truncated file."""

import contextlib
import hashlib
import os
import re
from pathlib import Path

import torch

from ..config import ConfigError

STEP_NAME = re.compile(r"step-(\d+)\.pt")
REQUIRED_KEYS = {"model", "optimizer", "scheduler", "state", "rng", "config", "data"}


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message names the files."""


class CheckpointDir:
    """`step-<n>.pt` every ckpt_every steps (the newest keep_last kept) and `best.pt`."""

    def __init__(self, path: Path, keep_last: int, main: bool = True) -> None:
        """`main=False` (the other ranks of a multi-process run): reads checkpoints, saves nothing."""
        self.path = path
        self.best = path / "best.pt"
        self.keep_last = keep_last
        self.main = main
        try:
            if main:
                self.path.mkdir(parents=True, exist_ok=True)
                for stale in self.path.glob(".*.tmp"):  # what a crash in the middle of a save left
                    stale.unlink()
        except OSError as error:
            raise CheckpointError(f"cannot write checkpoints in {self.path}: {error.strerror}") from None

    def step_files(self) -> list[Path]:
        """Step checkpoints, oldest first."""
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := STEP_NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, payload: dict, step: int) -> Path:
        target = self.path / step_name(step)
        if not self.main:
            return target
        _atomic_save({**payload, "digest": digest(payload)}, target)
        for old in self.step_files()[: -self.keep_last]:  # only once the new one is safely written
            try:
                remove(old)
            except OSError as error:
                raise CheckpointError(f"cannot delete old checkpoint {old}: {error.strerror}") from None
        return target

    def save_best(self, payload: dict) -> Path:
        if self.main:
            _atomic_save({**payload, "digest": digest(payload)}, self.best)
        return self.best

    def load_latest(self) -> tuple[Path, dict] | None:
        """The newest readable step checkpoint; an unreadable newer one is reported and skipped."""
        files = self.step_files() if self.path.is_dir() else []
        if not files:
            return None
        problems = []
        for path in reversed(files):
            try:
                return path, load(path)
            except CheckpointError as error:
                problems.append(str(error))
                print(f"warning: {error}; trying the previous checkpoint")
        raise CheckpointError(
            f"no usable checkpoint in {self.path}: {'; '.join(problems)}. Move them aside to start afresh."
        )


def step_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def remove(path: Path) -> None:
    path.unlink()


def restore(engine, path: Path, checkpoint: dict) -> None:
    """The model, optimizer and scheduler of `checkpoint` (read from `path`) into `engine`;
    one that does not fit the model (an edit changed its layers or shapes) is refused in one line."""
    check_fits(path, shapes(checkpoint["model"]), shapes(engine.state_dict()["model"]))
    try:
        engine.load_state_dict(checkpoint)
    except (RuntimeError, KeyError, ValueError) as error:  # load_state_dict's: a heading, a line a mismatch
        first = "; ".join([line.strip() for line in str(error).splitlines() if line.strip()][1:3])
        raise CheckpointError(
            f"checkpoint {path} does not load into this model ({first or error}): resume with the model"
            " it was trained with, or start a new --run-dir"
        ) from None


def export(checkpoint: Path, out: Path) -> Path:
    """The model's weights of a checkpoint, alone, as one plain state_dict file: elsewhere,
    `model.load_state_dict(torch.load(out, weights_only=True))`."""
    _atomic_save(load(checkpoint)["model"], out)
    return out


def load(path: Path) -> dict:
    if not Path(path).is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, zero bytes, garbage: torch raises several types
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__})") from None
    if not isinstance(payload, dict) or not payload.keys() >= REQUIRED_KEYS:
        raise CheckpointError(f"checkpoint {path} is not a checkpoint of this project")
    if "digest" not in payload:  # written by this project before its checkpoints carried one
        print(f"warning: checkpoint {path} has no digest (an older version wrote it): loaded unverified")
        return payload
    if payload.pop("digest") != digest(payload):
        raise CheckpointError(f"checkpoint {path} is damaged (its contents do not match its digest)")
    return payload


verify = load  # reads it whole: its digest covers every tensor


def check_fits(path: Path, saved: dict, current: dict) -> None:
    """Refuses a checkpoint whose model's tensors (name: shape) an edit changed, naming the first."""
    if differ := [name for name in {**current, **saved} if saved.get(name) != current.get(name)]:
        shown = ", ".join(f"{n} {saved.get(n, 'absent')} -> {current.get(n, 'absent')}" for n in differ[:3])
        raise ConfigError(
            f"{path} holds a model with other shapes ({shown}; {len(differ)} tensors differ): resume"
            " with the model it was trained with, or start a new --run-dir"
        )


def shapes(tensors: dict) -> dict[str, tuple]:
    return {name: tuple(t.shape) for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def digest(payload: dict) -> str:
    """SHA-256 of every tensor's dtype, shape and bytes and of every other value, in order."""
    sha = hashlib.sha256()

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            sha.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
            sha.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            sha.update(b"{")
            for key, item in value.items():
                feed(key)
                feed(item)
            sha.update(b"}")
        elif isinstance(value, list | tuple):
            sha.update(b"[")
            for item in value:
                feed(item)
            sha.update(b"]")
        else:
            sha.update(f"{type(value).__name__} {value!r};".encode())

    feed(payload)
    return sha.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read a megabyte at a time."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _atomic_save(payload: dict, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # makes the rename itself durable
        finally:
            os.close(directory)
    except BaseException as error:  # the previous checkpoint stays; the temporary file goes
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(error.__context__, KeyboardInterrupt):  # torch's writer fails after an abort
            raise error.__context__ from None
        if isinstance(error, OSError | RuntimeError):  # RuntimeError: torch's zip writer's, on a failed write
            cause = error if isinstance(error, OSError) else error.__context__
            reason = cause.strerror if isinstance(cause, OSError) else str(error).splitlines()[0]
            raise CheckpointError(f"cannot write checkpoint {target}: {reason}") from None
        raise
