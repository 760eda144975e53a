"""Yours to edit: the training loop, top to bottom, with validation and checkpoints.

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
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from .config import EVAL_EVERY_MAX, RESUME_FIXED, Config, ConfigError
from .data import Splits, load_splits
from .runtime.checkpoint import CheckpointDir, rng_state, set_rng_state
from .runtime.engine import PRECISION, Engine, evaluate, setup, train_step
from .runtime.loader import EpochBatches, build_loaders, close
from .runtime.runlog import RunLog, run_record
from .runtime.stopping import StopSignals


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss, say); the message says what to check."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    best_val_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for early stopping
    schedule_steps: int = 0  # the cosine decay's horizon: --max-steps when the run started


def micro_batches(loader, sampler: EpochBatches, state: TrainState):
    """Training batches without end; keeps state.epoch and state.batch_in_epoch current."""
    while True:
        sampler.set_epoch(state.epoch, start=state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def waited(batches, waits: list[float]):
    """Passes batches through, adding the seconds each took to arrive to waits[0]; closing it
    closes `batches` (and so ends the loader's workers)."""
    try:
        while True:
            start = time.perf_counter()
            batch = next(batches)
            waits[0] += time.perf_counter() - start
            yield batch
    finally:
        batches.close()


def validation_schedule(cfg: Config, sampler: EpochBatches) -> tuple[int, str]:
    """Steps between validations, and one line saying what was chosen and why.

    On a small data set an epoch is a few steps and the model can overfit long before a fixed
    eval_every comes round: with --eval-every 0 it validates every epoch (at most EVAL_EVERY_MAX
    steps apart), so early stopping and best.pt see the best point.
    """
    steps_per_epoch = max(1, sampler.batches_per_epoch() // cfg.grad_accum_steps)
    size = f"{sampler.n_examples:,} training examples make {steps_per_epoch:,} steps an epoch"
    if cfg.eval_every:
        every, why = cfg.eval_every, "as --eval-every asks"
    elif steps_per_epoch <= EVAL_EVERY_MAX:
        every, why = steps_per_epoch, "once an epoch"
    else:
        every, why = EVAL_EVERY_MAX, f"every {EVAL_EVERY_MAX} steps, as epochs are long"
    stop = f"early stop after {cfg.patience} without improvement" if cfg.patience else "no early stop"
    return every, f"plan: {size}: validating every {every} steps ({why}), {stop}, best.pt kept"


def check_resumable(checkpoint: dict, cfg: Config, splits: Splits) -> None:
    saved = checkpoint["config"]
    changed = [
        f"{k} {saved.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in RESUME_FIXED
        if saved.get(k) != getattr(cfg, k)
    ]
    changed += [
        f"data {k} {checkpoint['data'].get(k)!r} -> {v!r}"
        for k, v in splits.describe().items()
        if checkpoint["data"].get(k) != v
    ]
    if changed:
        raise ConfigError(
            f"{cfg.run_dir} holds a run with other settings ({'; '.join(changed)}): "
            "resume with its settings, or start a new --run-dir"
        )


def train(cfg: Config, quiet: bool = False) -> dict:
    """Trains (or resumes) the run in cfg.run_dir; returns where it ended and its best validation.

    A stop signal ends it early: the summary's "stopped_by" names the signal, "exit_status" is 128
    plus its number.
    """
    with StopSignals() as signals:
        return _train(cfg, quiet, signals)


def _train(cfg: Config, quiet: bool, signals: StopSignals) -> dict:
    device = setup(cfg)
    splits = load_splits(cfg)
    engine = Engine(cfg, splits, device)
    state = TrainState()
    run = RunLog(Path(cfg.run_dir))
    checkpoints = CheckpointDir(run.dir / "checkpoints", cfg.keep_last)
    say = (lambda message: None) if quiet else tqdm.write  # tqdm.write prints above a progress bar
    latest = checkpoints.load_latest()
    record = run_record(cfg, splits.describe(), PRECISION)  # run.json, unless resuming
    if latest is None:
        run.start(record)
        state.schedule_steps = cfg.max_steps
    else:
        path, checkpoint = latest
        check_resumable(checkpoint, cfg, splits)
        state = TrainState(**checkpoint["state"])
        state.schedule_steps = state.schedule_steps or checkpoint["config"]["max_steps"]
        if state.schedule_steps != cfg.max_steps:  # a raised --max-steps: past the horizon, min_lr
            engine.keep_schedule(cfg, state.schedule_steps)
        engine.load_state_dict(checkpoint)
        if state.step >= cfg.max_steps:
            run.close()
            say(f"{cfg.run_dir} is complete at step {state.step}: raise --max-steps to train on")
            return {**asdict(state), "stopped_by": None, "exit_status": 0}
        run.resume(record, state.step, path, checkpoint)
        say(f"resuming from {path} at step {state.step}")
    n_params = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    say(f"model: {n_params:,} trainable parameters; device {device}, precision {PRECISION}")
    say(f"data: {splits.source}, {len(splits.train):,} train / {len(splits.val):,} val examples")
    train_loader, val_loader, sampler = build_loaders(splits, cfg, device)
    eval_every, plan = validation_schedule(cfg, sampler)
    say(plan)
    waits = [0.0, 0.0]  # seconds spent waiting for the next batch, and in training steps in all
    batches = waited(micro_batches(train_loader, sampler, state), waits)
    if latest is not None:
        set_rng_state(checkpoint["rng"])  # last: nothing above may consume the restored streams

    def payload() -> dict:
        return {
            **engine.state_dict(),
            "state": asdict(state),
            "rng": rng_state(),
            "config": asdict(cfg),
            "data": splits.describe(),
        }

    engine.model.train()
    examples_per_step = cfg.grad_accum_steps * cfg.batch_size
    progress = Progress(cfg.max_steps, state.step, examples_per_step, quiet)
    started, first_step, stop, signum = time.perf_counter(), state.step, False, 0
    try:
        while state.step < cfg.max_steps and not stop:
            step_started = time.perf_counter()
            lr = engine.scheduler.get_last_lr()[0]
            loss, grad_norm = train_step(engine, batches, cfg, device)
            engine.scheduler.step()
            state.step += 1
            progress.update()
            signum = signals.signum
            last = state.step == cfg.max_steps
            save = state.step % cfg.ckpt_every == 0 or last or signum
            if state.step % cfg.log_every == 0 or save:  # the loop's only host syncs
                loss, grad_norm = loss.item(), grad_norm.item()
                if not math.isfinite(loss):  # before any checkpoint could hold the damage
                    # recorded for diagnose, which reads the lr and grad norm before it
                    run.log(step=state.step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
                    raise TrainingError(
                        f"loss is {loss} at step {state.step}: lower --lr, check the precision"
                        " (fp16 overflows where bf16 does not), and inspect the data (inspect-data)"
                    )
                run.log(step=state.step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
                progress.log(state.step, loss, lr, grad_norm)
            waits[1] += time.perf_counter() - step_started  # to the logging sync; not validation
            if state.step % eval_every == 0 or last:
                metrics = evaluate(engine, val_loader, splits, device)
                run.log(step=state.step, split="val", **metrics)
                improved = metrics["loss"] < state.best_val_loss
                if improved:
                    state.best_val_loss, state.best_step = metrics["loss"], state.step
                    state.evals_since_best = 0
                    checkpoints.save_best(payload())
                else:
                    state.evals_since_best += 1
                    stop = cfg.patience > 0 and state.evals_since_best >= cfg.patience
                shown = "  ".join(f"{name} {value:.4f}" for name, value in metrics.items())
                say(f"step {state.step}  val {shown}" + ("  (best)" if improved else ""))
                if stop:
                    say(f"early stop: no better validation in {cfg.patience} since step {state.best_step}")
            if save or stop:
                saved = checkpoints.save(payload(), state.step)
                run.checkpointed(state.step)
            if signum:
                break
        seconds = time.perf_counter() - started
        examples = (state.step - first_step) * examples_per_step
        summary = {
            "step": state.step,
            "best_val_loss": state.best_val_loss,
            "best_step": state.best_step,
            "best_checkpoint": str(checkpoints.path / "best.pt"),
            "seconds": seconds,
            "examples_per_s": examples / seconds if seconds > 0 else math.nan,
            "data_wait_share": waits[0] / waits[1] if waits[1] > 0 else math.nan,  # of the steps' time
            "stopped_by": signal.Signals(signum).name if signum else None,
            "exit_status": 128 + signum if signum else 0,
        }
        run.finish(summary)
    finally:
        progress.close()
        run.close()
        # Loader workers ignore stop signals, so at exit they must be ended here, by their loaders.
        batches.close()
        close(train_loader)
        close(val_loader)
        del batches, train_loader, val_loader
    if signum:
        if not quiet:
            print(
                f"stopped at step {state.step} by {summary['stopped_by']}; checkpoint {saved};"
                " run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
        return summary
    best = summary["best_checkpoint"]
    say(f"best val loss {state.best_val_loss:.4f} at step {state.best_step}; checkpoint {best}")
    return summary


class Progress:
    """A progress bar with loss, throughput and ETA on a terminal; plain lines when logged to a file."""

    def __init__(self, max_steps: int, step: int, examples_per_step: int, quiet: bool) -> None:
        self.max_steps = max_steps
        self.examples_per_step = examples_per_step
        self.quiet = quiet
        on_terminal = not quiet and sys.stderr.isatty()
        self.bar = tqdm(
            total=max_steps, initial=step, unit="step", dynamic_ncols=True, disable=not on_terminal
        )
        self.clock, self.clock_step = time.perf_counter(), step

    def update(self) -> None:
        self.bar.update()

    def log(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        now = time.perf_counter()
        rate = (step - self.clock_step) * self.examples_per_step / (now - self.clock)
        self.clock, self.clock_step = now, step
        if not self.bar.disable:
            self.bar.set_postfix_str(f"loss {loss:.4f}  lr {lr:.2e}  {rate:,.0f} examples/s")
        elif not self.quiet:
            print(
                f"step {step}/{self.max_steps}  loss {loss:.4f}  lr {lr:.2e}"
                f"  grad_norm {grad_norm:.3f}  {rate:,.0f} examples/s",
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()
