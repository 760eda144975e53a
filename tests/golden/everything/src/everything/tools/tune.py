"""Tool: the tuning steps of the rules, each on a fresh copy of the model (no run folder is written).

    python -m everything find-lr  # the learning-rate range test
    python -m everything find-lr --data FILE -o lr.png  # any train option
    python -m everything find-batch-size  # the micro-batch to train with

`find-lr` trains for a few hundred steps while the learning rate grows exponentially: the loss
against the rate says where to train. `find-batch-size` tries micro-batch sizes and suggests one,
with the learning rate rescaled to it; find_batch_size says how it measures them on this device.
"""

import math
import sys
from dataclasses import replace

import torch

from ..config import Config
from ..data_shards import load_splits
from ..runtime import device as hardware
from ..runtime.engine import Engine, setup
from ..runtime.loader import EpochDataset
from ..runtime.progress import announced
from ..train import train_step
from .timing import time_steps, training_batches

LR_START = 1e-7  # far below any useful rate: the curve starts flat
LR_END = 10.0  # far above: AdamW diverges well before it
RANGE_STEPS = 200  # optimizer steps of the sweep: 25 a decade, enough for a smooth curve
SMOOTHING = 0.9  # exponential moving average of the loss: one batch is noisy
DIVERGED = 4.0  # stop once the smoothed loss is 4x its best: past there the curve says nothing
SUGGEST_DIVISOR = 10  # the rule (Smith 2017, fastai): a tenth of the rate at the lowest loss
CPU_BATCHES = tuple(2**k for k in range(3, 13))  # 8 ... 4096: the CPU's throughput sweep
CPU_STEP_LIMIT = 1.0  # seconds: the sweep stops at a batch whose step takes longer
TIMED_STEPS = 3  # steps timed at each batch size, after one untimed


def lr_range(cfg: Config, steps: int = RANGE_STEPS) -> list[tuple[float, float]]:
    """(learning rate, smoothed loss) for each step of the sweep, until the loss diverges."""
    device, splits, batches = training_batches(cfg)
    engine = Engine(cfg, splits, device)  # a fresh model: in training mode
    points, average, best = [], 0.0, math.inf
    print(f"find-lr: {steps} steps, lr {LR_START:g} up to {LR_END:g}...", file=sys.stderr, flush=True)
    for i in announced(range(steps), "find-lr", "step"):
        lr = LR_START * (LR_END / LR_START) ** (i / (steps - 1))
        for group in engine.optimizer.param_groups:
            # the sweep replaces the warmup and decay; a pretrained body keeps its share of --lr (optim.py)
            group["lr"] = lr * group["initial_lr"] / cfg.lr
        loss = train_step(engine, batches, cfg, device)[0].item()
        if not math.isfinite(loss):
            break
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed = average / (1 - SMOOTHING ** (i + 1))  # bias-corrected: the average starts at 0
        points.append((lr, smoothed))
        best = min(best, smoothed)
        if smoothed > DIVERGED * best:
            break
    return points


def find_lr(cfg: Config, output: str, steps: int = RANGE_STEPS) -> str:
    """Runs the sweep, plots it when matplotlib is there, and says what --lr to use."""
    points = lr_range(cfg, steps)
    if len(points) < 2:
        return f"the loss was not finite from the first steps of the sweep at lr {LR_START:g}: check the data"
    lowest_lr, lowest = min(points, key=lambda p: p[1])
    lr = lowest_lr / SUGGEST_DIVISOR
    lines = [
        f"swept lr {points[0][0]:.3g} -> {points[-1][0]:.3g} over {len(points)} steps",
        f"suggested --lr {lr:.3g} ({1 / SUGGEST_DIVISOR:g} x the lr of the lowest smoothed loss, "
        f"{lowest:.4g} at lr {lowest_lr:.3g}); now --lr {cfg.lr:g}",
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return "\n".join([*lines, 'no plot: pip install -e ".[plot]" for matplotlib'])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points, strict=True))
    ax.axvline(lr, color="C1", linestyle="--", label=f"suggested {lr:.3g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="smoothed train loss", title="lr range test")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    return "\n".join([*lines, f"wrote {output}"])


def rescaled_lr(lr: float, old_batch: int, new_batch: int) -> float:
    """The square-root rule for Adam-type optimizers (Malladi et al. 2022): lr grows with sqrt(batch)."""
    return lr * math.sqrt(new_batch / old_batch)


def accumulation_for(global_batch: int, micro_batch: int, world_size: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation steps) whose product with the processes is `global_batch`, the
    micro-batch at most `micro_batch`: the fewest accumulation steps that reach it."""
    steps = math.ceil(global_batch / (micro_batch * world_size))
    return global_batch // (steps * world_size), steps


def _sizing(cfg: Config):
    """The device, a fresh engine, a step on a micro-batch of any size, and the bound on that size."""
    device, _ = setup(cfg)
    splits = load_splits(cfg)
    engine = Engine(cfg, splits, device)
    examples = EpochDataset(splits.train)

    def step(size: int) -> None:
        x, y = examples.__getitems__((0, torch.arange(size) % len(examples)))
        train_step(engine, iter([(x, y)]), replace(cfg, grad_accum_steps=1), device)

    return device, engine, step, len(examples)


MEMORY_TARGET = 0.85  # the rules: raise the batch until memory is ~85-90% used; the rest is headroom
LARGEST_BATCH = 2**20  # where the doubling stops, whatever the memory


def find_batch_size(cfg: Config, global_batch: int | None = None, target: float = MEMORY_TARGET) -> str:
    """The largest micro-batch whose training step peaks under `target` of the GPU's memory; with
    --device cpu, whose memory does not bound it, throughput by micro-batch. Says which
    --batch-size (and lr, accumulation) to use."""
    device, engine, step, limit = _sizing(cfg)
    if device.type == "cpu":
        return _throughput_sweep(cfg, device, step, global_batch, limit)
    found = _memory_search(cfg, device, engine, step, global_batch, target, limit)
    if cfg.activation_checkpointing == 1:
        return found
    del engine, step  # freed before the engine whose every block recomputes its activations
    recomputing = replace(cfg, activation_checkpointing=1)
    _, engine, step, _ = _sizing(recomputing)
    return found + "\n" + _memory_search(recomputing, device, engine, step, global_batch, target, limit)


def _memory_search(
    cfg: Config, device, engine: Engine, step, global_batch: int | None, target: float, limit: int
) -> str:
    """The largest micro-batch whose step peaks under `target` of the GPU's memory, at most the
    training split's `limit` examples: doubling, then bisecting, out of memory caught."""
    name, total = hardware.memory(device)
    every = cfg.activation_checkpointing
    flag = f" --activation-checkpointing {every}" if every else ""  # in the lines below, where it is on
    recomputed = f" with{flag}" if every else ""
    gib = total / 2**30
    lines = [f"find-batch-size on {name} ({gib:.1f} GiB){recomputed}: the largest step under {target:.0%}"]

    ran: list[int] = []  # the sizes whose step ran: a later failure is its size's, not the code's

    def fits(size: int) -> bool:
        try:
            hardware.empty_cache(device)
            step(size)
            hardware.synchronize(device)
            peak = hardware.peak_memory(device)
        except RuntimeError as error:  # out of memory, or a kernel's own limit (cuDNN attention's)
            out_of_memory = hardware.out_of_memory(error)
            if not (out_of_memory or ran):
                raise
            failed = "out of memory" if out_of_memory else f"failed ({str(error).splitlines()[0][:120]})"
            lines.append(f"  batch {size:7d}: {failed}")
            engine.optimizer.zero_grad(set_to_none=True)  # what the failed step had allocated
            hardware.empty_cache(device)
            return False
        ran.append(size)
        lines.append(f"  batch {size:7d}: peak {peak / 2**30:8.2f} GiB ({peak / total:.1%})")
        return peak <= target * total

    best = largest_fitting(fits, min(cfg.batch_size, limit), limit)
    if best == 0:
        remedies = hardware.out_of_memory_remedies(replace(cfg, batch_size=1))
        return "\n".join([*lines, f"not even a micro-batch of 1 fits{recomputed}: next, {remedies}"])
    capped = " (the training split's size: memory was not the limit)" if best == limit else ""
    lines.append(f"largest micro-batch under {target:.0%}{recomputed}: {best}{capped}")
    suggested = _suggestion(cfg, best, global_batch)
    suggested = [line.replace(": --batch-size", f":{flag} --batch-size", 1) for line in suggested]
    return "\n".join([*lines, *suggested])


def largest_fitting(fits, start: int, limit: int = LARGEST_BATCH) -> int:
    """The largest batch size for which fits(size) -> bool holds, assuming it holds for all
    smaller ones: doubling from `start` until it fails, then bisecting between the last fit and
    the failure. 0 if not even `start` fits (then halving finds one, down to 1)."""
    if not fits(start):
        while start > 1:
            start //= 2
            if fits(start):
                break
        else:
            return 0
    low, high = start, None
    while high is None and low < limit:
        candidate = min(2 * low, limit)
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high is not None and high - low > max(1, low // 16):  # within 1/16: a step is not exact
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _throughput_sweep(cfg: Config, device: torch.device, step, global_batch: int | None, limit: int) -> str:
    """On a CPU: samples/s by micro-batch size up to the training split's size; the fastest wins."""
    lines = [f"find-batch-size on {device.type}: no device memory to fill; throughput by micro-batch instead"]
    rates = {}
    for size in [size for size in CPU_BATCHES if size <= limit] or [limit]:
        step(size)  # untimed: the first step at a size (and any recompilation for it)
        seconds = time_steps(step, size, device, TIMED_STEPS, range(TIMED_STEPS))
        rates[size] = size / seconds
        lines.append(f"  batch {size:6d}: {rates[size]:12,.0f} samples/s  ({seconds * 1e3:.2f} ms a step)")
        if seconds > CPU_STEP_LIMIT:
            break
    best = max(rates, key=rates.get)
    lines.append(f"fastest per sample: --batch-size {best} ({rates[best]:,.0f} samples/s)")
    return "\n".join([*lines, *_suggestion(cfg, best, global_batch)])


def _suggestion(cfg: Config, micro_batch: int, global_batch: int | None) -> list[str]:
    if global_batch is None:
        lr = rescaled_lr(cfg.lr, cfg.batch_size * cfg.grad_accum_steps, micro_batch * cfg.grad_accum_steps)
        return [
            f"suggested: --batch-size {micro_batch} --lr {lr:.3g} (the square-root rule for AdamW: "
            f"--lr {cfg.lr:g} x sqrt({micro_batch}/{cfg.batch_size}); now --batch-size {cfg.batch_size})"
        ]
    size, steps = accumulation_for(global_batch, micro_batch)
    lr = rescaled_lr(cfg.lr, cfg.batch_size * cfg.grad_accum_steps, size * steps)
    return [
        f"suggested for a batch of {size * steps} a step: --batch-size {size} --grad-accum-steps {steps} "
        f"--lr {lr:.3g} (the square-root rule for AdamW from {cfg.batch_size * cfg.grad_accum_steps} a step)"
    ]
