"""Tool: timing of the data loader alone, a training step alone, and both together (`check loader`)."""

import itertools
import os
import sys
import time
from contextlib import closing
from dataclasses import dataclass, replace
from functools import partial

import torch

from ..config import Config
from ..data_shards import load_splits
from ..runtime.device import sample_utilization, synchronize
from ..runtime.distributed import any_rank_max, is_main_process
from ..runtime.engine import Engine, setup
from ..runtime.loader import build_loaders, close
from ..runtime.progress import announced
from ..runtime.state import TrainState, Waits, micro_batches, waited
from ..train import train_step

LOADER_BATCHES = 200  # batches timed when iterating the loader alone
WINDOW_STEPS = 30  # optimizer steps timed with compute alone and with real loading, or fewer:
WINDOW_SECONDS = 2.0  # as many as fit in this much compute (ROUNDS at least), where steps are slow
ROUNDS = 4  # alone, loading and compute are each timed in rounds; the fastest round counts
SWEEP_BATCHES = 30  # batches timed for each worker count tried, once its workers have started
LOADER_WARN_SHARE = 0.10  # a step waiting for data over a tenth of its time: fix loading before the model


@dataclass
class LoaderTiming:
    load_per_step: float  # seconds the loader alone takes for one step's micro-batches
    samples_per_s_alone: float  # the loader alone
    step: float  # seconds a training step takes on batches already on the device
    samples_per_s: float  # training with real loading
    wait_share: float  # share of that time spent waiting for the next batch
    by_workers: dict[int, float]  # the loader alone, samples/s for each --num-workers tried
    gpu_util: str  # the GPU's mean utilisation over that window, or n/a where none is read
    fetch_share: float  # of the loader alone's time, shards were being fetched from the data store


def training_batches(cfg: Config):
    """The device, the splits and an endless stream of training micro-batches, set up as `train` does."""
    device, _ = setup(cfg)
    splits = load_splits(cfg)
    loader, _, sampler = build_loaders(splits, cfg, device)
    return device, splits, micro_batches(loader, sampler, TrainState())


def time_loader(cfg: Config) -> LoaderTiming:
    device, splits, batches = training_batches(cfg)
    shards = getattr(splits.train, "shards", None)  # streamed data: its fetches are timed
    fetched, started = shards.fetching if shards else 0.0, time.perf_counter()
    with closing(_phase(10 + LOADER_BATCHES, "batch", "the loader alone")) as ticks:
        time_steps(next, batches, device, 10, ticks)  # starts the workers and fills their queues
        rounds = (time_steps(next, batches, device, LOADER_BATCHES // ROUNDS, ticks) for _ in range(ROUNDS))
        load_per_batch = sum(rounds) / ROUNDS  # the mean: streamed shards wait for the store at times
    fetch_share = ((shards.fetching if shards else 0.0) - fetched) / (time.perf_counter() - started)
    by_workers = samples_per_s_by_workers(splits, cfg, device)

    step = partial(train_step, Engine(cfg, splits, device), cfg=cfg, device=device)
    fixed = itertools.cycle([tuple(t.to(device) for t in next(batches)) for _ in range(cfg.grad_accum_steps)])
    with closing(_phase(3 + WINDOW_STEPS // ROUNDS * ROUNDS, "step", "training steps alone")) as ticks:
        time_steps(step, fixed, device, 2, ticks)  # warm-up (and compilation)
        fit = int(WINDOW_SECONDS / time_steps(step, fixed, device, 1, ticks))
        steps = min(WINDOW_STEPS, max(ROUNDS, *any_rank_max(fit)))  # the same on every rank
        compute = min(time_steps(step, fixed, device, steps // ROUNDS, ticks) for _ in range(ROUNDS))
    loading = waited(batches, waits := Waits())  # adds each batch's wait to waits.data
    with closing(_phase(steps, "step", "training steps with the loader")) as ticks:
        window, gpu_util = sample_utilization(device, lambda: time_steps(step, loading, device, steps, ticks))
    return LoaderTiming(
        load_per_step=load_per_batch * cfg.grad_accum_steps,
        samples_per_s_alone=cfg.batch_size / load_per_batch,
        step=compute,
        samples_per_s=cfg.batch_size * cfg.grad_accum_steps / window,
        wait_share=waits.data / (window * steps),
        by_workers=by_workers,
        gpu_util=gpu_util,
        fetch_share=fetch_share,
    )


def samples_per_s_by_workers(splits, cfg: Config, device: torch.device) -> dict[int, float]:
    """The loader alone, samples/s by --num-workers for none, powers of two up to the CPU count and
    the configured one; {} for a loader without workers (in-memory tensors load fastest without)."""
    if cfg.num_workers == 0:
        return {}
    cpus = os.cpu_count() or 1
    rates, counts = {}, sorted({0, cfg.num_workers} | {2**k for k in range(cpus.bit_length())})
    with closing(_phase(len(counts) * SWEEP_BATCHES, "batch", "the loader alone by --num-workers")) as ticks:
        for workers in counts:
            loader, _, sampler = build_loaders(splits, replace(cfg, num_workers=workers), device)
            batches = micro_batches(loader, sampler, TrainState())
            next(batches)  # the workers start
            rates[workers] = cfg.batch_size / time_steps(next, batches, device, SWEEP_BATCHES, ticks)
            batches.close()
            close(loader)
    return rates


def _phase(count: int, unit: str, what: str):
    """The ticks of a timed phase: rank 0 says what it times, then where it is (bar or log line)."""
    if is_main_process():
        print(f"check loader: {what}...", file=sys.stderr, flush=True)
        yield from announced(range(count), "check loader", unit)
    else:
        yield from range(count)


def time_steps(step, batches, device: torch.device, count: int, ticks) -> float:
    """Seconds per call of step(batches) (an optimizer step, or `next` for the loader alone)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in itertools.islice(ticks, count):
        step(batches)
    synchronize(device)
    return (time.perf_counter() - start) / count
