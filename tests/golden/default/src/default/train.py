"""Yours to edit: the training loop, top to bottom: a run restored or started, the loaders, the
steps with their logging, validation and checkpoints, and the summary.

    python -m default train  # synthetic data, into runs/default
    python -m default train --data path/to/table.csv --run-dir runs/exp1

Run it again with the same --run-dir to resume from the newest valid checkpoint: the run continues
exactly as if it had never stopped. SIGTERM, Ctrl-C or SIGUSR1 stop it after the current step with
that step's checkpoint written, exit status 128 + the signal (143, 130, 138); see runtime/stopping.py.
"""

import math
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from .config import EVAL_EVERY_MAX, EVAL_EVERY_MIN, RESUME_FIXED, Config, ConfigError
from .data import Splits, load_splits
from .runtime.checkpoint import CheckpointDir, restore
from .runtime.distributed import (
    Dist,
    all_gather,
    all_reduce_sum,
    any_rank_max,
    broadcast_buffers,
    init_distributed,
    resharding,
)
from .runtime.engine import PRECISION, Engine, evaluate, setup, train_step
from .runtime.loader import EpochBatches, build_loaders, close
from .runtime.progress import Progress
from .runtime.records import RunRecordError, read_metrics, read_record
from .runtime.rng import rng_state, set_rng_state
from .runtime.rundir import open_run
from .runtime.runlog import RunLog, SilentRunLog, run_record
from .runtime.state import TrainState, micro_batches, waited
from .runtime.stopping import StopSignals


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss, say); the message says what to check."""


def validation_schedule(cfg: Config, sampler: EpochBatches) -> tuple[int, str]:
    """Steps between validations, and one line saying what was chosen and why.

    On a small data set an epoch is a few steps and the model can overfit long before a fixed
    eval_every comes round: with --eval-every 0 it validates every epoch (at most EVAL_EVERY_MAX
    steps apart), so early stopping and best.pt see the best point. Yet at least
    EVAL_EVERY_MIN steps apart: a 333-row table's epoch is one step, and validating every step
    would spend --patience on a few steps' noise and print a line a step. The schedule depends
    only on the data's size and settings fixed on resume, so a resumed run validates where the
    uninterrupted one did.
    """
    steps_per_epoch = max(1, sampler.batches_per_epoch() // cfg.grad_accum_steps)
    size = f"{sampler.n_examples:,} training examples make {steps_per_epoch:,} steps an epoch"
    if cfg.eval_every:
        every, why = cfg.eval_every, "as --eval-every asks"
    elif steps_per_epoch < EVAL_EVERY_MIN:
        every, why = EVAL_EVERY_MIN, f"at least {EVAL_EVERY_MIN} steps apart, as epochs are short"
    elif steps_per_epoch <= EVAL_EVERY_MAX:
        every, why = steps_per_epoch, "once an epoch"
    else:
        every, why = EVAL_EVERY_MAX, f"every {EVAL_EVERY_MAX} steps, as epochs are long"
    stop = f"early stop after {cfg.patience} without improvement" if cfg.patience else "no early stop"
    return every, f"plan: {size}: validating every {every} steps ({why}), {stop}, best.pt kept"


def check_resumable(checkpoint: dict, cfg: Config, splits: Splits) -> None:
    """Refuses a checkpoint of other settings: the run would not go on as it started."""
    saved = checkpoint["config"]
    changed = [
        f"{k} {saved.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in RESUME_FIXED
        if saved.get(k) != getattr(cfg, k)
    ]
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
    """Refuses a run folder whose checkpoints/ or step checkpoints were deleted: starting again at
    step 0 would overwrite its records. A start makes checkpoints/ before it writes run.json, so a
    run killed before its first checkpoint has the folder (empty) and starts again; a run whose
    records go past its first checkpoint's step (or that finished) had one."""
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
    reached = max((r["step"] for r in read_metrics(run_dir) if r["split"] == "train"), default=0)
    if record.get("finished") or reached > record["config"].get("ckpt_every", math.inf):
        raise ConfigError(
            f"{run_dir / 'checkpoints'} holds no step checkpoint, though the run in {run_dir} reached"
            f" step {reached} and saved them: it cannot resume: start over in a new --run-dir"
        )


def schedule_horizon(cfg: Config, step: int, planned: int) -> int:
    """The cosine decay's horizon for a run resumed at `step` that was planned for `planned` steps
    (see config.fixed): a raised --max-steps keeps the plan, a lowered one re-plans it, and one
    below `step` is refused."""
    if cfg.max_steps < step:
        raise ConfigError(
            f"{cfg.run_dir} is at step {step} (of {planned} planned), past --max-steps {cfg.max_steps}:"
            f" give --max-steps {step} or more, or start over in a new --run-dir"
        )
    return cfg.max_steps if step < cfg.max_steps < planned else planned


def restore_run(cfg, splits, engine, run, checkpoints, group: Dist, say) -> tuple[TrainState, dict | None]:
    """A fresh run's state, or the newest valid checkpoint's restored into `engine`; with it this
    rank's saved RNG streams (None for a fresh run, or a rank a reshard adds), to restore last."""
    latest = checkpoints.load_latest()
    record = run_record(cfg, splits.describe(), PRECISION)  # run.json, unless resuming
    if latest is None:
        run.start(record)
        return TrainState(schedule_steps=cfg.max_steps), None
    path, checkpoint = latest
    saved_world = len(checkpoint["rng"])
    note = resharding(saved_world, group.world_size, cfg)
    check_resumable(checkpoint, cfg, splits)
    state = TrainState(**checkpoint["state"])
    planned = state.schedule_steps or checkpoint["config"]["max_steps"]
    state.schedule_steps = schedule_horizon(cfg, state.step, planned)
    if note:
        state.reshard(saved_world, group.world_size)
        say(f"warning: {note}")
    restore(engine, path, checkpoint)
    if cfg.max_steps != planned:  # raised: min_lr past the planned horizon; lowered: re-planned
        engine.set_schedule(cfg, state.schedule_steps, state.step)
    if state.step < cfg.max_steps:
        run.resume(record, state.step, path, checkpoint)
        say(f"resuming from {path} at step {state.step}")
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
    return state, checkpoint["rng"][group.rank] if group.rank < saved_world else None


def payload(cfg: Config, engine: Engine, splits: Splits, state: TrainState, run) -> dict:
    """What a checkpoint holds: the engine's state, the loop's position, every rank's RNG streams."""
    broadcast_buffers(engine.model)  # one copy of the buffers is saved: rank 0's, on every rank
    return {
        **engine.state_dict(),
        "state": asdict(state),
        "rng": all_gather(rng_state()),  # every rank's streams, restored rank by rank
        "config": asdict(cfg),
        "data": splits.describe(),
    }


def examples_per_step(cfg: Config, group: Dist) -> int:
    return cfg.grad_accum_steps * cfg.batch_size * group.world_size


def log_train(run, progress, state, loss: float, lr: float, grad_norm: float) -> None:
    """A train record in metrics.jsonl and on the console; a NaN loss stops the run first."""
    if not math.isfinite(loss):  # before any checkpoint could hold the damage
        # recorded for diagnose, which reads the lr and grad norm before it
        run.log(step=state.step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
        raise TrainingError(
            f"loss is {loss} at step {state.step}: lower --lr, check the precision"
            " (fp16 overflows where bf16 does not), and inspect the data (inspect-data)"
        )
    run.log(step=state.step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
    progress.log(state.step, loss, lr, grad_norm)


def validate(cfg, engine, splits, device, state, val_loader, run, checkpoints, say, show: bool) -> bool:
    """A validation pass, recorded; best.pt saved when it improved. True: stop early.
    Its line is said when `show` or when it stops the run."""
    broadcast_buffers(engine.model)  # every rank evaluates rank 0's BatchNorm statistics
    metrics = evaluate(engine, val_loader, splits, device)
    run.log(step=state.step, split="val", **metrics)
    improved = metrics["loss"] < state.best_val_loss
    stop = False
    if improved:
        state.best_val_loss, state.best_step = metrics["loss"], state.step
        state.evals_since_best = 0
        checkpoints.save_best(payload(cfg, engine, splits, state, run))
    else:
        state.evals_since_best += 1
        stop = cfg.patience > 0 and state.evals_since_best >= cfg.patience
    if show or stop:
        values = "  ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        say(f"step {state.step}  val {values}" + ("  (best)" if improved else ""))
    if stop:
        say(f"early stop: no better validation in {cfg.patience} since step {state.best_step}")
    return stop


def run_steps(
    cfg, engine, splits, device, group, state, batches, val_loader, eval_every, run, checkpoints, signals,
    progress, say, waits,
) -> tuple[dict, "Path | None"]:  # fmt: skip
    """The steps from state.step to cfg.max_steps, or to an early or signalled stop: the summary,
    and the last checkpoint written."""
    engine.model.train()
    started, first_step, stop, signum, saved = time.perf_counter(), state.step, False, 0, None
    shown = -cfg.log_every  # the step of the last validation line printed
    while state.step < cfg.max_steps and not stop:
        step_started = time.perf_counter()
        lr = engine.scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(engine, batches, cfg, device)
        engine.scheduler.step()
        state.step += 1
        progress.update()
        signum = any_rank_max(signals.signum)  # every rank stops at the same step
        last = state.step == cfg.max_steps
        save = state.step % cfg.ckpt_every == 0 or last or signum
        if state.step % cfg.log_every == 0 or save:  # the loop's only host syncs
            loss = all_reduce_sum(loss) / group.world_size  # the mean over every rank's examples
            log_train(run, progress, state, loss.item(), lr, grad_norm.item())
        waits[1] += time.perf_counter() - step_started  # to the logging sync; not validation
        if state.step % eval_every == 0 or last:
            # Every validation is recorded; its line printed at most once in --log-every steps (an
            # --eval-every below it validates more often), and the last and an early stop always.
            show = last or state.step - shown >= cfg.log_every
            shown = state.step if show else shown
            stop = validate(cfg, engine, splits, device, state, val_loader, run, checkpoints, say, show)
        if save or stop:
            saved = checkpoints.save(payload(cfg, engine, splits, state, run), state.step)
            run.checkpointed(state.step)
        if signum:
            break
    seconds = time.perf_counter() - started
    examples = (state.step - first_step) * examples_per_step(cfg, group)
    return {
        "step": state.step,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "seconds": seconds,
        "examples_per_s": examples / seconds if seconds > 0 else math.nan,
        "data_wait_share": waits[0] / waits[1] if waits[1] > 0 else math.nan,  # of the steps' time
        "stopped_by": signal.Signals(signum).name if signum else None,
        "exit_status": 128 + signum if signum else 0,
    }, saved


def train(cfg: Config, quiet: bool = False) -> dict:
    """Trains (or resumes) the run in cfg.run_dir; returns where it ended and its best validation.

    A stop signal ends it early: the summary's "stopped_by" names the signal, "exit_status" is 128
    plus its number.
    """
    with StopSignals() as signals:
        device = setup(cfg)
        group = init_distributed(device.type)
        quiet = quiet or not group.is_main  # one rank speaks for all
        say = (lambda message: None) if quiet else tqdm.write  # tqdm.write prints above a progress bar
        splits = load_splits(cfg)
        engine = Engine(cfg, splits, device)
        store = open_run(cfg.run_dir, cfg.keep_last, group)  # a URL: staged here, pulled
        check_checkpoints_kept(store.local)
        run = RunLog(store) if group.is_main else SilentRunLog()  # rank 0 alone writes
        checkpoints = CheckpointDir(store.local / "checkpoints", cfg.keep_last, main=group.is_main)
        state, saved_rng = restore_run(cfg, splits, engine, run, checkpoints, group, say)
        if state.step >= cfg.max_steps:
            run.close()
            say(f"{cfg.run_dir} is complete at step {state.step}: raise --max-steps to train on")
            return {**asdict(state), "stopped_by": None, "exit_status": 0}
        n_params = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        say(f"model: {n_params:,} trainable parameters; device {device}, precision {PRECISION}")
        say(f"data: {splits.source}, {len(splits.train):,} train / {len(splits.val):,} val examples")
        if group.world_size > 1:
            say(f"ranks: {group.world_size}, {cfg.batch_size} examples each a micro-batch")
        train_loader, val_loader, sampler = build_loaders(splits, cfg, device, group)
        eval_every, plan = validation_schedule(cfg, sampler)
        say(plan)
        waits = [0.0, 0.0]  # seconds spent waiting for the next batch, and in training steps in all
        batches = waited(micro_batches(train_loader, sampler, state), waits)
        if saved_rng is not None:
            set_rng_state(saved_rng)  # last: nothing above may consume the restored streams
        progress = Progress(cfg.max_steps, state.step, examples_per_step(cfg, group), quiet)
        try:
            summary, saved = run_steps(
                cfg, engine, splits, device, group, state, batches, val_loader, eval_every, run,
                checkpoints, signals, progress, say, waits,
            )  # fmt: skip
            summary["best_checkpoint"] = store.name(checkpoints.path / "best.pt")
            run.finish(summary)
        finally:
            progress.close()
            run.close()
            # Loader workers ignore stop signals, so at exit they must be ended here, by their loaders.
            batches.close()
            close(train_loader)
            close(val_loader)
            del batches, train_loader, val_loader
    if summary["stopped_by"] and not quiet:
        saved = saved and store.name(saved)  # a URL's, not the staging folder's
        print(
            f"stopped at step {state.step} by {summary['stopped_by']}; checkpoint {saved};"
            " run the same command to resume",
            file=sys.stderr,
            flush=True,
        )
    elif not summary["stopped_by"]:
        best = summary["best_checkpoint"]
        say(f"best val loss {state.best_val_loss:.4f} at step {state.best_step}; checkpoint {best}")
    return summary
