"""Timing of the data loader alone, a training step alone, and both together (`check loader`)."""

import itertools
import time
from dataclasses import dataclass

import torch

from .config import Config
from .data import load_splits
from .distributed import init_distributed
from .engine import Engine, setup, train_step
from .loader import build_loaders
from .train import TrainState, micro_batches, waited

LOADER_BATCHES = 200  # batches timed when iterating the loader alone
WINDOW_STEPS = 30  # optimizer steps timed with compute alone and with real loading
ROUNDS = 4  # alone, loading and compute are each timed in rounds; the fastest round counts


@dataclass
class LoaderTiming:
    load_per_step: float  # seconds the loader alone takes for one step's micro-batches
    samples_per_s_alone: float  # the loader alone
    step: float  # seconds a training step takes on batches already on the device
    samples_per_s: float  # training with real loading
    wait_share: float  # share of that time spent waiting for the next batch


def time_loader(cfg: Config) -> LoaderTiming:
    device = setup(cfg)
    splits = load_splits(cfg)
    group = init_distributed(device.type)
    loader, _, sampler = build_loaders(splits, cfg, device, group.rank, group.world_size)
    batches = micro_batches(loader, sampler, TrainState())
    for _ in range(10):  # start the workers and fill their queues
        next(batches)
    load_per_batch = min(_time_batches(batches, LOADER_BATCHES // ROUNDS) for _ in range(ROUNDS))

    engine = Engine(cfg, splits, device)

    def step(source):
        return train_step(engine, source, cfg, device)

    on_device = [tuple(t.to(device) for t in next(batches)) for _ in range(cfg.grad_accum_steps)]
    fixed = itertools.cycle(on_device)
    _time_steps(step, fixed, device, 3)  # warm-up (and compilation)
    compute = min(_time_steps(step, fixed, device, WINDOW_STEPS // ROUNDS) for _ in range(ROUNDS))
    waits = [0.0, 0.0]  # waited() adds each batch's wait to waits[0]
    window = _time_steps(step, waited(batches, waits), device, WINDOW_STEPS)
    return LoaderTiming(
        load_per_step=load_per_batch * cfg.grad_accum_steps,
        samples_per_s_alone=cfg.batch_size / load_per_batch,
        step=compute,
        samples_per_s=cfg.batch_size * cfg.grad_accum_steps / window,
        wait_share=waits[0] / (window * WINDOW_STEPS),
    )


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


def _synchronize(device: torch.device) -> None:
    """Waits for queued device work, so that timings measure it (the CPU runs ops in order)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
