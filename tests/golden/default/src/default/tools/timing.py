"""Tool: timing of the data loader alone, a training step alone, and both together (`check loader`)."""

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from ..config import Config
from ..data import load_splits
from ..runtime.device import sample_utilization, synchronize
from ..runtime.engine import Engine, setup
from ..runtime.loader import build_loaders, close
from ..runtime.state import TrainState, Waits, micro_batches, waited
from ..train import train_step

LOADER_BATCHES = 200  # batches timed when iterating the loader alone
WINDOW_STEPS = 30  # optimizer steps timed with compute alone and with real loading
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


def fresh_training(cfg: Config):
    """The device, the data, a fresh engine and its endless training batches, built as `train`
    builds them, for the tools that time or sweep training steps (no run folder is written)."""
    device, _ = setup(cfg)
    splits = load_splits(cfg)
    loader, _, sampler = build_loaders(splits, cfg, device)
    return device, splits, Engine(cfg, splits, device), micro_batches(loader, sampler, TrainState())


def seconds_each(run: Callable[[], object], count: int, device: torch.device) -> float:
    """Seconds per call of `run` over `count` calls, the device's queued work waited for at both ends."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(count):
        run()
    synchronize(device)
    return (time.perf_counter() - start) / count


def time_loader(cfg: Config) -> LoaderTiming:
    device, splits, engine, batches = fresh_training(cfg)
    for _ in range(10):  # start the workers and fill their queues
        next(batches)
    draw = partial(next, batches)
    load_per_batch = min(seconds_each(draw, LOADER_BATCHES // ROUNDS, device) for _ in range(ROUNDS))
    by_workers = samples_per_s_by_workers(splits, cfg, device)

    def steps(source, count: int) -> float:
        return seconds_each(lambda: train_step(engine, source, cfg, device), count, device)

    on_device = [tuple(t.to(device) for t in next(batches)) for _ in range(cfg.grad_accum_steps)]
    fixed = itertools.cycle(on_device)
    steps(fixed, 3)  # warm-up
    compute = min(steps(fixed, WINDOW_STEPS // ROUNDS) for _ in range(ROUNDS))
    waits = Waits()  # waited() adds each batch's wait to waits.data
    window, gpu_util = sample_utilization(device, lambda: steps(waited(batches, waits), WINDOW_STEPS))
    return LoaderTiming(
        load_per_step=load_per_batch * cfg.grad_accum_steps,
        samples_per_s_alone=cfg.batch_size / load_per_batch,
        step=compute,
        samples_per_s=cfg.batch_size * cfg.grad_accum_steps / window,
        wait_share=waits.data / (window * WINDOW_STEPS),
        by_workers=by_workers,
        gpu_util=gpu_util,
    )


def samples_per_s_by_workers(splits, cfg: Config, device: torch.device) -> dict[int, float]:
    """The loader alone with no workers, powers of two up to the CPU count and the configured number:
    samples/s by --num-workers. Tried only when the loader uses workers (a loader of in-memory
    tensors is fastest without: {} then)."""
    if cfg.num_workers == 0:
        return {}
    cpus = os.cpu_count() or 1
    rates = {}
    for workers in sorted({0, cfg.num_workers} | {2**k for k in range(cpus.bit_length())}):
        loader, _, sampler = build_loaders(splits, replace(cfg, num_workers=workers), device)
        batches = micro_batches(loader, sampler, TrainState())
        next(batches)  # the workers start
        rates[workers] = cfg.batch_size / seconds_each(partial(next, batches), SWEEP_BATCHES, device)
        batches.close()
        close(loader)
    return rates
