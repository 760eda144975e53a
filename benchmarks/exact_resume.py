"""How far a streaming ddp run resumed at 2, then 1, then 4 processes is from one that never
stopped, with each piece of the exactness on or off: the ordered sums (--deterministic's
gradients, logged loss and validation added in one order: distributed.InRankOrder, step_loss,
validation_batches) and the keyed dropout masks (state.micro_batches).

    PYTHONPATH=. python benchmarks/exact_resume.py

PYTHONPATH=. renders this checkout's templates. Renders a streaming ddp project of the custom task
(dropout 0.1), writes its synthetic data as 8 shards, then for each variant runs 24 steps of 2
processes x 2 micro-batches of 64 uninterrupted, and the chain: SIGTERM after step 7 at 2
processes, after 14 at 1, the rest at 4 (torchrun on the CPU, gloo). Prints the largest absolute
difference of the train and val losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scaffold.render import new_project

PACKAGE = "exact_bench"
ARGS = ["train", "--data", "shards", "--shuffle-window", "2", "--max-steps", "24", "--batch-size",
        "64", "--grad-accum-steps", "2", "--ckpt-every", "100", "--eval-every", "12",
        "--log-every", "1", "--deterministic", "--num-workers", "0"]  # fmt: skip

# Turns pieces off: SUMS_OFF gives the default render's sums, MASKS_OFF each rank's own stream.
SITECUSTOMIZE = """
import contextlib, dataclasses, os, signal, sys
if os.environ.get("SIGTERM_AT"):
    class _Stdout:
        def __init__(self, out):
            self._out = out
        def __getattr__(self, name):
            return getattr(self._out, name)
        def write(self, text):
            if text.startswith("step " + os.environ["SIGTERM_AT"] + "/"):
                os.kill(os.getpid(), signal.SIGTERM)
            return self._out.write(text)
    sys.stdout = _Stdout(sys.stdout)
if os.environ.get("SUMS_OFF"):
    import torch
    from {pkg}.runtime import distributed as d
    _wrap = d.wrap
    d.wrap = lambda m, cfg, device: _wrap(m, dataclasses.replace(cfg, deterministic=False), device)
    d.gradient_sync = lambda forward, last: contextlib.nullcontext() if last else forward.no_sync()
    d.step_loss = lambda losses: sum(losses[1:], start=losses[0])
    d.mean_loss = lambda loss: d.all_reduce_sum(loss) / d.dist.get_world_size()
    d.validation_batches = lambda n, b, g: list(torch.arange(n).split(b))[g.rank :: g.world_size]
if os.environ.get("MASKS_OFF"):
    from {pkg}.runtime import loader, state
    def micro_batches(batches, sampler, state):
        while True:
            sampler.set_epoch(state.epoch, start=state.batch_in_epoch)
            for batch in loader.epoch_batches(batches):
                state.batch_in_epoch += 1
                yield batch
            state.epoch += 1
            state.batch_in_epoch = 0
    state.micro_batches = micro_batches
"""


def train(project: Path, env: dict, run_dir: str, nproc: int, stop_at: int = 0) -> None:
    command = [sys.executable, "-m", f"{PACKAGE}.runtime.launch", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", PACKAGE,
               *ARGS, "--run-dir", run_dir]  # fmt: skip
    env = {**env, "SIGTERM_AT": str(stop_at)} if stop_at else env
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    assert done.returncode == (143 if stop_at else 0), done.stderr[-3000:]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    answers = {"distributed": "ddp", "streaming": True, "task": "custom"}
    project = new_project(Path(tempfile.mkdtemp()) / "exact-bench", answers).path
    (project / "inject").mkdir()
    (project / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE.format(pkg=PACKAGE))
    env = {**os.environ, "PYTHONPATH": f"{project / 'inject'}:{project / 'src'}",
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    prepare = [sys.executable, "-m", PACKAGE, "prepare", "--out", "shards", "--shard-mb", "0.004"]
    subprocess.run(prepare, cwd=project, env=env, check=True, capture_output=True)
    print("largest absolute difference  train loss    val loss")
    for name, off in (("all on", {}), ("ordered sums off", {"SUMS_OFF": "1"}),
                      ("keyed masks off", {"MASKS_OFF": "1"}),
                      ("both off", {"SUMS_OFF": "1", "MASKS_OFF": "1"})):  # fmt: skip
        variant = {**env, **off}
        key = name.replace(" ", "-")
        train(project, variant, f"runs/{key}", 2)
        for nproc, stop_at in ((2, 6), (1, 13), (4, 0)):
            train(project, variant, f"runs/{key}-chain", nproc, stop_at)
        expected, got = records(project / f"runs/{key}"), records(project / f"runs/{key}-chain")
        worst = {
            split: max(abs(a["loss"] - b["loss"]) for a, b in zip(expected, got, strict=True)
                       if a["split"] == split)
            for split in ("train", "val")
        }  # fmt: skip
        print(f"{name:<28} {worst['train']:>11.3g} {worst['val']:>11.3g}")


if __name__ == "__main__":
    main()
