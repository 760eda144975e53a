"""How long a checkpoint stalls the training loop on an object store: upload in the background
(what `--run-dir s3://...` does) against a synchronous upload, beside a local run folder.

    python benchmarks/store_upload.py  # the default model's size and ~100M parameters
    python benchmarks/store_upload.py --params 72e3 --repeats 5

Renders the default project and uses its runtime/checkpoint.py and runtime/store.py as users get
them, against a moto S3 server started on localhost (pip install "moto[server]" s3fs). The payload
has the shape of a real checkpoint: fp32 weights of --params parameters and AdamW's two moments.
For each size it times, median of --repeats, what the loop waits for at a checkpoint:
  local:       the atomic local save (torch.save, fsync, rename), as in a local --run-dir
  background:  that save, then push() returning with the upload started (the loop goes on)
  synchronous: that save, then the upload waited for (push() then wait())
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaffold.render import new_project

DEFAULT_PARAMS = 72_196  # the default classification MLP's trainable parameters


def payload(params: int) -> dict:
    """A checkpoint's shape: the weights and AdamW's two moments, in 1M-element tensors."""
    sizes = [1 << 20] * (params >> 20) + ([params % (1 << 20)] if params % (1 << 20) else [])
    weights = {f"w{i}": torch.randn(n) for i, n in enumerate(sizes)}
    moments = {
        i: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)} for i, n in enumerate(sizes)
    }
    return {
        "model": weights,
        "optimizer": {"state": moments, "param_groups": []},
        "scheduler": {},
        "state": {"step": 0},
        "rng": [],
        "config": {},
        "data": {},
    }


@contextlib.contextmanager
def moto_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params", type=float, nargs="+", default=[DEFAULT_PARAMS, 100e6])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, work: Path) -> None:
    """Renders the project in `work`, stages the runs there and prints the table."""
    project = new_project(work / "bench", {}).path
    sys.path.insert(0, str(project / "src"))
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")
    checkpoint = importlib.import_module("bench.runtime.checkpoint")
    store_module = importlib.import_module("bench.runtime.store")
    with moto_server() as endpoint:
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        print(f"stall at a checkpoint, median of {args.repeats} (moto S3 server on localhost)")
        columns = ("parameters", 12), ("checkpoint", 11), ("local", 9), ("background", 11)
        print(" ".join(f"{name:>{width}}" for name, width in columns), f"{'synchronous':>12}")
        for n, params in enumerate(int(p) for p in args.params):
            store = store_module.RunStore(f"s3://bench/run{n}", keep_last=1)
            store.fs.makedirs("bench", exist_ok=True)
            store.pull()
            for name in ("run.json", "metrics.jsonl"):
                (store.local / name).write_text("{}\n")
            saver = checkpoint.CheckpointDir(store.local / "checkpoints", keep_last=1)
            data = payload(params)
            times = {"local": [], "background": [], "synchronous": []}
            step = 0
            for _ in range(args.repeats):
                for kind in times:
                    step += 1
                    start = time.perf_counter()
                    saver.save(data, step)
                    if kind != "local":
                        store.push(step)
                    if kind == "synchronous":
                        store.wait()
                    times[kind].append(time.perf_counter() - start)
                    store.wait()  # the next checkpoint starts with no upload in flight
            size = (store.local / "checkpoints" / checkpoint.step_name(step)).stat().st_size
            medians = {kind: statistics.median(t) * 1000 for kind, t in times.items()}
            print(
                f"{params:>12,} {size / 1e6:>9.1f}MB {medians['local']:>7.0f}ms"
                f" {medians['background']:>9.0f}ms {medians['synchronous']:>10.0f}ms"
            )
            store.close()
            del data


if __name__ == "__main__":
    main()
