"""Streamed shards against the same shards read from a local folder: a custom streaming project's
`train`, its throughput over the same steps, its first batch after a resume, and the cache's peak
bytes against --cache-size, against a moto S3 server started on localhost (pip install
"moto[server]" s3fs boto3), as tests/test_store.py starts it.

    python benchmarks/streaming.py          # 100,000 examples of 64 floats in 2 MiB shards
    python benchmarks/streaming.py --steps 400 --repeats 3 --cache-size 40MB --shuffle-window 8
    python benchmarks/streaming.py --hidden-dim 1024    # a step long enough to hide the fetches

Each source is trained twice over the same steps, interleaved (local, store, local, store), in a
fresh process and, for the store, a fresh cache: throughput is the examples of the steps after the
first logged one over the time between those step lines, so start-up and the first fetches are
left out of both. The resume runs the same command again, 20 steps further, on a fresh cache (a new
machine): the first batch's time is from the line saying it resumes to the first step's line,
beside one shard's fetch from the store (s3fs, measured here). The cache's bytes are measured
after each fetch, a download in progress included (a sitecustomize wrapping Shards.get, as
tests/test_streaming.py does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scaffold.render import new_project

PACKAGE = "bench"
KEYS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}
MEASURE_CACHE = """
import os
import sys
import time
from pathlib import Path
class Stamped:  # the time of each line, taken as the process writes it (a pipe can bunch them)
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if text.startswith(("resuming from", "step ")):
            with open(os.environ["LINE_LOG"], "a") as log:
                log.write(f"{time.monotonic()} {text.splitlines()[0]}\\n")
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stdout = Stamped(sys.stdout)  # before the package's modules take sys.stdout
from bench.runtime import shards
_get = shards.Shards.get
def get(self, name, local):
    _get(self, name, local)
    held = sum(path.stat().st_size for path in Path(local).parent.iterdir())
    with open(os.environ["CACHE_LOG"], "a") as log:
        log.write(f"{name} {held}\\n")
shards.Shards.get = get
"""
STEP = re.compile(r"^step (\d+)/")


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
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--shard-mb", type=float, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--cache-size", default="12MB")  # the train split is 25 MB
    parser.add_argument("--shuffle-window", default="2")  # shards: two windows must fit the cache
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int)  # the model's width (a longer step); 128 else
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="streaming-bench-") as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, work: Path) -> None:
    project = new_project(work / PACKAGE, {"task": "custom", "streaming": True}, git=False).path
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.examples, args.features)).astype(np.float32)
    y = (x[:, :8].sum(1) > 0).astype(np.int64)
    np.savez(project / "data.npz", x=x, y=y)
    inject = work / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(MEASURE_CACHE)
    with moto_server() as endpoint:
        import boto3
        import s3fs

        boto3.client("s3", endpoint_url=endpoint, **_lower(KEYS)).create_bucket(Bucket="bench")
        env = {
            **os.environ,
            **KEYS,
            "AWS_ENDPOINT_URL": endpoint,
            "PYTHONPATH": f"{inject}{os.pathsep}{project / 'src'}",
            "PYTHONUNBUFFERED": "1",
        }
        sources = {"local": "data/shards", "store": "s3://bench/shards"}
        for source in sources.values():
            said = run(project, env, work / "cache-prepare", "prepare", "--data", "data.npz",
                       "--out", source, "--shard-mb", str(args.shard_mb))  # fmt: skip
            wrote = said["lines"][-1]
        fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=endpoint)
        shard = sorted(p for p in fs.ls("bench/shards") if p.endswith(".npz"))[0]
        fetches = []
        for _ in range(5):
            start = time.perf_counter()
            fs.get(shard, str(work / "one-shard.npz"))
            fetches.append(time.perf_counter() - start)
        fetch = statistics.median(fetches)

        train = ["--max-steps", str(args.steps), "--batch-size", str(args.batch_size)]
        train += ["--log-every", "10", "--cache-size", args.cache_size, "--eval-every", "200"]
        train += ["--shuffle-window", args.shuffle_window]
        train += ["--hidden-dim", str(args.hidden_dim)] if args.hidden_dim else []
        rates: dict[str, list[float]] = {name: [] for name in sources}
        firsts: dict[str, list[float]] = {name: [] for name in sources}
        peaks: dict[str, int] = {name: 0 for name in sources}
        for r in range(args.repeats):
            for name, source in sources.items():
                run_dir = work / f"run-{name}-{r}"
                cache = work / f"cache-{name}-{r}"
                said = run(project, env, cache, "train", "--data", source, "--run-dir", run_dir,
                           *train)  # fmt: skip
                rates[name].append(throughput(said, args.batch_size))
                peaks[name] = max(peaks[name], peak(cache))
                longer = ["--max-steps", str(args.steps + 20), *train[2:4], "--log-every", "1"]
                longer += train[6:]
                resumed = run(project, env, work / f"cache-{name}-{r}-resume", "train", "--data",
                              source, "--run-dir", run_dir, *longer)  # fmt: skip
                firsts[name].append(first_batch(resumed))

    width = f", --hidden-dim {args.hidden_dim}" if args.hidden_dim else ""
    print(f"{wrote}; {args.steps} steps of {args.batch_size}, --cache-size {args.cache_size},"
          f" --shuffle-window {args.shuffle_window}{width}")  # fmt: skip
    print(f"moto S3 server on localhost; one shard's fetch: {fetch * 1000:.0f} ms (median of 5)")
    print(f"{'source':<8} {'examples/s':>22} {'first batch after resume':>26} {'cache peak':>12}")
    for name in sources:
        each = " ".join(f"{v:,.0f}" for v in rates[name])
        first = " ".join(f"{v:.2f}" for v in firsts[name])
        held = f"{peaks[name] / 1e6:.1f} MB" if name == "store" else "(in place)"
        print(f"{name:<8} {each:>22} {first + ' s':>26} {held:>12}")
    ratio = statistics.median(rates["store"]) / statistics.median(rates["local"])
    extra = statistics.median(firsts["store"]) - statistics.median(firsts["local"])
    print(f"store/local throughput: {ratio:.0%} (target >= 90%)")
    print(f"first batch after resume, store less local: {extra:+.2f} s (target <= 1 s + a fetch,"
          f" {1 + fetch:.2f} s)")  # fmt: skip


def _lower(keys: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": keys["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
        "region_name": keys["AWS_DEFAULT_REGION"],
    }


def run(project: Path, env: dict, cache: Path, *args) -> dict:
    """Runs a project command; its resuming and step lines, each with the time it was written
    (any output lines, for prepare)."""
    cache.mkdir(parents=True, exist_ok=True)
    env = {**env, "XDG_CACHE_HOME": str(cache), "CACHE_LOG": str(cache / "held.log")}
    env["LINE_LOG"] = str(cache / "lines.log")
    command = [sys.executable, "-m", PACKAGE, *map(str, args)]
    done = subprocess.run(command, cwd=project, env=env, text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} failed:\n{done.stdout}{done.stderr}")
    stamped = cache / "lines.log"
    lines, times = [], []
    for line in stamped.read_text().splitlines() if stamped.exists() else []:
        when, text = line.split(" ", 1)
        lines.append(text)
        times.append(float(when))
    return {"lines": lines or done.stdout.splitlines(), "times": times}


def throughput(said: dict, batch_size: int) -> float:
    """Examples a second between the first and the last step line."""
    steps = [(int(m[1]), t) for line, t in zip(said["lines"], said["times"], strict=True)
             if (m := STEP.match(line))]  # fmt: skip
    (first, t0), (last, t1) = steps[0], steps[-1]
    return (last - first) * batch_size / (t1 - t0)


def first_batch(said: dict) -> float:
    """Seconds from the line saying the run resumes to its first step line (--log-every 1)."""
    start = next(t for line, t in zip(said["lines"], said["times"], strict=True)
                 if line.startswith("resuming from"))  # fmt: skip
    return next(t for line, t in zip(said["lines"], said["times"], strict=True)
                if STEP.match(line)) - start  # fmt: skip


def peak(cache: Path) -> int:
    log = cache / "held.log"
    if not log.exists():
        return 0
    return max(int(line.split()[1]) for line in log.read_text().splitlines())


if __name__ == "__main__":
    main()
