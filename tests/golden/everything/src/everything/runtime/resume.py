"""Machinery: a fresh start or the newest valid checkpoint restored, the settings a resume may not
change, the decay's horizon when --max-steps moved, and what a checkpoint holds (with every RNG's
state, so a resumed run draws the dropout masks a run that never stopped would, and code digests)."""

import math
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..config import RESUME_FIXED, Config, ConfigError
from ..data import Splits
from .checkpoint import CheckpointError, remove, restore, verify
from .distributed import all_gather, broadcast_buffers, resharding
from .engine import PRECISION
from .records import RunRecordError, read_metrics, read_record
from .runlog import run_record, source_files
from .state import Loop, TrainState
from .weights import init_weights


def restore_run(loop: Loop) -> dict | None:
    """Sets loop.state to a fresh run's or the newest valid checkpoint's (into loop.engine); returns
    this rank's saved RNG streams for the caller to restore last (None: a fresh run, or a new rank)."""
    cfg, group, say = loop.cfg, loop.group, loop.say
    code = source_files()  # the code this process runs, read as it starts (not an edit made later)
    latest = loop.checkpoints.load_latest()
    record = run_record(cfg, loop.splits.describe(), PRECISION)  # run.json, unless resuming
    if latest is None:
        run_dir = loop.checkpoints.path.parent
        if (run_dir / "run.json").exists():  # a start stopped before its first checkpoint
            say(
                f"starting over at step 0: {cfg.run_dir} holds no step checkpoint (its run stopped at step"
                f" {reached_step(run_dir)}, before its first): its run.json and metrics.jsonl are replaced"
            )
        if cfg.init_from:  # a fresh start only: a resume's weights are its checkpoint's
            record["init_from"] = init_weights(loop.engine.model, cfg.init_from, say)
        loop.run.start(record)
        loop.state = TrainState(schedule_steps=cfg.max_steps, world_size=group.world_size)
        return None
    path, checkpoint = latest
    saved_world = len(checkpoint["rng"])
    accumulation = share_of_step(checkpoint, cfg, group.world_size)
    check_resumable(checkpoint, cfg, loop.splits)
    cfg.grad_accum_steps = accumulation  # this run's: saved so in its checkpoints' config
    note = resharding(saved_world, group.world_size, cfg)
    state = loop.state = TrainState(**checkpoint["state"])
    planned = state.schedule_steps or checkpoint["config"]["max_steps"]
    if cfg.max_steps < state.step:
        raise ConfigError(
            f"{cfg.run_dir} is at step {state.step} (of {planned} planned), past --max-steps"
            f" {cfg.max_steps}: give --max-steps {state.step} or more, or start over in a new --run-dir"
        )
    # the cosine decay's horizon: a raised --max-steps keeps the plan, a lowered one re-plans it
    state.schedule_steps = cfg.max_steps if state.step < cfg.max_steps < planned else planned
    if note:
        state.reshard(saved_world, group.world_size)
        say(f"warning: {note}")
    restore(loop.engine, path, checkpoint)
    check_best(loop, checkpoint)
    if cfg.max_steps != planned:  # raised: min_lr past the planned horizon; lowered: re-planned
        loop.engine.set_schedule(cfg, state.schedule_steps, state.step)
    if state.step < cfg.max_steps:
        loop.run.resume(record, path, checkpoint)
        say(f"resuming from {path} at step {state.step}")
        saved = checkpoint.get("code", code)  # older checkpoints hold no digests
        if edited := sorted(name for name in code.keys() | saved.keys() if code.get(name) != saved.get(name)):
            say(f"the code changed since this checkpoint was written: {', '.join(edited)}")
    if state.schedule_steps < planned:
        say(
            f"schedule: --max-steps {cfg.max_steps} re-plans the cosine decay to end there,"
            f" not at step {planned}"
        )
    elif cfg.max_steps > planned:
        say(
            f"schedule: the cosine decay keeps its plan of {planned} steps; steps past it train at"
            f" --min-lr {cfg.min_lr:g} (a longer decay wants a new --run-dir)"
        )
    return checkpoint["rng"][group.rank] if group.rank < saved_world else None


def share_of_step(checkpoint: dict, cfg: Config, world_size: int) -> int:
    """This process's micro-batches a step. A run keeps the global batch it started with (its
    processes x --grad-accum-steps micro-batches of --batch-size) at any number of processes, so
    each step trains on the very examples it would have. The checkpoint's config gets back the
    --grad-accum-steps of the start, which a resume repeats (check_resumable compares them)."""
    config, saved_world = checkpoint["config"], len(checkpoint["rng"])
    started = checkpoint["state"].setdefault("world_size", saved_world)  # older checkpoints: as saved
    micro_batches = config["grad_accum_steps"] * saved_world  # a step's, over every process
    config["grad_accum_steps"] = micro_batches // started
    if micro_batches % world_size:
        raise ConfigError(
            f"{cfg.run_dir} trains on {micro_batches} micro-batches of {cfg.batch_size} a step, which"
            f" {world_size} processes cannot share: resume it on a number that divides {micro_batches}"
        )
    return micro_batches // world_size


def check_best(loop: Loop, checkpoint: dict) -> None:
    """A best missing or damaged at a resume, said: made again from `checkpoint` if that is the best."""
    state, best, problem = loop.state, loop.checkpoints.best, None
    if loop.group.is_main and state.best_step:  # 0: no validation yet, so no best
        try:
            verify(best)
        except CheckpointError as error:
            problem = str(error).replace(str(best), loop.run.store.name(best))  # a store's: its URL
    if problem := all_gather(problem)[0]:  # rank 0's verdict, on every rank
        remade = state.best_step == state.step  # the best was saved from this very state
        if remade:
            loop.checkpoints.save_best({**loop.engine.state_dict(), **checkpoint})
        elif loop.group.is_main and best.exists():
            remove(best)
        what = "made again from its step's checkpoint" if remade else "lost until a better validation"
        loop.say(f"warning: {problem}: the best model (step {state.best_step}) is {what}")


def payload(loop: Loop) -> dict:
    """What a checkpoint holds: the engine's state, the loop's position, every rank's RNG streams."""
    broadcast_buffers(loop.engine.model)  # one copy of the buffers is saved: rank 0's, on every rank
    return {
        **loop.engine.state_dict(),
        "state": asdict(loop.state),
        "rng": all_gather(rng_state()),  # every rank's streams, restored rank by rank
        "config": asdict(loop.cfg),
        "data": loop.splits.describe(),
        "code": source_files(),  # as the run started: a resume names the files edited since
        "tracker": loop.run.tracker_state(),  # resumes the same tracker run
    }


def rng_state() -> dict:
    _, key, pos, has_gauss, gauss = np.random.get_state()  # NumPy's MT19937, its key saved as a tensor
    mt = {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    return {
        "python": random.getstate(),
        "numpy": mt,
        "torch": torch.get_rng_state(),
        # This process's own GPU only: get_rng_state_all() would start a context on every visible
        # GPU, and could not be restored where their number differs. None with --device cpu.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    mt = state["numpy"]
    np.random.set_state(
        ("MT19937", mt["key"].numpy().astype(np.uint32), mt["pos"], mt["has_gauss"], mt["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])  # the current device: set from LOCAL_RANK


def check_resumable(checkpoint: dict, cfg: Config, splits: Splits) -> None:
    """Refuses a checkpoint of other settings: the run would not go on as it started."""
    saved, now = checkpoint["config"], asdict(cfg)
    changed = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in RESUME_FIXED if saved.get(k) != now[k]]
    data = checkpoint["data"]  # a list or dict (an encoding) is too long to show
    changed += [
        f"data {k} " + ("changed" if isinstance(v, list | dict) else f"{data.get(k)!r} -> {v!r}")
        for k, v in splits.describe().items()
        if data.get(k) != v
    ]
    if changed:
        raise ConfigError(
            f"{cfg.run_dir} holds a run with other settings ({'; '.join(changed)}): "
            "resume with its settings, or start a new --run-dir"
        )


def check_checkpoints_kept(run_dir: Path) -> None:
    """Refuses a run folder whose checkpoints were deleted: a start at step 0 would overwrite its
    records. One killed before its first checkpoint has an empty checkpoints/ and starts over."""
    if not (run_dir / "run.json").exists():
        return
    if not (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"{run_dir / 'checkpoints'} is missing, so the run in {run_dir} cannot resume:"
            " start over in a new --run-dir"
        )
    if any((run_dir / "checkpoints").glob("step-*")) or not (run_dir / "metrics.jsonl").exists():
        return
    try:
        record = read_record(run_dir)
    except RunRecordError:
        return  # rebuilt on resume, with a warning
    reached = reached_step(run_dir)
    if record.get("finished") or reached > record["config"].get("ckpt_every", math.inf):
        raise ConfigError(
            f"{run_dir / 'checkpoints'} holds no step checkpoint, though the run in {run_dir} reached"
            f" step {reached} and saved them: it cannot resume: start over in a new --run-dir"
        )


def reached_step(run_dir: Path) -> int:
    """The last step metrics.jsonl records training, 0 where it has none."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return max((r["step"] for r in records if r["split"] == "train"), default=0)
