"""Machinery: fully sharded data parallel (FSDP2): one process per GPU, started by torchrun.

    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --max-restarts 3 -m everything train
    python -m everything train  # one plain process: a group of one

The scripts/ folder has the single-node, multi-node and SLURM launchers. The loop, the engine and
the loader call only the functions below for what differs between one process and many.
Each rank trains on its own slice of every global batch. Each rank holds 1/N of every parameter,
gradient and optimizer state (wrap shards the model): a block's full weights are gathered for
its forward and backward only, and gradients are reduce-scattered to their shards. Rank 0 alone
writes run.json and metrics.jsonl; every rank writes its shards of each checkpoint (checkpoint.py).
"""

import contextlib
import ctypes
import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..config import Config, ConfigError
from . import sharding

# ShardedGradScaler's overflow flag has shape (1,), which DTensor warns of at each process's first
# unscale beside sharded gradients; the flag is all-reduced over the ranks as it should be.
warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1", UserWarning)


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
        stop_with_launcher()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if device_type == "cuda":
            gpus = torch.cuda.device_count()
            if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > gpus:  # `check all`'s 2 on one GPU
                backend = "gloo"  # ranks share the GPUs: NCCL refuses two ranks on one GPU
            torch.cuda.set_device(local_rank % max(gpus, 1))
        dist.init_process_group(backend, store=_group_store(), rank=rank, world_size=world_size)
    else:
        rank, world_size, local_rank = 0, 1, 0
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(rank, world_size, local_rank)


# Loader workers start from a server process, not forked from this one: the process group's threads
# take Python's thread-state lock, and a fork while one held it deadlocked the worker for good
# (CPython gh-112275, in 3.11.7 and before: a validation's loader never started, in 2 of 2 CI runs).
# The server imports what a worker unpickles (the data module, runtime/loader.py, torch) once: each
# worker then starts without importing them (the loader's imports took an fsdp worker 0.8 s).
WORKER_START = multiprocessing.get_context("forkserver")
PROJECT = __package__.rpartition(".")[0]  # the package above runtime/
WORKER_START.set_forkserver_preload([f"{PROJECT}.data_shards", f"{PROJECT}.runtime.loader"])
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h): a signal for when the parent dies
LAUNCHER_ENDED = threading.Lock()  # taken by the first of the launcher's death signals


def stop_with_launcher() -> None:
    """Has Linux send this worker SIGHUP when torchrun, its parent, dies by any signal (a kill -9
    of the launch script too): it then stops as on SIGTERM, with a checkpoint, rather than train on
    alone in the session torchrun gave it, holding the run folder. Not on other systems."""
    if sys.platform != "linux":
        return
    launcher = os.getppid()
    signal.signal(signal.SIGHUP, _launcher_ended)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != launcher:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGHUP)


def _launcher_ended(signum: int, frame) -> None:
    """Stops this worker as SIGTERM does, once: Linux sends the signal again each time the dying
    launcher's thread that is its parent ends and another takes its place, a second SIGTERM would
    abort the stop, and a repeat can run this inside itself before its first line: the lock lets one."""
    if not LAUNCHER_ENDED.acquire(blocking=False):
        return
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if is_main_process():
        print("the launcher ended: stopping after this step", file=sys.stderr, flush=True)
    signal.raise_signal(signal.SIGTERM)


# What a restart would meet again, as a failure's line says it: a full disk (or quota), a read-only one.
LASTING = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))


def tell_launcher(line: str, lost_a_rank: bool = False) -> None:
    """Leaves this worker's last line where torchrun's agent reads it when the worker exits
    (TORCHELASTIC_ERROR_FILE): the launcher (runtime/launch.py) names it when the job ends, and
    restarts no worker for a `lasting` failure, one the line says a restart would meet again."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        record = {
            "message": line,
            "timestamp": int(time.time()),
            "lost_a_rank": lost_a_rank,
            "lasting": any(reason in line for reason in LASTING),
        }
        Path(path).write_text(json.dumps(record), encoding="utf-8")


def report_failure(line: str) -> None:
    """A refusal or failure of this rank, in one line: rank 0 prints it for all, every rank tells
    the launcher. The others wait a moment before they exit: rank 0, which mostly fails the same
    way, then ends first, so the launcher's SIGTERM to the rest cannot cut its line short."""
    tell_launcher(line)
    if is_main_process():
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(1)


def leave_with_the_group() -> int:
    """For a rank whose collective failed as another rank ended: tells the launcher so, quietly
    (the rank that ended says why), and waits a moment before it exits with 1, so that the launcher
    sees that rank end first (and stops this one meanwhile)."""
    tell_launcher("stopped: another rank ended, and with it the process group", lost_a_rank=True)
    time.sleep(3)
    return 1


def lost_a_rank(error: Exception) -> bool:
    """Whether `error` is a collective's that failed because another rank's process ended
    (gloo's "Connection closed by peer", or a broken connection to the group's store)."""
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError) and "/gloo/transport/" in str(error)
    )


def is_main_process() -> bool:
    """Rank 0, or a plain process: known from torchrun's environment, before any group is joined."""
    return os.environ.get("RANK", "0") == "0"


def main_only(make):
    """make() on rank 0, which alone keeps what is written once for the job (the run's records);
    the other ranks get a stand-in whose every method does nothing."""
    return make() if is_main_process() else _Silent()


class _Silent:
    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


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


def any_rank_max(*values: int) -> list[int]:
    """Each value's maximum over the ranks (a stop signal's number, a checkpoint due), read on the host.

    One small all-reduce a step, so that every rank stops and checkpoints at the same step; on a
    CPU (gloo) group, so the GPU never waits for it.
    """
    found = torch.tensor(values)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=_host_group())
    return found.tolist()


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. FSDP shards parameters,
    not buffers: each rank updates its own copy, so the ranks' statistics drift apart in training;
    before a validation they become rank 0's, the ones its checkpoints hold, so every rank
    evaluates one model, the same after a resume as without one."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def load_whole_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """--init-from's weights, whole on rank 0 (`state`, which weights.py checked; {} on the others),
    into every rank's shards: sent tensor by tensor, so no rank holds a second whole copy.
    The keys it leaves out (a head kept freshly initialised) keep each rank's values."""
    for module in model.modules():  # a forward leaves the root's parameters whole, kept for its backward
        if isinstance(module, FSDPModule):
            module.reshard()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)


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

    A gloo worker thread frees the tensors of the last collective after the collective has
    returned, and needs the GIL to do so. If it gets the GIL only as the interpreter exits, the
    process aborts ("terminate called without an active exception", seen in a core dump: a
    pt_gloo_runloop thread in ~AsyncAllgatherCoalescedWork, exiting in take_gil). The threads
    outlive destroy_process_group where a DeviceMesh or a DTensor still holds the group (fsdp),
    so they cannot be joined here. Sleeping hands the GIL over first: 7 of 16 `check overfit`
    runs of a 2-process project aborted without it, 0 of 16 with it; of 4-process fsdp scripts,
    4 of 44 without, 0 of 20 with.
    """
    if dist.is_initialized():
        time.sleep(0.1)
        dist.destroy_process_group()


def run_as_processes(processes: int, command) -> int:
    """command()'s exit status on every rank inside torchrun; outside it, that of this very command
    run again under torchrun (runtime/launch.py) as `processes` processes, with a c10d rendezvous
    on this machine. Its store binds port 0 (a free one, as torchrun's --standalone): a port probed
    free beforehand can be taken by another job before torchrun binds it, and torchrun then joins
    that job's rendezvous and waits out its 600 s timeout."""
    if "RANK" in os.environ:
        return command()
    command = [
        sys.executable, "-m", f"{PROJECT}.runtime.launch", "--nnodes", "1",
        "--nproc-per-node", str(processes), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0", "-m", PROJECT, *sys.argv[1:],
    ]  # fmt: skip
    return subprocess.run(command).returncode


def build(make, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model on the meta device, which holds no values (sharding.record): wrap() shards it, then
    each rank makes its own shards alone (materialize), with the very values make() gives from
    cfg.seed in one process."""
    return sharding.record(make)


def wrap(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model sharded by FSDP2, in place: each of sharding.shard_units(model) is one unit whose
    parameters are gathered for its forward and backward only, the root holds the rest; with
    --compile each unit's training forward is compiled, FSDP's gathers staying outside the graphs."""
    mesh = init_device_mesh(device.type, (init_distributed(device.type).world_size,))
    # fp16 weights gathered for compute, gradients reduced in fp32 into the fp32 shards.
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    batch_norms = torch.nn.BatchNorm1d | torch.nn.BatchNorm2d | torch.nn.BatchNorm3d
    for norm in (m for m in model.modules() if isinstance(m, batch_norms)):
        fully_shard(norm, mesh=mesh)  # fp32 weights, as its running statistics: batch_norm wants one dtype
    for unit in (u for u in sharding.shard_units(model) if not isinstance(u, batch_norms)):
        if cfg.compile:
            unit.forward = sharding.compiled_for_training(unit)
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sharding.materialize(model, cfg, device)
    return model


def gradient_sync(forward: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """FSDP reduce-scatters gradients to their shards once, after the step's last micro-batch."""
    forward.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def step_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss: its micro-batches' shares added (sum() would add a 0 first)."""
    return sum(losses[1:], start=losses[0])


def mean_loss(loss: torch.Tensor) -> torch.Tensor:
    """The step's loss over every rank's examples (a host sync: logging steps only)."""
    return all_reduce_sum(loss) / dist.get_world_size()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm).full_tensor()  # over every shard


def grad_scaler(device: torch.device) -> ShardedGradScaler:
    return ShardedGradScaler(device.type)  # every rank skips a step if any shard overflowed


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's shards (DTensors keyed by parameter name, which any number of processes can
    load: checkpoint.py)."""
    return get_state_dict(model, optimizer)


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    # not strict: a --freeze parameter has no optimizer state before the unfreeze step; the model's
    # keys and shapes are the checkpoint's (checkpoint.py checks them)
    loose = StateDictOptions(strict=False)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=loose
    )


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of sharded tensors (DTensors), as plain tensors (foreach kernels take them)."""
    return [t.to_local() for t in tensors]


def validation_batches(n_examples: int, batch_size: int, group: Dist) -> list[torch.Tensor]:
    """This rank's validation batches: every rank as many (each forward gathers the shards, so a
    rank with a batch more would wait for the others forever), of near-equal size, at most
    batch_size; together they cover every example once."""
    if n_examples < group.world_size:
        raise ConfigError(f"{n_examples} validation examples for {group.world_size} ranks: each needs one")
    n_batches = -(-n_examples // (batch_size * group.world_size)) * group.world_size
    n_batches = min(n_batches, n_examples // group.world_size * group.world_size)  # none of them empty
    return list(torch.arange(n_examples).tensor_split(n_batches))[group.rank :: group.world_size]


def resharding(saved_world: int, world_size: int, cfg: Config) -> str | None:
    """What a resume on another number of processes keeps: the model and optimizer reshard."""
    if saved_world == world_size:
        return None
    return (
        f"{cfg.run_dir} was trained by {saved_world} processes, resumed by {world_size}: the model and"
        f" optimizer are resharded exactly; the global batch stays the run's, {world_size} x"
        f" {cfg.grad_accum_steps} micro-batches of {cfg.batch_size} a step, and so do its examples and"
        " dropout masks (see README: Distributed training)"
    )
