"""Built-in checks that prove the training code before anyone spends hours on it.

    python -m everything check all      # all three, then the summary
    python -m everything check overfit  # memorises one batch of 8
    python -m everything check resume   # the same losses, bit for bit
    python -m everything check loader   # loading keeps up with training

Exit status 0 only if every check run passes. Each check takes the same options as `train`
(--data, --device, ...) and writes its runs under runs/check/.
"""

import functools
import itertools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .checkpoint import load
from .config import Config
from .data import load_splits
from .distributed import all_reduce_sum, barrier, init_distributed
from .loader import build_loaders
from .model import build_model, compute_loss, overfit_target
from .runlog import PROJECT, git_state, read_metrics
from .train import TrainState, build_optimizer, micro_batches, setup, train, train_step, wrap

OVERFIT_EXAMPLES = 8
OVERFIT_MAX_STEPS = 300
LOADER_BATCHES = 200  # batches timed when iterating the loader alone
WINDOW_STEPS = 30  # optimizer steps timed with compute alone and with real loading
ROUNDS = 4  # alone, loading and compute are each timed in rounds; the fastest round counts
LOADER_WARN_SHARE = 0.10


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str  # one line: what was measured
    value: float = math.nan  # the headline figure for the summary
    samples_per_s: float = math.nan

    def line(self) -> str:
        return f"{self.name}: {'PASS' if self.passed else 'FAIL'}: {self.detail}"


def check_overfit(cfg: Config) -> CheckResult:
    """A model that cannot memorise 8 examples has a bug: its loss must fall to model.overfit_target."""
    device = setup(cfg)
    splits = load_splits(cfg)
    model = build_model(cfg, splits).to(device)
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type)
    x, y = splits.train[torch.arange(OVERFIT_EXAMPLES)]
    x, y = x.to(device), y.to(device)

    compute_loss(model(x), y).backward()
    no_grad = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())
    ]
    optimizer.zero_grad(set_to_none=True)
    if no_grad:
        return CheckResult("overfit", False, f"no finite gradient reaches {', '.join(no_grad)}")

    forward = wrap(model, cfg, device)
    batches = itertools.repeat((x, y))
    first = target = None
    for step in range(1, OVERFIT_MAX_STEPS + 1):
        loss, _ = train_step(forward, batches, optimizer, cfg, device, scaler)
        # Ranks draw different dropout masks: they stop on their mean loss, all at the same step.
        loss = (all_reduce_sum(loss) / init_distributed(device.type).world_size).item()
        if not math.isfinite(loss):
            return CheckResult("overfit", False, f"loss became {loss} at step {step}: lower --lr", loss)
        if first is None:
            first, target = loss, overfit_target(loss)
        if loss <= target:
            break
    detail = f"loss {first:.4f} -> {loss:.4g} in {step} steps (target <= {target:.4g})"
    return CheckResult("overfit", loss <= target, detail, loss)


def check_resume(cfg: Config, work: Path) -> CheckResult:
    """Trains 2N steps with a checkpoint at N, resumes a copy from that checkpoint, compares.

    N falls mid-epoch, an epoch boundary and validations lie between N and 2N, and loader
    workers are on, so every piece of state a resume needs is exercised.
    """
    splits = load_splits(cfg)
    micro_per_epoch = min(len(splits.train), cfg.batch_size * cfg.grad_accum_steps * 8) // cfg.batch_size
    n = _resume_point(micro_per_epoch, cfg.grad_accum_steps)
    base = replace(
        cfg,
        max_train_examples=micro_per_epoch * cfg.batch_size,
        max_steps=2 * n,
        warmup_steps=n // 3,
        ckpt_every=n,
        eval_every=n // 2 + 1,
        log_every=1,
        keep_last=2,
        patience=0,
        num_workers=max(1, cfg.num_workers),
        deterministic=True,
    )
    is_main = init_distributed(torch.device(cfg.device).type).is_main
    if is_main:
        shutil.rmtree(work, ignore_errors=True)
    barrier()
    first, second = work / "uninterrupted", work / "resumed"
    train(replace(base, run_dir=str(first)), quiet=True)

    # The run as a crash right after step N's checkpoint would leave it: the records past step N
    # are in metrics.jsonl (they must be dropped on resume), the later checkpoints are not.
    barrier()  # rank 0 has written everything
    if is_main:
        shutil.copytree(first, second)
        for path in (second / "checkpoints").iterdir():
            if path.name != f"step-{n:08d}.pt":
                path.unlink()
    barrier()
    _scramble_global_rngs()
    train(replace(base, run_dir=str(second)), quiet=True)
    barrier()

    expected = [r["loss"] for r in read_metrics(first) if r["split"] == "train"]
    got = [r["loss"] for r in read_metrics(second) if r["split"] == "train"]
    same_losses = got == expected and len(got) == 2 * n
    end = f"checkpoints/step-{2 * n:08d}.pt"
    a, b = load(first / end), load(second / end)
    same_state = _equal(a["model"], b["model"]) and _equal(a["optimizer"], b["optimizer"])
    equal = sum(x == y for x, y in zip(expected[n:], got[n:], strict=False))
    detail = (
        f"checkpoint at step {n} of {2 * n}; losses of steps {n + 1}-{2 * n}: {equal}/{n} equal; "
        f"{len(got)} train records for {2 * n} steps; final model and optimizer "
        + ("equal" if same_state else "DIFFER")
    )
    return CheckResult("resume", same_losses and same_state, detail)


def check_loader(cfg: Config) -> CheckResult:
    """Times the loader alone, a training step alone, and both together."""
    device = setup(cfg)
    splits = load_splits(cfg)
    group = init_distributed(device.type)
    loader, _, sampler = build_loaders(splits, cfg, device, group.rank, group.world_size)
    batches = micro_batches(loader, sampler, TrainState())
    for _ in range(10):  # start the workers and fill their queues
        next(batches)
    load_per_batch = min(_time_batches(batches, LOADER_BATCHES // ROUNDS) for _ in range(ROUNDS))

    model = build_model(cfg, splits).to(device)
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type)
    model = wrap(model, cfg, device)
    step = functools.partial(train_step, model, optimizer=optimizer, cfg=cfg, device=device, scaler=scaler)
    on_device = [tuple(t.to(device) for t in next(batches)) for _ in range(cfg.grad_accum_steps)]
    fixed = itertools.cycle(on_device)
    _time_steps(step, fixed, device, 3)  # warm-up (and compilation)
    compute = min(_time_steps(step, fixed, device, WINDOW_STEPS // ROUNDS) for _ in range(ROUNDS))
    waits: list[float] = []
    window = _time_steps(step, _timed(batches, waits), device, WINDOW_STEPS)
    share = sum(waits) / (window * WINDOW_STEPS)
    throughput = cfg.batch_size * cfg.grad_accum_steps / window
    load_per_step = load_per_batch * cfg.grad_accum_steps
    passed = load_per_step <= compute
    detail = (
        f"loader alone {cfg.batch_size / load_per_batch:,.0f} samples/s "
        f"({load_per_step * 1e3:.2f} ms a step), "
        f"training step {compute * 1e3:.2f} ms; with real loading {throughput:,.0f} samples/s, "
        f"{share:.1%} of the time waiting for data (num_workers={cfg.num_workers})"
    )
    if not passed:
        detail += ": loading is the bottleneck; raise --num-workers or move work out of the main process"
    elif share > LOADER_WARN_SHARE:
        detail += f": warning, over {LOADER_WARN_SHARE:.0%}; try more --num-workers"
    return CheckResult("loader", passed, detail, share, throughput)


def run_checks(cfg: Config, which: str) -> int:
    """Runs one check or all of them; prints their lines (and the summary for `all`); exit code."""
    if "RANK" not in os.environ:  # checks run under 2 processes, so resume covers per-rank state
        return _under_torchrun(processes=2)
    return _run(cfg, which, main=init_distributed(torch.device(cfg.device).type).is_main)


def _under_torchrun(processes: int) -> int:
    """Runs this very command again under torchrun, with a c10d rendezvous on this machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(processes),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", __package__, *sys.argv[1:],
    ]  # fmt: skip
    return subprocess.run(command).returncode


def _run(cfg: Config, which: str, main: bool) -> int:
    """Every rank runs the checks; rank 0 reports, and its exit status fails torchrun if one failed."""
    say = print if main else lambda line: None
    work = Path(cfg.run_dir).parent / "check"
    results = []
    if which in ("overfit", "all"):
        results.append(check_overfit(cfg))
        say(results[-1].line())
    if which in ("loader", "all"):  # before resume, which pins one thread for exactness
        results.append(check_loader(cfg))
        say(results[-1].line())
    if which in ("resume", "all"):
        results.append(check_resume(cfg, work / "resume"))
        say(results[-1].line())
    if which == "all":
        by_name = {r.name: r for r in results}
        summary = {
            "overfit_loss": by_name["overfit"].value,
            "resume_matched": by_name["resume"].passed,
            "loader_share": by_name["loader"].value,
            "samples_per_s": by_name["loader"].samples_per_s,
            "passed": all(r.passed for r in results),
        }
        if main:
            (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")  # for `report`
        git = git_state()
        commit = (git["commit"] or "none")[:12] + ("-dirty" if git["dirty"] else "")
        say(
            f"**Run:** {PROJECT} commit {commit}, config {work / 'resume' / 'uninterrupted' / 'run.json'}, "
            f"seed {cfg.seed}, torch {torch.__version__}"
        )
        say(
            f"**Sanity:** overfit-one-batch loss {by_name['overfit'].value:.4g}; "
            f"resume check matched: {'yes' if by_name['resume'].passed else 'no'}"
        )
        say(
            f"**Throughput:** {by_name['loader'].samples_per_s:,.0f} samples/s, "
            f"GPU util {_gpu_utilization(torch.device(cfg.device))}, "
            f"data-loader time share {by_name['loader'].value:.1%}"
        )
    return 0 if all(r.passed for r in results) else 1


def _resume_point(micro_per_epoch: int, accum: int) -> int:
    """The first N >= 10 steps that ends mid-epoch with an epoch boundary before step 2N."""
    for n in itertools.count(10):
        start, end = n * accum, 2 * n * accum
        if start % micro_per_epoch and (start // micro_per_epoch + 1) * micro_per_epoch < end:
            return n
    raise AssertionError("unreachable")


def _time_batches(batches, count: int) -> float:
    """Seconds per batch drawn from the loader alone."""
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return (time.perf_counter() - start) / count


def _time_steps(step, batches, device: torch.device, count: int) -> float:
    """Seconds per optimizer step."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(count):
        step(batches)
    _synchronize(device)
    return (time.perf_counter() - start) / count


def _timed(batches, waits: list[float]):
    """Passes batches through, recording how long each took to arrive."""
    while True:
        start = time.perf_counter()
        batch = next(batches)
        waits.append(time.perf_counter() - start)
        yield batch


def _synchronize(device: torch.device) -> None:
    """Waits for queued device work, so that timings measure it (the CPU runs ops in order)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _gpu_utilization(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a"
    try:
        return f"{torch.cuda.utilization(device)}%"
    except (ModuleNotFoundError, RuntimeError):  # needs the nvidia-ml-py package
        return "n/a"


def _scramble_global_rngs() -> None:
    """So that the resumed run passes only if it restores every RNG state from its checkpoint."""
    noise = int.from_bytes(os.urandom(4), "little")
    random.seed(noise)
    np.random.seed(noise)
    torch.manual_seed(noise)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b
