"""Yours to edit: the training loop, top to bottom: one training step (forward, loss, backward,
accumulation, clipping, the optimizer and scheduler steps), one validation pass, the steps with
their logging, validation and checkpoints, and a run restored or started. Every check, tune and
profile command trains with this file's train_step, so they prove the code that trains.

    python -m everything train  # synthetic data, into runs/default
    python -m everything train --data path/to/pairs.npz --run-dir runs/exp1
    python -m everything train --device cpu --max-steps 50  # debug without cuda
    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \
        -m everything train  # or scripts/train_single_node.sh

Run it again with the same --run-dir to resume from the newest valid checkpoint: the run continues
exactly as if it had never stopped. SIGTERM, Ctrl-C or SIGUSR1 stop it after the current step with
that step's checkpoint written, exit status 128 + the signal (143, 130, 138); see runtime/stopping.py.
"""

import math
import signal
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from .config import Config
from .data_shards import load_splits
from .model import Metrics, compute_loss
from .runtime import device as hardware
from .runtime import distributed
from .runtime.checkpoint import CheckpointDir
from .runtime.engine import PRECISION, Engine, setup
from .runtime.loader import build_loaders, close
from .runtime.progress import Progress, announced
from .runtime.resume import check_checkpoints_kept, payload, restore_run, set_rng_state
from .runtime.rundir import open_run
from .runtime.runlog import RunLog
from .runtime.state import Loop, micro_batches, validation_schedule, waited
from .runtime.stopping import StopSignals, stop_reason


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss, say); the message says what to check."""


def train_step(engine: Engine, batches, cfg: Config, device: torch.device, mark=lambda phase: None):
    """One optimizer step over cfg.grad_accum_steps micro-batches: the mean loss and the gradient norm
    as tensors (.item() waits for the device: the loop reads them on logging steps only). `mark(phase)`
    is called as each phase begins and with "done" at the end, for `profile`; training times nothing."""
    losses = []  # each micro-batch's share of the step's mean loss
    for i in range(cfg.grad_accum_steps):
        mark("data")
        x, y = next(batches)
        mark("copy")
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        mark("forward")
        # with several processes, gradients are averaged across them on the last micro-batch only
        with distributed.gradient_sync(engine.forward, last=i == cfg.grad_accum_steps - 1):
            with engine.autocast():  # bf16 or fp16 where asked; the loss in fp32
                output = engine.forward(x)
            loss = compute_loss(output, y)
            if cfg.grad_accum_steps > 1:  # one more operation forward and backward: not for one
                loss = loss / cfg.grad_accum_steps
            mark("backward")
            engine.scaler.scale(loss).backward()  # fp16: scaled up, so small gradients stay above 0
        losses.append(loss.detach())
    mark("optimizer")
    engine.freezing.drop_gradients()  # --freeze: no update and no weight decay until --unfreeze-at
    engine.scaler.unscale_(engine.optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = distributed.clip_grad_norm(engine.params, cfg.grad_clip)
    engine.scaler.step(engine.optimizer)  # fp16: skipped if the gradients overflowed; the scale then shrinks
    engine.scaler.update()
    engine.ema.update(grad_norm)  # --ema: the weights' moving average, of the steps with finite gradients
    engine.optimizer.zero_grad(set_to_none=True)
    engine.scheduler.step()  # once an optimizer step, not a micro-batch
    mark("done")
    return distributed.step_loss(losses), grad_norm


@torch.no_grad()
def evaluate(engine: Engine, loader, splits, device: torch.device) -> dict[str, float]:
    """The validation loss (compute_loss, averaged over examples) and the task's metrics."""
    engine.model.eval()
    metrics = Metrics(splits, device)
    batches = announced(loader, "validating") if distributed.is_main_process() else loader
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with engine.autocast():
            output = engine.forward(x)
        metrics.update(output, y, compute_loss(output, y))
    engine.model.train()
    distributed.all_reduce_sum(metrics.sums)  # each rank evaluated its share of the batches
    distributed.all_reduce_sum(metrics.count)
    return metrics.compute()


def log_train(loop: Loop, progress: Progress, loss: float, lr: float, grad_norm: float, **counts) -> None:
    """A train record (and `counts`) in metrics.jsonl and on the console; a NaN loss stops the run first."""
    step = loop.state.step
    if not math.isfinite(loss):  # recorded for diagnose (the lr and grad norm), raised before a checkpoint
        loop.run.log(step=step, split="train", loss=loss, lr=lr, grad_norm=grad_norm)
        raise TrainingError(
            f"loss is {loss} at step {step}: lower --lr, check the precision"
            " (fp16 overflows where bf16 does not), and inspect the data (inspect-data)"
        )
    skipped = counts["skipped_steps"]
    if skipped > loop.state.skipped_steps:
        loop.say(
            f"step {step}: fp16 gradients overflowed, the GradScaler skipped"
            f" {skipped - loop.state.skipped_steps} steps ({skipped} in all) and lowered its scale"
        )
    loop.state.skipped_steps = skipped
    loop.run.log(step=step, split="train", loss=loss, lr=lr, grad_norm=grad_norm, **counts)
    progress.log(step, loss, lr, grad_norm)


def validate(loop: Loop, val_loader, show: bool) -> bool:
    """Validates and records, printing if `show` or stopping; saves best if better. True: stop early."""
    cfg, state = loop.cfg, loop.state
    distributed.broadcast_buffers(loop.engine.model)  # every rank evaluates rank 0's BatchNorm statistics
    with loop.engine.ema.applied():  # --ema: validates the averaged weights, which pick the best checkpoint
        metrics = evaluate(loop.engine, val_loader, loop.splits, loop.device)
    loop.run.log(step=state.step, split="val", **metrics)
    if improved := metrics["loss"] < state.best_val_loss:
        state.best_val_loss, state.best_step, state.evals_since_best = metrics["loss"], state.step, 0
        loop.checkpoints.save_best(payload(loop))
    else:
        state.evals_since_best += 1
    stop = cfg.patience > 0 and state.evals_since_best >= cfg.patience
    if show or stop:
        values = "  ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        loop.say(f"step {state.step}  val {values}" + ("  (best)" if improved else ""))
    if stop:
        loop.say(f"early stop: no better validation in {cfg.patience} since step {state.best_step}")
    return stop


def run_steps(loop: Loop, batches, val_loader, eval_every: int, progress: Progress, signals: StopSignals):
    """The steps to cfg.max_steps or an early or signalled stop; returns the summary and last checkpoint."""
    cfg, engine, state, waits = loop.cfg, loop.engine, loop.state, loop.waits
    engine.model.train()
    counts = {}  # a train record's counts besides the loss (fp16: the steps the GradScaler skipped)
    skipped = torch.tensor(state.skipped_steps, device=loop.device)  # counted on the device: no sync
    started, first_step, stop, signum, saved = time.perf_counter(), state.step, False, 0, None
    ckpt_seconds = cfg.ckpt_minutes * 60 or math.inf  # 0: by --ckpt-every steps alone
    due = started + ckpt_seconds  # the next checkpoint by the clock, whatever the step
    shown = -cfg.log_every  # the step of the last validation line printed
    while state.step < cfg.max_steps and not stop:
        step_started = time.perf_counter()
        lr = engine.scheduler.get_last_lr()[0]
        if engine.freezing.at_step(state.step):
            loop.say(f"step {state.step}: --freeze {cfg.freeze} lifted, its modules train from here")
        loss, grad_norm = train_step(engine, batches, cfg, loop.device)
        skipped += grad_norm.isfinite().logical_not()  # the scaler's own test: inf or NaN grads
        state.step += 1
        progress.update()
        # every rank stops, and checkpoints by the clock, at the same step: the first rank due decides
        signum, overdue = distributed.any_rank_max(signals.signum, time.perf_counter() >= due)
        last = state.step == cfg.max_steps
        save = state.step % cfg.ckpt_every == 0 or last or signum or overdue
        if state.step % cfg.log_every == 0 or save:  # the loop's only host syncs
            loss = distributed.mean_loss(loss)  # over every rank's examples
            counts["skipped_steps"] = int(skipped.item())
            log_train(loop, progress, loss.item(), lr, grad_norm.item(), **counts)
        waits.steps += time.perf_counter() - step_started  # to the logging sync; not validation
        if state.step % eval_every == 0 or last:
            # every validation is recorded; its line is printed at most once in --log-every steps
            show = last or state.step - shown >= cfg.log_every
            shown = state.step if show else shown
            stop = validate(loop, val_loader, show)
        if save or stop:
            saved = loop.checkpoints.save(payload(loop), state.step)
            loop.run.checkpointed(state.step)
            due = time.perf_counter() + ckpt_seconds
        if signum:
            break
    seconds = time.perf_counter() - started
    examples = (state.step - first_step) * loop.examples_per_step()
    return {
        "step": state.step,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "seconds": seconds,
        "examples_per_s": examples / seconds if seconds > 0 else math.nan,
        "data_wait_share": waits.data / waits.steps if waits.steps > 0 else math.nan,  # of the steps' time
        "stopped_by": stop_reason(signal.Signals(signum)) if signum else None,
        "exit_status": 128 + signum if signum else 0,
    }, saved


def train(cfg: Config, quiet: bool = False) -> dict:
    """Trains (or resumes) the run in cfg.run_dir; returns where it ended and its best validation
    ("stopped_by" names a stop signal that ended it early, "exit_status" is 128 plus its number)."""
    with StopSignals() as signals:
        device, group = setup(cfg)
        quiet = quiet or not group.is_main  # one rank speaks for all
        say = (lambda message: None) if quiet else tqdm.write  # tqdm.write prints above a progress bar
        splits = load_splits(cfg)
        engine = Engine(cfg, splits, device)
        store = open_run(cfg.run_dir, cfg.keep_last, group, cfg.upload_retry_minutes)  # a URL: staged, pulled
        check_checkpoints_kept(store.local)
        run = distributed.main_only(lambda: RunLog(store))  # rank 0 alone writes the records
        checkpoints = CheckpointDir(store.local / "checkpoints", cfg.keep_last, main=group.is_main)
        loop = Loop(cfg, engine, splits, device, group, run, checkpoints, say)
        saved_rng = restore_run(loop)
        state = loop.state
        if state.step >= cfg.max_steps:
            run.close()
            say(f"{cfg.run_dir} is complete at step {state.step}: raise --max-steps to train on")
            return {**asdict(state), "stopped_by": None, "exit_status": 0}
        n_params = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        say(f"model: {n_params:,} trainable parameters; device {device}, precision {PRECISION}")
        learns = f"{splits.trains_on()}; " if hasattr(splits, "trains_on") else ""  # your data.py may not say
        say(f"data: {splits.source}, {learns}{len(splits.train):,} train / {len(splits.val):,} val examples")
        say(f"ranks: {group.world_size}, {cfg.batch_size} examples each a micro-batch")
        train_loader, val_loader, sampler = build_loaders(splits, cfg, device, group)
        eval_every, plan = validation_schedule(cfg, sampler)
        say(plan)
        batches = waited(micro_batches(train_loader, sampler, state), loop.waits)
        if saved_rng is not None:
            set_rng_state(saved_rng)  # last: nothing above may consume the restored streams
        progress = Progress(cfg.max_steps, state.step, loop.examples_per_step(), quiet)
        try:
            summary, saved = run_steps(loop, batches, val_loader, eval_every, progress, signals)
            summary["best_checkpoint"] = store.name(checkpoints.best) if checkpoints.best.exists() else None
            run.finish(summary)
        except RuntimeError as error:  # out of memory: what to do next, in one line
            if not hardware.out_of_memory(error):
                raise
            remedies = hardware.out_of_memory_remedies(cfg)
            at = f"step {state.step + 1}, a micro-batch of {cfg.batch_size} on {device}"
            raise TrainingError(f"out of memory at {at}: next, {remedies}") from None
        finally:
            progress.close()
            # Loader workers ignore stop signals: ended here by their loaders, first (run.close() may fail).
            batches.close()
            close(train_loader)
            close(val_loader)
            del batches, train_loader, val_loader
            run.close()
    if summary["stopped_by"] and not quiet:
        saved = saved and store.name(saved)  # a URL's, not the staging folder's
        stopped = f"stopped at step {state.step} by {summary['stopped_by']}; checkpoint {saved}"
        print(f"{stopped}; run the same command to resume", file=sys.stderr, flush=True)
    elif not summary["stopped_by"]:
        best = summary["best_checkpoint"] or "lost"
        say(f"best val loss {state.best_val_loss:.4f} at step {state.best_step}; checkpoint {best}")
    return summary
