"""What an epoch's sample order costs: the loader's keyed Feistel permutation (loader.Shuffle),
worked out a few batches at a time, against the array of every index that np.random's
permutation builds (the loader's order before it), for a prepared corpus's n windows.

    PYTHONPATH=. python benchmarks/epoch_order.py --n 100000000 --batches 2000

PYTHONPATH=. renders this checkout's templates. Renders a generation project, then, in a fresh
process each, times the first --batches batches of 256 of one epoch both ways and prints the
time and the peak memory numpy allocated (tracemalloc).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scaffold.render import new_project

VARIANT = """
import time, tracemalloc, numpy as np, torch
from {pkg}.runtime.loader import EpochBatches
n, batches = {n}, {batches}
tracemalloc.start()
start = time.perf_counter()
if {shuffle}:
    sampler = EpochBatches(n, 256, seed=0)
    for _, (_, indices) in zip(range(batches), sampler):
        pass
else:
    order = torch.from_numpy(np.random.default_rng([0, 0]).permutation(n))
    for b in range(batches):
        indices = order[b * 256 : (b + 1) * 256]
seconds = time.perf_counter() - start
peak = tracemalloc.get_traced_memory()[1] / 1e6
print(f"{{seconds * 1000:,.0f}} ms, {{peak:,.1f}} MB peak")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=100_000_000, help="examples (windows) an epoch")
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = new_project(Path(tmp) / "order", {"task": "generation", "device": "cpu"}).path
        package = next((project / "src").iterdir()).name
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        print(f"n = {args.n:,} examples, the first {args.batches:,} batches of 256")
        for shuffle in (True, False):
            code = VARIANT.format(pkg=package, n=args.n, batches=args.batches, shuffle=shuffle)
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True
            )
            result = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
            name = "Shuffle (keyed Feistel)" if shuffle else "np.random permutation"
            print(f"{name:24}: {result}")


if __name__ == "__main__":
    main()
