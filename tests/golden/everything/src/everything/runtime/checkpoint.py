"""Machinery: sharded checkpoints that resume a run exactly, written so that a crash never corrupts one.

Each checkpoint is a folder: the model's and optimizer's shards, written by every rank at once
with Distributed Checkpoint (torch.distributed.checkpoint), and `state.pt`, written by rank 0
last: the scheduler,
gradient scaler,
the training position, every rank's RNG state, the config and the early-stopping state,
and the SHA-256 digest of each shard file. The folder is written under a temporary name and renamed
once complete, so a reader sees the old checkpoint or the new one, never half of one; a damaged
shard or state.pt is reported and the previous checkpoint used. The shards are keyed by parameter
name, not by rank: a checkpoint written by N processes loads under any other number (resharded),
or whole on one process (`export`, `sample`, `predict`). Everything loads with `weights_only=True`.
"""

import contextlib
import hashlib
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import ConfigError
from .distributed import all_gather, barrier

STEP_NAME = re.compile(r"step-(\d+)")
STATE_FILE = "state.pt"  # everything but the shards, written last
SHARDED = ("model", "optimizer", "ema")  # what Distributed Checkpoint writes in shards (ema: --ema's average)
REQUIRED_KEYS = {"scheduler", "state", "rng", "config", "data", "files"}


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message names the files."""


class CheckpointDir:
    """`step-<n>/` every ckpt_every steps (the newest keep_last kept) and `best/`, each a folder of
    shards. Every rank writes its shards; rank 0 (`main`) also prepares the folder, writes
    state.pt, renames and deletes."""

    def __init__(self, path: Path, keep_last: int, main: bool = True) -> None:
        self.path = path
        self.best = path / "best"
        self.keep_last = keep_last
        self.main = main
        if main:
            self._prepare()
        barrier()  # no rank reads the folder before rank 0 has tidied it

    def _prepare(self) -> None:
        """Makes the folder and removes what a crash in the middle of a save left; a best/ that
        was being replaced is put back."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            old_best = self.path / ".best.old.tmp"
            if old_best.is_dir() and not self.best.exists():
                os.replace(old_best, self.best)
            for stale in self.path.glob(".*.tmp"):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        except OSError as error:
            raise CheckpointError(f"cannot write checkpoints in {self.path}: {error.strerror}") from None

    def step_files(self) -> list[Path]:
        """Step checkpoints, oldest first."""
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := STEP_NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, payload: dict, step: int) -> Path:
        target = self.path / step_name(step)
        _save_sharded(payload, target, self.main)
        if self.main:
            for old in self.step_files()[: -self.keep_last]:  # only once the new one is complete
                try:
                    remove(old)
                except OSError as error:
                    raise CheckpointError(f"cannot delete old checkpoint {old}: {error.strerror}") from None
        return target

    def save_best(self, payload: dict) -> Path:
        _save_sharded(payload, self.best, self.main)
        return self.best

    def load_latest(self) -> tuple[Path, dict] | None:
        """The newest intact step checkpoint and its state.pt; a damaged newer one is reported and
        skipped. Every rank verifies its share of the files, and all agree on the result. Its
        shards load with load_shards, once the run's settings are known to match."""
        files = self.step_files() if self.path.is_dir() else []
        if not files:
            return None
        rank, world_size = dist.get_rank(), dist.get_world_size()
        problems = []
        for path in reversed(files):
            try:
                state = _read_state(path)
                _verify(path, state["files"], share=slice(rank, None, world_size))
                problem = None
            except CheckpointError as error:
                problem = str(error)
            found = [p for p in all_gather(problem) if p]
            if found:
                problems.append(found[0])
                if rank == 0:
                    print(f"warning: {found[0]}; trying the previous checkpoint")
                continue
            return path, state
        raise CheckpointError(
            f"no usable checkpoint in {self.path}: {'; '.join(problems)}. Move them aside to start afresh."
        )


def step_name(step: int) -> str:
    return f"step-{step:08d}"  # a folder of shards


def remove(path: Path) -> None:
    shutil.rmtree(path)


def restore(engine, path: Path, checkpoint: dict) -> None:
    """The model's and optimizer's shards of the checkpoint at `path`, resharded to however many
    processes load them, and the rest of `checkpoint` (its state.pt), into `engine`; one that does
    not fit the model (an edit changed its layers or shapes) is refused in one line."""
    into = engine.state_dict()
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata  # every tensor's whole shape
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    check_fits(path, saved, shapes(into["model"]))  # DTensors: their shapes are the whole tensors'
    engine.load_state_dict(checkpoint | load_shards(path, into))


def load_shards(path: Path, into: dict) -> dict:
    """The model's and optimizer's shards of a checkpoint, loaded in place into `into` (this
    rank's, from Engine.state_dict()): resharded to however many processes load them."""
    shards = {name: into[name] for name in SHARDED}
    # A --freeze parameter has no optimizer state before the unfreeze step (AdamW starts it at its
    # first gradient): where the checkpoint holds none, it gets none here either.
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    moments = shards["optimizer"]["state"]
    for name in [name for name in moments if f"optimizer.state.{name}.step" not in saved]:
        del moments[name]
    try:
        dcp.load(shards, checkpoint_id=path)
    except Exception as error:  # DCP raises CheckpointException for any rank's failure
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint {path} does not load into this model: {reason}") from None
    return shards


def load(path: Path) -> dict:
    """A checkpoint's contents on this one process, verified: the model's weights whole (as a
    plain model's state_dict()), the optimizer's tensors by their flat names, and state.pt's."""
    state = verify(path)
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=path, no_dist=True)
    except Exception as error:  # a file changed under us, say: DCP raises several types
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__})") from None
    model = {key.removeprefix("model."): t for key, t in tensors.items() if key.startswith("model.")}
    optimizer = {key: t for key, t in tensors.items() if key.startswith("optimizer.")}
    ema = {key.removeprefix("ema."): t for key, t in tensors.items() if key.startswith("ema.")}
    return {**state, "model": model, "optimizer": optimizer, "ema": ema}


def verify(path: Path) -> dict:
    """The state.pt of the checkpoint folder at `path`, each of its files checked against its digest."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a checkpoint folder of this project")
    state = _read_state(path)
    _verify(path, state["files"], share=slice(None))
    return state


def _read_state(path: Path) -> dict:
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}") from None
    except Exception as error:  # truncated, zero bytes, garbage: torch raises several types
        reason = type(error).__name__
        raise CheckpointError(f"checkpoint {path} has an unreadable {STATE_FILE} ({reason})") from None
    if not isinstance(state, dict) or not state.keys() >= REQUIRED_KEYS | {"digest"}:
        raise CheckpointError(f"checkpoint {path} is not a checkpoint of this project")
    if state.pop("digest") != digest(state):
        raise CheckpointError(f"checkpoint {path} is damaged ({STATE_FILE} does not match its digest)")
    return state


def _verify(path: Path, files: dict, share: slice) -> None:
    """Checks the files in `share` of the sorted names against their digests in state.pt."""
    present = {p.name for p in path.iterdir()} - {STATE_FILE}
    if present != files.keys():
        raise CheckpointError(f"checkpoint {path} has other files than it was written with")
    for name in sorted(files)[share]:
        if file_digest(path / name) != files[name]:
            raise CheckpointError(f"checkpoint {path} is damaged ({name} does not match its digest)")


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


def _save_sharded(payload: dict, target: Path, main: bool) -> None:
    """Every rank writes its shards into a temporary folder; once all have, rank 0 writes
    state.pt (with each shard file's digest, each rank hashing its share) and renames the folder
    into place. A failure on any rank leaves the previous checkpoint as it was."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        dcp.save({name: payload[name] for name in SHARDED}, checkpoint_id=tmp)  # fsyncs its files
        names = sorted(p.name for p in tmp.iterdir())
        mine = {name: file_digest(tmp / name) for name in names[rank::world_size]}
        files = {name: d for share in all_gather(mine) for name, d in share.items()}
        if main:
            state = {k: v for k, v in payload.items() if k not in SHARDED} | {"files": files}
            _write_file({**state, "digest": digest(state)}, tmp / STATE_FILE)
            _fsync(tmp)
            old = target.with_name(f".{target.name}.old.tmp")
            if target.exists():  # best/, replaced: _prepare puts it back after a crash in between
                os.replace(target, old)
            os.replace(tmp, target)
            _fsync(target.parent)  # makes the rename itself durable
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as error:  # the previous checkpoint stays; the temporary folder goes
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if (cause := _failed_write(error)) is not None:
            raise CheckpointError(f"cannot write checkpoint {target}: {cause.strerror}") from None
        if isinstance(error, dcp.api.CheckpointException):  # a rank's write failed: every rank raises
            raise CheckpointError(f"cannot write checkpoint {target}: {_first_failure(error)}") from None
        raise
    barrier()  # every rank goes on with the checkpoint in place


def _first_failure(error: dcp.api.CheckpointException) -> str:
    """The lowest failed rank's reason, from the exceptions DCP gathered from every rank (its own
    message lists them as tracebacks): "rank 1: No space left on device"."""
    rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
    while not isinstance(cause, OSError) and cause.__context__ is not None:
        cause = cause.__context__  # torch.save's writer turns a failed write into its own error
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause).splitlines()[0]
    return f"rank {rank}: {reason or type(cause).__name__}"


def export(checkpoint: Path, out: Path) -> Path:
    """The model's weights of a checkpoint folder, whole, as one plain state_dict file: on one
    process, `model.load_state_dict(torch.load(out, weights_only=True))`; with --ema, the averaged
    weights."""
    state = load(checkpoint)
    model = state["model"] | state["ema"]  # the average's parameters (--ema), the model's buffers
    _write_file(model, out)
    save_safetensors(model, out.with_suffix(".safetensors"))  # what --init-from reads, and other tools
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], target: Path) -> None:
    """`tensors` as a .safetensors file (for `train --init-from` and other tools), written under a
    temporary name and renamed. Safetensors refuses tensors that share memory (tied weights, as a
    language model's embedding and output layer, or views of one fused tensor): each tensor of a
    storage already written gets its own copy."""
    seen, own = set(), {}
    for name, t in tensors.items():
        storage = t.untyped_storage().data_ptr()
        own[name] = t.clone(memory_format=torch.contiguous_format) if storage in seen else t.contiguous()
        seen.add(storage)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        save_file(own, tmp)
        os.replace(tmp, target)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {target}: {error.strerror}") from None


def _fsync(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _write_file(payload: dict, target: Path) -> None:
    """torch.save to a temporary file, fsynced, then renamed over `target`."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if (cause := _failed_write(error)) is not None:
            raise CheckpointError(f"cannot write {target}: {cause.strerror}") from None
        raise


def _failed_write(error: BaseException | None) -> OSError | None:
    """The system's error behind a failed write (a full disk): `error`, or the one it was raised
    in place of (torch's zip writer's "[enforce fail at inline_container.cc] unexpected pos",
    _write_file's CheckpointError)."""
    while error is not None and not isinstance(error, OSError):
        error = error.__context__
    return error
