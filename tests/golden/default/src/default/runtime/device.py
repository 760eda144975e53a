"""Machinery: the CPU, this project's device: what the set-up, the timings and the profiler ask
of a device. On a CPU ops run in order, and no utilisation or peak FLOP/s is read."""

import torch


def configure(deterministic: bool) -> None:
    if deterministic:  # bit-exact runs
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # CPU reductions then add in one fixed order


def synchronize(device: torch.device) -> None:
    """Nothing to wait for: ops run in order, so a timing already holds them."""


def sample_utilization(device: torch.device, timed) -> tuple:
    return timed(), "n/a"  # timed()'s result, and no utilisation: a CPU reports none


def mfu(achieved: float, device: torch.device, precision: str) -> str:
    return ""  # a peak to compare with is known for GPUs only


def profiler_view(device: torch.device) -> tuple[list, str]:
    return [torch.profiler.ProfilerActivity.CPU], "self_cpu_time_total"  # activities, sort column
