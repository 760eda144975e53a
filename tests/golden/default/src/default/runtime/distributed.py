"""Machinery: one process. The loop, the engine and the loader call the functions a multi-process
project calls, so they read the same with one process as with many; here each is the one-process
case: rank 0 of 1, a sum over one process is the value, the model as it is."""

import contextlib
from dataclasses import dataclass

import torch

from ..config import Config, ConfigError

WORKER_START = None  # loader workers start as the platform starts processes (fork on Linux)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    is_main: bool = True


def init_distributed(device_type: str) -> Dist:
    return Dist()


def is_main_process() -> bool:
    return True


def main_only(make):
    """One process: rank 0, so it keeps what rank 0 alone does (the run's records)."""
    return make()


def build(make, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model, built from the global RNG, which setup() seeded, on the device."""
    return make().to(device)


def wrap(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.nn.Module:
    return model


def gradient_sync(forward: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """One process: its gradients are complete after every backward."""
    return contextlib.nullcontext()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return model.state_dict(), optimizer.state_dict()


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def validation_batches(n_examples: int, batch_size: int, group: Dist) -> list[torch.Tensor]:
    return list(torch.arange(n_examples).split(batch_size))


def resharding(saved_world: int, world_size: int, cfg: Config) -> str | None:
    if saved_world != world_size:
        raise ConfigError(f"{cfg.run_dir} holds a checkpoint of {saved_world} processes, not of this project")
    return None


def run_as_processes(processes: int, command) -> int:
    return command()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def any_rank_max(*values: int) -> list[int]:
    return list(values)


def broadcast_buffers(module: torch.nn.Module) -> None:
    """One process: its buffers are the only ones."""


def all_gather(value: object) -> list:
    return [value]


def barrier() -> None:
    """One process: nothing to wait for."""


def shutdown() -> None:
    """One process: no process group to leave."""
