"""The image task's loader: samples/s by worker count against Pillow's own decode rate.

    python benchmarks/image_loader.py
    python benchmarks/image_loader.py --data /tmp/digits --image-size 32 --workers 0 1 2 4

Renders an image project (cpu, fp32) into a temporary folder. First the physical limit: one
core decoding and augmenting training images through the project's own `ImageDataset`
(Pillow open, convert, random resized crop, flip, to tensor) with nothing else around, in
samples/s; `workers x` that rate is what N worker processes could reach at best on N free cores.
Then the project's training loader (`build_loaders`, through `micro_batches`, as `train()`
iterates it) for each worker count, best of --rounds rounds. Last, the data-loader time share
that `check loader` reports for the default model (--check-runs runs).
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
from loader_scaling import loader_throughput  # benchmarks/, this script's folder

from scaffold.render import new_project

SHARE = re.compile(r"([\d.]+)% of the time waiting for data")


def decode_rate(dataset, n: int) -> float:
    """Samples/s of `dataset[i]` in this process, one thread: decode and augmentation alone."""
    torch.set_num_threads(1)
    n = min(n, len(dataset))
    start = time.perf_counter()
    for i in range(n):
        dataset[i]
    return n / (time.perf_counter() - start)


def check_loader_line(project: Path, package: str, extra: list[str]) -> str:
    command = [sys.executable, "-m", package, "check", "loader", "--device", "cpu", *extra]
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    ran = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, check=False)
    return next((x for x in ran.stdout.splitlines() if x.startswith("loader:")), ran.stderr.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=None, help="an image folder or manifest (default: synthetic)"
    )
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batches", type=int, default=40, help="batches a round (default: 40)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, best counts (default: 3)")
    parser.add_argument("--decode", type=int, default=400, help="images decoded on one core")
    parser.add_argument("--check-runs", type=int, default=3, help="check loader runs (default: 3)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # measured on purpose

    with tempfile.TemporaryDirectory() as tmp:
        answers = {"task": "image", "device": "cpu", "precision": "fp32", "compile": False}
        project = new_project(Path(tmp) / "image-probe", answers, git=False).path
        package = next((project / "src").glob("*/__main__.py")).parent.name
        sys.path.insert(0, str(project / "src"))
        config = importlib.import_module(f"{package}.config")
        data = importlib.import_module(f"{package}.data")
        train = importlib.import_module(f"{package}.train")
        base = config.Config(device="cpu", data=args.data, image_size=args.image_size)
        splits = data.load_splits(base)
        threads = torch.get_num_threads()
        one_core = decode_rate(splits.train, args.decode)
        torch.set_num_threads(threads)
        print(
            f"image loader: {splits.source}, {len(splits.train):,} train images, "
            f"{args.image_size} px, "
            f"batch {base.batch_size}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        )
        print(f"Pillow decode + augmentation on one core: {one_core:,.0f} samples/s")
        print()
        print("| --num-workers | loader samples/s | one core x workers | share of that limit |")
        print("| ---: | ---: | ---: | ---: |")
        for workers in args.workers:
            cfg = replace(base, num_workers=workers)
            rate = loader_throughput(train, cfg, args.batches, args.rounds, splits)
            limit = one_core * max(1, workers)
            print(f"| {workers} | {rate:,.0f} | {limit:,.0f} | {rate / limit:.0%} |", flush=True)

        print()
        extra = [] if args.data is None else ["--data", args.data]
        extra += ["--image-size", str(args.image_size)]
        print(
            f"`check loader`, default model and loader (num_workers={base.num_workers}), "
            f"{args.check_runs} runs"
        )
        shares = []
        for _ in range(args.check_runs):
            line = check_loader_line(project, package, extra)
            found = SHARE.search(line)
            shares += [float(found.group(1))] if found else []
            print(f"  {line}", flush=True)
    if shares:
        print(
            f"\ndata-loader time share: median {statistics.median(shares):.1f}% "
            f"({min(shares):.1f}-{max(shares):.1f}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
