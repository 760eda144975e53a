"""What the checkpoint digest costs: hashing a checkpoint's contents against writing and loading it.

    python benchmarks/checkpoint_digest.py  # a GPT-2-small-sized checkpoint (~124M parameters)
    python benchmarks/checkpoint_digest.py --params 25e6 --repeats 5

Renders the default project (its checkpoint.py, as users get it), builds a payload the shape of a
real one: fp32 weights of --params parameters and AdamW's two moments (so 3 x 4 bytes a parameter),
and times `digest()` (done once on save, once on load) beside `torch.save` and `torch.load` of the
same payload to a temporary file. Prints the median of --repeats, in ms and MB/s.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaffold.render import new_project


def median_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params", type=float, default=124e6, help="model parameters")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = new_project(Path(tmp) / "digest-bench", {}).path
        sys.path.insert(0, str(project / "src"))
        checkpoint = importlib.import_module(next((project / "src").iterdir()).name + ".checkpoint")
        n, width = int(args.params), 768 * 4
        rows = max(1, n // width)
        weights = {f"layer{i}.weight": torch.randn(width, 64) for i in range(rows // 64)}
        moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
                   for k, v in weights.items()}  # fmt: skip
        payload = {"model": weights, "optimizer": {"state": moments}, "state": {"step": 1}}
        size_mb = sum(t.numel() * 4 for t in weights.values()) * 3 / 1e6
        path = Path(tmp) / "ckpt.pt"
        hash_ms = median_ms(lambda: checkpoint.digest(payload), args.repeats)
        save_ms = median_ms(lambda: torch.save(payload, path), args.repeats)
        load_ms = median_ms(lambda: torch.load(path, weights_only=True), args.repeats)
    params = sum(t.numel() for t in weights.values())
    print(f"checkpoint: {params / 1e6:.0f}M parameters + AdamW moments = {size_mb:,.0f} MB")
    rate = size_mb / hash_ms * 1000
    print(f"digest: {hash_ms:,.0f} ms ({rate:,.0f} MB/s), done on save and on load")
    print(f"torch.save: {save_ms:,.0f} ms; torch.load: {load_ms:,.0f} ms (page cache warm)")
    print(f"digest / (save + load): {2 * hash_ms / (save_ms + load_ms):.0%}")


if __name__ == "__main__":
    main()
