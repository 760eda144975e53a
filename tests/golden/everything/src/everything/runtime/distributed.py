"""Machinery: Fully sharded data parallel (FSDP2): one process per GPU, started by torchrun.

    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --max-restarts 3 -m everything train
    python -m everything train  # one plain process: a group of one

The scripts/ folder has the single-node, multi-node and SLURM launchers. Each rank trains on its
own slice of every global batch. Each rank holds 1/N of every parameter, gradient and optimizer
state (engine.wrap shards the model): a block's full weights are gathered for its forward and
backward only, and gradients are reduce-scattered to their shards. Rank 0 alone writes run.json
and metrics.jsonl; every rank writes its shards of each checkpoint (checkpoint.py).
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> Dist:
    """Joins the torchrun process group, or makes a group of one for a plain process."""
    if dist.is_initialized():  # a check runs train() more than once in a process
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:  # started by torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=_group_store(), rank=rank, world_size=world_size)
    else:
        rank, world_size, local_rank = 0, 1, 0
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(rank, world_size, local_rank)


def _group_store() -> dist.Store:
    """torchrun's store, with keys of their own for each restart of a one-node group.

    torchrun keeps one store for all its restarts: a restarted group would read the addresses the
    dead group left there, dial a closed port and fail ("Gloo connectFullMesh failed ... Connection
    refused"). On one node all workers share one restart count, which prefixes their keys. Across
    nodes the counts can differ, so the launch scripts set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    torchrun then starts a new store for every restart.
    """
    store, _, _ = next(dist.rendezvous("env://"))
    if os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        return dist.PrefixStore(f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sums `tensor` over all ranks, in place (a host sync: only on logging steps)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank_max(value: int) -> int:
    """The largest of every rank's `value` (a stop signal's number, or 0), read on the host.

    One small all-reduce a step, so that every rank stops at the same step; on a CPU (gloo)
    group, so the GPU never waits for it.
    """
    found = torch.tensor([value])
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=_host_group())
    return int(found[0])


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. FSDP shards parameters,
    not buffers: each rank updates its own copy, so the ranks' statistics drift apart in training;
    before a validation they become rank 0's, the ones its checkpoints hold, so every rank
    evaluates one model, the same after a resume as without one."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def all_gather(value: object) -> list:
    """Every rank's `value`, in rank order (RNG states for a checkpoint, say)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


_HOST_GROUP: list = []


def _host_group():
    """A gloo group beside NCCL's, for the stop flag: NCCL reduces only GPU tensors."""
    if dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def barrier() -> None:
    dist.barrier()


def shutdown() -> None:
    """Leaves the process group, after a pause that lets gloo's threads finish.

    A gloo thread frees the tensors of the last collective, and needs the GIL to do so. If it gets
    the GIL only as the interpreter exits, the process aborts ("terminate called without an
    active exception"): 7 of 16 `check overfit` runs of a 2-process project did. Sleeping hands
    the GIL over first (0 of 16).
    """
    if dist.is_initialized():
        time.sleep(0.1)
        dist.destroy_process_group()
