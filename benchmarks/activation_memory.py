"""Activation checkpointing against kept activations: a training step's peak memory and its time.

    python benchmarks/activation_memory.py                      # three GPT sizes, none and fsdp
    python benchmarks/activation_memory.py --sizes 256 --steps 3   # quicker
    python benchmarks/activation_memory.py --startup 1.1         # fsdp's start-up peak, 1.1B params

Renders one generation project with distributed=none and one with distributed=fsdp, then for each
GPT size, with --activation-checkpointing 0 and 1, runs in a fresh process (under torchrun with 2
ranks for fsdp) the project's own Engine and train_step: a first step (the optimizer's state is
made there), then the peak resident memory reset (Linux's /proc/self/clear_refs), then --steps
timed steps. It prints, per rank at its highest, the step's peak above the memory held before it
(on the CPU the host's RSS; on a GPU torch.cuda.max_memory_allocated), the fp32 gradients' share
of it (the rank's shards under fsdp), the rest (the activations kept for the backward pass and
the step's temporaries: what checkpointing cuts) and the median step time. Every configuration
runs side by side in one invocation, so the ratios compare like with like. glibc's mmap threshold
is pinned, so that freed activations go back to the system and a later step's peak is its own.

--startup N builds an N-billion-parameter GPT under fsdp with 2 ranks, the project's way (on the
meta device, each rank making its shards) and the way before it (the whole model on every rank,
then sharded), and prints each rank's peak resident memory from the start to the sharded model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaffold.render import new_project

STEP = """
import json, os, resource, statistics, sys, time
import torch
import torch.distributed as dist
from {package}.config import Config
from {package}.data import load_splits
from {package}.runtime.distributed import shutdown
from {package}.runtime.engine import Engine, setup
from {package}.runtime.loader import build_loaders
from {package}.train import train_step

def rss(field):  # bytes: VmRSS now, VmHWM the peak since the last reset
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

cfg = Config(n_layer={n_layer}, n_embd={n_embd}, n_head={n_head}, block_size={block_size},
             batch_size={batch_size}, num_workers=0, dropout=0.0,
             activation_checkpointing={every}, device="{device}")
device, group = setup(cfg)
splits = load_splits(cfg)
engine = Engine(cfg, splits, device)
train, _, _ = build_loaders(splits, cfg, device, group)
batches = iter(train)
train_step(engine, batches, cfg, device)  # AdamW's moments are made here
cuda = device.type == "cuda"
times, peaks = [], []
for _ in range({steps}):
    if cuda:
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts over from VmRSS
    started = time.perf_counter()
    train_step(engine, batches, cfg, device)
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - started)
    peaks.append((torch.cuda.max_memory_allocated(device) if cuda else rss("VmHWM")) - before)
n_params = sum(p.numel() for p in engine.model.parameters())  # a DTensor's numel is the whole's
mine = {{"peak": max(peaks), "seconds": statistics.median(times), "n_params": n_params}}
gathered = [mine]
if dist.is_initialized():  # fsdp's group; distributed=none has none
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
if group.rank == 0:
    print("RESULT " + json.dumps(gathered), flush=True)
shutdown()
"""

STARTUP = """
import json, resource, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from {package}.config import Config
from {package}.data import load_splits
from {package}.model import build_model
from {package}.runtime.distributed import shard_units, shutdown
from {package}.runtime.engine import Engine, setup

cfg = Config(n_layer={n_layer}, n_embd={n_embd}, n_head=16, block_size=64, batch_size=1,
             num_workers=0, max_train_examples=64)
device, group = setup(cfg)
splits = load_splits(cfg)
if "{build}" == "meta":  # the project's Engine: built on the meta device, each rank its shards
    model = Engine(cfg, splits, device).model
else:  # the whole model built on every rank, then sharded: the project's way until the meta build
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, splits).to(device)
    mesh = init_device_mesh(device.type, (group.world_size,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole's
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
mine = {{"peak_rss": peak, "n_params": n_params}}
gathered = [mine]
if dist.is_initialized():  # fsdp's group; distributed=none has none
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
if group.rank == 0:
    print("RESULT " + json.dumps(gathered), flush=True)
shutdown()
"""

# (n_layer, n_embd, n_head) by width: GPT-2-like shapes scaled to a 2-core machine
SIZES = {256: (6, 256, 8), 512: (8, 512, 8), 768: (12, 768, 12)}


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(project: Path, package: str, script: str, nproc: int) -> list[dict]:
    path = project / "measure.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "MALLOC_MMAP_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}  # fmt: skip
    if nproc == 1:
        command = [sys.executable, str(path)]
    else:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}"]
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        command = [*launch, *rendezvous, str(path)]
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=3600
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{package} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=sorted(SIZES), choices=sorted(SIZES)
    )
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--startup", type=float, metavar="BILLIONS", help="fsdp start-up peak only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        projects = {}
        for kind in ("none", "fsdp"):
            package = f"acmem_{kind}"
            answers = {"task": "generation", "distributed": kind, "device": args.device}
            projects[kind] = (new_project(Path(work) / package, answers, git=False).path, package)
        if args.startup:
            n_embd = 2048
            n_layer = max(1, round(args.startup * 1e9 / (12 * n_embd**2)))
            project, package = projects["fsdp"]
            peaks = {}
            for build in ("full", "meta"):
                script = STARTUP.format(
                    package=package, n_layer=n_layer, n_embd=n_embd, build=build
                )
                ranks = _run(project, package, script, 2)
                peaks[build] = [got["peak_rss"] for got in ranks]
            params = ranks[0]["n_params"]
            print(
                f"fsdp start-up, 2 ranks, GPT of {params / 1e9:.2f}B parameters"
                f" ({n_layer} x {n_embd}), fp32 ({params * 4 / 2**30:.1f} GiB):"
            )
            for rank, (full, meta) in enumerate(zip(peaks["full"], peaks["meta"], strict=True)):
                print(
                    f"  rank {rank}: peak RSS {full / 2**30:.2f} GiB built whole then sharded,"
                    f" {meta / 2**30:.2f} GiB built on the meta device ({meta / full:.2f})"
                )
            return
        memory = "RSS" if args.device == "cpu" else "allocated"
        print(
            "| GPT (layers x width) | parameters | distributed | activation checkpointing |"
            f" step peak above held ({memory}) | of it gradients | activations (the rest) |"
            " step time |"
        )
        print("|---|---:|---|---|---:|---:|---:|---:|")
        for width in args.sizes:
            n_layer, n_embd, n_head = SIZES[width]
            for kind, nproc in (("none", 1), ("fsdp", 2)):
                project, package = projects[kind]
                kept = None
                for every in (0, 1):
                    shape = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head}
                    script = STEP.format(
                        package=package, **shape, block_size=args.block_size,
                        batch_size=args.batch_size, every=every, steps=args.steps,
                        device=args.device,
                    )  # fmt: skip
                    ranks = _run(project, package, script, nproc)
                    peak, seconds = max(r["peak"] for r in ranks), max(r["seconds"] for r in ranks)
                    params = ranks[0]["n_params"]
                    grads = params * 4 / nproc  # fp32 gradients, sharded under fsdp
                    activations = peak - grads
                    mib = f"{peak / 2**20:,.0f} MiB | {grads / 2**20:,.0f} MiB"
                    figures = f"{mib} | {activations / 2**20:,.0f} MiB | {seconds * 1e3:,.0f} ms"
                    if kept:
                        figures = (
                            f"{mib} | {activations / 2**20:,.0f} MiB ({activations / kept[0]:.2f}"
                            f" of kept) | {seconds * 1e3:,.0f} ms ({seconds / kept[1]:.2f} of kept)"
                        )
                    kept = kept or (activations, seconds)
                    where = f"{kind}, 2 ranks" if nproc > 1 else kind
                    print(
                        f"| {n_layer} x {n_embd} | {params / 1e6:.1f}M | {where} |"
                        f" {'every block' if every else 'off'} | {figures} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
