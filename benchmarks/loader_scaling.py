"""Loader throughput of the default project against --num-workers, and its `check loader` share.

    python benchmarks/loader_scaling.py
    python benchmarks/loader_scaling.py --workers 0 1 2 4 8 --batches 1000 --check-runs 5

Renders the default project (cpu, fp32) into a temporary folder and iterates its own training
loader (`build_loaders`, through `micro_batches`, as `train()` does) with nothing else running:
samples per second, best of --rounds rounds, for each worker count. Then runs the project's
`python -m <pkg> check loader` at its default settings --check-runs times and prints the
data-loader time share it measured (the figure of the summary's **Throughput:** line).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from scaffold.check import check_command
from scaffold.render import new_project

SHARE = re.compile(r"([\d.]+)% of the time waiting for data")
TARGET_SHARE = 5.0  # percent


def loader_throughput(train, cfg, batches: int, rounds: int, splits=None) -> float:
    """Samples per second drawn from the project's training loader alone (best round); `splits`
    are loaded from cfg unless given."""
    splits = splits or train.load_splits(cfg)
    loader, _, sampler = train.build_loaders(splits, cfg, torch.device(cfg.device))
    stream = train.micro_batches(loader, sampler, train.TrainState())
    for _ in range(max(20, 2 * cfg.num_workers)):  # start the workers and fill their queues
        next(stream)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(batches):
            next(stream)
        best = max(best, batches * cfg.batch_size / (time.perf_counter() - start))
    stream.close()
    del stream, loader  # shuts persistent workers down
    return best


def check_loader_share(project: Path) -> tuple[float, str]:
    """The data-loader time share (%) from one `check loader` run, and its line."""
    command = [*check_command(project)[:-1], "loader"]
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    ran = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in ran.stdout.splitlines() if x.startswith("loader:")), ran.stderr.strip())
    found = SHARE.search(line)
    if not found:
        raise SystemExit(f"error: no share in the output of {' '.join(command)}: {line}")
    return float(found.group(1)), line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batches", type=int, default=500, help="batches a round (default: 500)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, best counts (default: 3)")
    parser.add_argument("--check-runs", type=int, default=5, help="check loader runs (default: 5)")
    args = parser.parse_args(argv)
    # More workers than CPUs is part of what is measured here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    with tempfile.TemporaryDirectory() as tmp:
        answers = {"device": "cpu", "precision": "fp32", "compile": False}
        project = new_project(Path(tmp) / "loader-probe", answers, git=False).path
        package = next((project / "src").glob("*/__main__.py")).parent.name
        sys.path.insert(0, str(project / "src"))
        config = importlib.import_module(f"{package}.config")
        train = importlib.import_module(f"{package}.train")
        base = config.Config(device="cpu")
        print(
            f"default project loader: batch {base.batch_size}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}; {args.rounds} rounds of {args.batches} batches, best round"
        )
        print()
        print("| --num-workers | samples/s | vs 0 workers |")
        print("| ---: | ---: | ---: |")
        first = None
        for workers in args.workers:
            cfg = replace(base, num_workers=workers)
            rate = loader_throughput(train, cfg, args.batches, args.rounds)
            first = first or rate
            print(f"| {workers} | {rate:,.0f} | {rate / first:.2f}x |", flush=True)

        print()
        defaults = f"num_workers={base.num_workers}"
        print(f"`check loader` at the defaults ({defaults}), {args.check_runs} runs")
        shares = []
        for _ in range(args.check_runs):
            share, line = check_loader_share(project)
            shares.append(share)
            print(f"  {line}", flush=True)
    median = statistics.median(shares)
    print()
    print(
        f"data-loader time share: median {median:.1f}% "
        f"(min {min(shares):.1f}%, max {max(shares):.1f}%); "
        f"under {TARGET_SHARE:.0f}%: {'yes' if median < TARGET_SHARE else 'NO'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
