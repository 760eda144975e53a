"""Per-rank memory of parameters, gradients and optimizer state under fsdp against ddp.

    python benchmarks/fsdp_memory.py [--nproc 2] [--n-layer 8] [--n-embd 256]

Renders one generation project with distributed=ddp and one with distributed=fsdp, then in each,
under torchrun on the CPU (gloo), builds the project's own Engine for the same GPT, takes one
optimizer step through the project's train_step, and measures on every rank: the bytes of the
tensors the rank holds (its parameter shards or copies, their gradients before zero_grad, AdamW's
moments) and the process's peak resident memory. Both runs go side by side in one invocation.
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

MEASURE = """
import json, resource, sys
import torch
import torch.distributed as dist
from {package}.config import Config
from {package}.data import load_splits
from {package}.runtime.distributed import shutdown
from {package}.runtime.engine import Engine, setup
from {package}.runtime.loader import build_loaders
from {package}.train import train_step

def local(t):
    return t.to_local() if hasattr(t, "to_local") else t

def nbytes(tensors):
    return sum(local(t).numel() * local(t).element_size() for t in tensors)

cfg = Config(n_layer={n_layer}, n_embd={n_embd}, n_head=8, block_size=128, batch_size=4,
             num_workers=0)
device, _ = setup(cfg)
splits = load_splits(cfg)
engine = Engine(cfg, splits, device)
train, _, sampler = build_loaders(splits, cfg, device)
batches = iter(train)
grads = {{}}

def before_zero(optimizer, args, kwargs):  # the gradients, at their peak: after the step
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads["bytes"] = nbytes(p.grad for p in params if p.grad is not None)

engine.optimizer.register_step_post_hook(before_zero)
train_step(engine, batches, cfg, device)
params = nbytes(engine.model.parameters())
state = nbytes(t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
full = sum(p.numel() for p in engine.model.parameters())
mine = {{"params": params, "grads": grads["bytes"], "optimizer": state,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "n_params": full}}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, mine)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(gathered), flush=True)
shutdown()  # the project's: lets gloo's threads finish before the process group goes
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(kind: str, work: Path, args) -> list[dict]:
    project = new_project(
        work / f"mem-{kind}", {"task": "generation", "distributed": kind}, git=False
    ).path
    package = next((project / "src").iterdir()).name
    script = project / "measure.py"
    script.write_text(MEASURE.format(package=package, n_layer=args.n_layer, n_embd=args.n_embd))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
               str(script)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"{kind} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(found[0].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        results = {kind: measure(kind, Path(tmp), args) for kind in ("ddp", "fsdp")}
    n = results["ddp"][0]["n_params"]
    print(
        f"GPT of {n:,} parameters ({args.n_layer} layers, width {args.n_embd}),"
        f" {args.nproc} ranks, fp32, AdamW"
    )
    print(
        f"{'':6}{'rank':>5}{'params MiB':>12}{'grads MiB':>11}{'AdamW MiB':>11}{'sum MiB':>10}"
        f"{'peak RSS MiB':>14}"
    )
    sums = {}
    for kind, ranks in results.items():
        for rank, r in enumerate(ranks):
            total = r["params"] + r["grads"] + r["optimizer"]
            sums.setdefault(kind, []).append(total)
            print(f"{kind:6}{rank:>5}{r['params'] / mib:>12.1f}{r['grads'] / mib:>11.1f}"
                  f"{r['optimizer'] / mib:>11.1f}{total / mib:>10.1f}"
                  f"{r['peak_rss'] / mib:>14.0f}")  # fmt: skip
    rss = {kind: max(r["peak_rss"] for r in ranks) for kind, ranks in results.items()}
    print(f"peak RSS, the largest rank: fsdp / ddp = {rss['fsdp'] / rss['ddp']:.3f} (torch itself,"
          " and the whole model each rank builds before it shards it, included)")  # fmt: skip
    ratio = max(sums["fsdp"]) / max(sums["ddp"])
    print(f"parameters + gradients + optimizer state, the largest rank: fsdp / ddp = {ratio:.3f}"
          f" (1 / {args.nproc} = {1 / args.nproc:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
