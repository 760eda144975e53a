"""Tool: `profile`, where a training step's time goes, which operators take it, and the FLOP/s.

    python -m default profile  # the default model and data
    python -m default profile --batch-size 256  # any train option

Real training steps on a fresh model (no run folder is written), in three passes after a warm-up:
1. the split: each phase of a step (data wait, host-to-device copy, forward, backward, optimizer)
   timed with the device synchronised as it ends, beside the step's own time;
2. one torch.profiler window (wait, warm-up, active steps): the top operators and a Chrome trace;
3. the FLOPs of one step (torch.utils.flop_counter) over the step's unsynchronised time: the
   achieved FLOP/s, and the model FLOP utilisation where runtime/device.py lists the device's peak.
Then the verdict of the rules: fix the loader first when the data wait is a real share of a step.
"""

import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..config import Config
from ..model import compute_loss
from ..runtime.device import mfu, profiler_view, synchronize
from ..runtime.engine import PRECISION, Engine
from ..runtime.progress import announced
from ..train import train_step
from .timing import LOADER_WARN_SHARE, time_steps, training_batches

PHASES = ("data", "copy", "forward", "backward", "optimizer")
WARMUP_STEPS = 5  # compilation, the allocator and the loader workers settle before any timing
SPLIT_STEPS = 20  # steps timed phase by phase, and again without synchronising
PROFILER_WAIT, PROFILER_WARMUP, PROFILER_ACTIVE = 1, 2, 5  # torch.profiler's schedule, in steps
TOP_OPERATORS = 12


class PhaseTimer:
    """train_step's `mark` for the split: the time from one mark to the next goes to the phase the
    first began, the device synchronised at each mark so queued work counts in the phase that queued it."""

    def __init__(self, device: torch.device, clock=time.perf_counter) -> None:
        self.device, self.clock = device, clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.phase: str | None = None
        self.since = 0.0

    def __call__(self, phase: str) -> None:
        synchronize(self.device)
        now = self.clock()
        if self.phase is not None:
            self.seconds[self.phase] += now - self.since
        self.phase, self.since = (None if phase == "done" else phase), now


def profile(cfg: Config, output: str) -> str:
    """Runs the three passes; the lines to print. Writes the trace under `output`."""
    device, splits, batches = training_batches(cfg)
    engine = Engine(cfg, splits, device)

    def steps(count: int, what: str, **mark) -> float:
        print(f"profile: {count} {what}...", file=sys.stderr, flush=True)
        step = partial(train_step, engine, cfg=cfg, device=device, **mark)
        return time_steps(step, batches, device, count, announced(range(count), "profile", "step"))

    steps(WARMUP_STEPS, "warm-up steps")
    timer = PhaseTimer(device)
    synced = steps(SPLIT_STEPS, "steps timed phase by phase", mark=timer)
    unsynced = steps(SPLIT_STEPS, "steps timed whole")
    split = {phase: seconds / SPLIT_STEPS for phase, seconds in timer.seconds.items()}
    flops = step_flops(engine, batches, cfg, device)
    table, trace = operators(engine, batches, cfg, device, Path(output))

    total = sum(split.values())
    lines = [
        f"profile: {SPLIT_STEPS} steps (micro-batch {cfg.batch_size} x {cfg.grad_accum_steps} a step) "
        f"on {device.type}, {PRECISION}, after {WARMUP_STEPS} warm-up steps",
        *(f"  {phase:<10} {s * 1e3:9.3f} ms  {s / total:6.1%}" for phase, s in split.items()),
        f"  phases sum {total * 1e3:.3f} ms of a synchronised step of {synced * 1e3:.3f} ms "
        f"({total / synced:.1%}); unsynchronised {unsynced * 1e3:.3f} ms a step, "
        f"{cfg.batch_size * cfg.grad_accum_steps / unsynced:,.0f} samples/s",
        f"FLOPs: {flops:.4g} a step (forward and backward, torch.utils.flop_counter): "
        f"{flops / unsynced / 1e9:,.2f} GFLOP/s achieved{mfu(flops / unsynced, device, PRECISION)}",
        verdict(split["data"] / total),
        f"top operators (torch.profiler, {PROFILER_ACTIVE} active steps):",
        table,
        f"wrote {trace}",
    ]
    return "\n".join(lines)


def verdict(data_share: float) -> str:
    if data_share > LOADER_WARN_SHARE:
        return (
            f"verdict: loader-bound: waiting for data is {data_share:.1%} of a step (over "
            f"{LOADER_WARN_SHARE:.0%}): fix loading first (--num-workers, work out of __getitem__)"
        )
    return f"verdict: not loader-bound: waiting for data is {data_share:.1%} of a step"


def step_flops(engine: Engine, batches, cfg: Config, device: torch.device) -> int:
    """The FLOPs of one step's forward and backward passes, counted on the plain model (compiled graphs
    would hide the operators from the counter); the gradients are discarded, the optimizer takes no step."""
    with FlopCounterMode(display=False) as counter:
        for _ in range(cfg.grad_accum_steps):
            x, y = (t.to(device) for t in next(batches))
            compute_loss(engine.model(x), y).backward()
    engine.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def operators(engine: Engine, batches, cfg: Config, device: torch.device, output: Path) -> tuple[str, Path]:
    """One torch.profiler window: its top operators by self time, and its Chrome trace
    (ui.perfetto.dev)."""
    activities, sort = profiler_view(device)
    trace = output / "trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    window = PROFILER_WAIT + PROFILER_WARMUP + PROFILER_ACTIVE
    print(f"profile: {window} steps under torch.profiler...", file=sys.stderr, flush=True)
    schedule = torch.profiler.schedule(wait=PROFILER_WAIT, warmup=PROFILER_WARMUP, active=PROFILER_ACTIVE)
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(str(trace))
    ) as profiler:
        for _ in range(window):
            train_step(engine, batches, cfg, device)
            profiler.step()
    return profiler.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS), trace
