"""Streamed data (the `streaming` answer): `prepare` writes shards with an index, `train --data`
reads them from a folder in place or from a store (moto's S3 server, as tests/test_store.py starts
it) through a bounded cache. The order is a permutation each epoch and the same global batches at
any number of ranks; a run from a folder, from a URL, killed and resumed, or stopped by an outage
and resumed, writes the same records; each fault is one line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from test_project import _command, _env, render
from test_store import KEYS, Proxy, moto_server, s3_keys

PACKAGE = "streamed"
RUN = (
    "--batch-size", "64", "--max-steps", "60", "--log-every", "1", "--ckpt-every", "10",
    "--eval-every", "20", "--deterministic", "--shuffle-window", "2", "--num-workers", "1",
)  # fmt: skip
SHARD_MB = "0.004"  # the example's 3,686 training pairs in 8 shards of about 4 KB
# Records the cache folder's bytes (a download in progress included) after each shard's download.
MEASURE_CACHE = """
import os
from pathlib import Path
from streamed.runtime import shards
_get = shards.Shards.get
def get(self, name, local):
    _get(self, name, local)
    held = sum(path.stat().st_size for path in Path(local).parent.iterdir())
    with open(os.environ["CACHE_LOG"], "a") as log:
        log.write(f"{name} {held}\\n")
shards.Shards.get = get
"""
# Damages the first download of DAMAGE_ONCE: the digest check must fetch it again.
DAMAGE_ONCE = """
import os
from streamed.runtime import shards
_get, damaged = shards.Shards.get, set()
def get(self, name, local):
    _get(self, name, local)
    if name == os.environ["DAMAGE_ONCE"] and name not in damaged:
        damaged.add(name)
        local.write_bytes(b"x" * local.stat().st_size)
shards.Shards.get = get
"""
# A store 0.3 s slower to answer each fetch.
SLOW_STORE = """
import time
from streamed.runtime import shards
_get = shards.Shards.get
def get(self, name, local):
    time.sleep(0.3)
    _get(self, name, local)
shards.Shards.get = get
"""
# Reads each batch 0.2 s slower, so the cached windows outlast a short --fetch-retry-minutes.
SLOW_READS = """
import time
from streamed.runtime import shards
_getitems = shards.ShardedSplit.__getitems__
def getitems(self, ids):
    time.sleep(0.2)
    return _getitems(self, ids)
shards.ShardedSplit.__getitems__ = getitems
"""


@pytest.fixture(autouse=True)
def _s3_libraries():
    for name in ("boto3", "s3fs", "moto"):
        pytest.importorskip(name)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("streaming") / PACKAGE, task="custom", streaming=True)


@pytest.fixture(scope="module")
def endpoint():
    with moto_server() as url:
        import boto3

        boto3.client("s3", endpoint_url=url, **s3_keys()).create_bucket(Bucket="data")
        yield url


def env_for(project: Path, endpoint: str, cache: Path, inject: str = "", **extra) -> dict:
    env = {**_env(project), **KEYS, "AWS_ENDPOINT_URL": endpoint, "XDG_CACHE_HOME": str(cache)}
    env.update(extra)
    if inject:
        folder = cache.parent / f"inject-{abs(hash(inject))}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(inject)
        env["PYTHONPATH"] = f"{folder}:{env['PYTHONPATH']}"
    return env


def command(project: Path, env: dict, *args, at=None) -> tuple[int, str, str]:
    """Runs a command of the project (killed, with its loader workers, after 120 s: a hang fails
    the test); `at` maps steps to calls made with the process once it printed them."""
    with subprocess.Popen(
        _command(project, args), cwd=project, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        watchdog = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))
        watchdog.start()
        out = []
        for line in proc.stdout:
            out.append(line)
            for step, call in (at or {}).items():
                if line.startswith(f"step {step}/"):
                    call(proc)
        stdout, stderr = "".join(out), proc.stderr.read()
    watchdog.cancel()
    with contextlib.suppress(ProcessLookupError):  # a loader worker left behind
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def train(project: Path, env: dict, data, run_dir: Path, *args, at=None) -> tuple[int, str, str]:
    return command(project, env, "train", "--data", data, "--run-dir", run_dir, *RUN, *args, at=at)


def prepare(project: Path, env: dict, out: str) -> None:
    code, stdout, stderr = command(project, env, "prepare", "--out", out, "--shard-mb", SHARD_MB)
    assert code == 0 and stdout.startswith("wrote 8 train shards (3,686 examples) and 1 val"), (
        stderr
    )


@pytest.fixture(scope="module")
def stored(project, endpoint, tmp_path_factory) -> str:
    """The example's shards on the store: s3://data/example."""
    env = env_for(project, endpoint, tmp_path_factory.mktemp("cache"))
    prepare(project, env, "s3://data/example")
    return "s3://data/example"


@pytest.fixture(scope="module")
def reference(project, stored, endpoint, tmp_path_factory) -> bytes:
    """The records of an uninterrupted run from the store, that every other run must equal."""
    work = tmp_path_factory.mktemp("reference")
    env = env_for(project, endpoint, work / "cache")
    code, _, stderr = train(project, env, stored, work / "run")
    assert code == 0, stderr
    return (work / "run" / "metrics.jsonl").read_bytes()


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, **s3_keys())


def copy_prefix(endpoint: str, source: str, dest: str) -> None:
    s3 = client(endpoint)
    for obj in s3.list_objects_v2(Bucket="data", Prefix=f"{source}/")["Contents"]:
        name = obj["Key"].rsplit("/", 1)[1]
        copied = {"Bucket": "data", "Key": obj["Key"]}
        s3.copy_object(Bucket="data", Key=f"{dest}/{name}", CopySource=copied)


@contextlib.contextmanager
def imported(project: Path):
    """The rendered package, imported here (for the order's unit tests)."""
    sys.path.insert(0, str(project / "src"))
    try:
        yield (
            importlib.import_module(f"{PACKAGE}.runtime.shards"),
            importlib.import_module(f"{PACKAGE}.runtime.loader"),
        )
    finally:
        sys.path.remove(str(project / "src"))
        for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
            del sys.modules[name]


class Counted:
    """A ShardReader of shards whose examples are their ids (the index's "examples" counts)."""

    def count(self, entry: dict) -> int:
        return entry["examples"]

    def open(self, path):
        raise AssertionError("the order reads no shard")


def split_of(shards, counts: list[int], window: int):
    entries = [{"name": f"train-{i:05d}.npz", "examples": n} for i, n in enumerate(counts)]
    return shards.ShardedSplit(None, entries, Counted(), window)


def test_the_order_is_a_permutation_each_epoch_drawn_a_window_of_shards_at_a_time(project):
    counts = [5, 7, 0, 3, 11, 2, 9, 6]
    with imported(project) as (shards, _):
        split = split_of(shards, counts, window=3)
        n, firsts = len(split), np.cumsum([0, *counts])
        epochs = [split.shuffle(seed=1, epoch=e)[np.arange(n)] for e in range(3)]
        for epoch, ids in enumerate(epochs):
            assert sorted(ids.tolist()) == list(range(n))  # every example once
            order = split.shuffle(seed=1, epoch=epoch)
            shard = np.searchsorted(firsts, ids, "right") - 1
            for w in range(3):  # the positions of window w read only window w's shards
                window = slice(order.windows[w], order.windows[w + 1])
                assert set(shard[window]) <= set(order.window_shards(w))
        assert not np.array_equal(epochs[0], epochs[1])
        again = split_of(shards, counts, window=3).shuffle(seed=1, epoch=1)[np.arange(n)]
        assert np.array_equal(again, epochs[1])  # keyed by (seed, epoch) alone
        assert not np.array_equal(split.shuffle(seed=2, epoch=1)[np.arange(n)], epochs[1])


def test_max_train_examples_takes_the_first_shards_that_hold_that_many(project):
    with imported(project) as (shards, _):
        entries = [
            {"name": f"train-{i:05d}.npz", "examples": n} for i, n in enumerate([5, 7, 4, 9])
        ]
        split = shards.ShardedSplit(None, entries, Counted(), window=2, limit=14)
        assert (
            len(split) == 14 and split.entries == entries[:3] and split.counts.tolist() == [5, 7, 2]
        )
        ids = split.shuffle(seed=0, epoch=0)[np.arange(14)]
        assert sorted(ids.tolist()) == list(range(14))  # the first 14 examples, each once


def test_the_global_batches_are_the_same_at_1_2_and_4_ranks(project):
    with imported(project) as (shards, loader):
        split = split_of(shards, [37, 41, 29, 50, 33, 44, 38, 31, 45], window=2)
        batches = {}
        for world in (1, 2, 4):
            ranks = []
            for rank in range(world):
                sampler = loader.EpochBatches(
                    len(split), 16 // world, 7, rank, world, split.shuffle
                )
                sampler.set_epoch(3, start=2)
                ranks.append([indices for _, indices in sampler])
            batches[world] = [np.concatenate(parts) for parts in zip(*ranks, strict=True)]
        assert len(batches[1]) == len(split) // 16 - 2
        for world in (2, 4):
            joined = zip(batches[1], batches[world], strict=True)
            assert all(np.array_equal(one, many) for one, many in joined)


def test_a_run_from_a_folder_and_from_the_store_writes_the_same_records(
    project, stored, reference, endpoint, tmp_path
):
    env = env_for(project, endpoint, tmp_path / "cache")
    prepare(project, env, str(tmp_path / "shards"))
    assert sorted(p.name for p in (tmp_path / "shards").iterdir())[-1] == "val-00000.npz"
    code, _, stderr = train(project, env, tmp_path / "shards", tmp_path / "run")
    assert code == 0, stderr
    assert not (tmp_path / "cache").exists()  # a folder is read in place
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == reference
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["format"] == "scaffold-shards" and len(index["splits"]["train"]) == 8
    # a destination holding an index is refused; the folder and the URL alike
    for dest in (tmp_path / "shards", stored):
        code, _, stderr = command(project, env, "prepare", "--out", dest)
        refused = f"error: {dest} holds a shard index already: prepare into another --out\n"
        assert code == 2 and stderr == refused


def test_a_run_killed_and_resumed_writes_the_records_of_one_never_stopped(
    project, stored, reference, endpoint, tmp_path
):
    env = env_for(project, endpoint, tmp_path / "cache")
    kill = {25: lambda proc: os.killpg(proc.pid, signal.SIGKILL)}
    code, _, _ = train(project, env, stored, tmp_path / "run", at=kill)
    assert code == -signal.SIGKILL
    code, stdout, stderr = train(project, env, stored, tmp_path / "run")
    assert code == 0 and "resuming from" in stdout and "at step 20" in stdout, stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == reference


def test_the_cache_never_holds_more_than_the_cache_size(
    project, stored, reference, endpoint, tmp_path
):
    log = tmp_path / "cache.log"
    env = env_for(project, endpoint, tmp_path / "cache", MEASURE_CACHE, CACHE_LOG=str(log))
    index = json.loads(read(endpoint, "example/index.json"))
    sizes = {entry["name"]: entry["bytes"] for entry in index["splits"]["train"]}
    limit = 2 * 2 * max(sizes.values()) + 6000  # two windows of 2 shards, the validation shard
    code, _, stderr = train(project, env, stored, tmp_path / "run", "--cache-size", f"{limit}B")
    assert code == 0, stderr
    fetched = [line.split() for line in log.read_text().splitlines()]
    peak = max(int(held) for _, held in fetched)
    assert peak <= limit < sum(sizes[name] for name, _ in fetched if name in sizes)  # evicted
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == reference
    code, _, stderr = train(project, env, stored, tmp_path / "small", "--cache-size", "20KB")
    needs = (
        r"error: --cache-size 20KB cannot hold two windows of .* shards \(\d+\.\dKB\): raise it,"
    )
    assert code == 2 and re.match(needs, stderr) and len(stderr.splitlines()) == 1, stderr


def read(endpoint: str, key: str) -> bytes:
    return client(endpoint).get_object(Bucket="data", Key=key)["Body"].read()


def test_a_shard_damaged_once_is_fetched_again_and_one_damaged_for_good_is_refused_naming_it(
    project, stored, reference, endpoint, tmp_path
):
    env = env_for(project, endpoint, tmp_path / "cache", DAMAGE_ONCE, DAMAGE_ONCE="train-00003.npz")
    code, _, stderr = train(project, env, stored, tmp_path / "once")
    warning = f"warning: {stored}/train-00003.npz does not match its digest: fetching it again"
    assert code == 0 and warning in stderr.splitlines(), stderr
    assert (tmp_path / "once" / "metrics.jsonl").read_bytes() == reference
    copy_prefix(endpoint, "example", "damaged")
    bad = read(endpoint, "damaged/train-00003.npz")
    client(endpoint).put_object(Bucket="data", Key="damaged/train-00003.npz", Body=bytes(len(bad)))
    env = env_for(project, endpoint, tmp_path / "cache2")
    code, _, stderr = train(project, env, "s3://data/damaged", tmp_path / "bad")
    lines = stderr.splitlines()
    assert code == 2 and len(lines) == 2 and lines[0] == warning.replace("example", "damaged"), (
        stderr
    )
    refused = (
        r"error: s3://data/damaged/train-00003\.npz is damaged \(fetched twice\):"
        r" its SHA-256 is [0-9a-f]{12}\.\.\., the index says [0-9a-f]{12}\.\.\."
    )
    assert re.fullmatch(refused, lines[1]), stderr


def test_a_missing_shard_or_index_is_one_line_and_exit_2_before_training(
    project, stored, endpoint, tmp_path
):
    copy_prefix(endpoint, "example", "lost")
    client(endpoint).delete_object(Bucket="data", Key="lost/train-00005.npz")
    env = env_for(project, endpoint, tmp_path / "cache")
    cases = {
        "s3://data/lost": "/train-00005.npz is missing: the index names it"
        " (prepare the data again)",
        "s3://data/none": ": no index.json: not a shard folder (`prepare --out` writes one)",
    }
    for url, line in cases.items():
        code, stdout, stderr = train(project, env, url, tmp_path / "run")
        line = f"error: {url}{line}"
        assert (code, stderr, stdout) == (2, line + "\n", ""), stderr
        assert not (tmp_path / "run").exists()  # before the run started


def test_the_store_away_stops_the_run_at_a_checkpoint_in_one_line_and_it_resumes_when_back(
    project, stored, reference, endpoint, tmp_path
):
    proxy = Proxy(int(endpoint.rsplit(":", 1)[1]))
    via = f"http://127.0.0.1:{proxy.port}"
    env = env_for(project, via, tmp_path / "cache", SLOW_READS, AWS_MAX_ATTEMPTS="1")
    away = {3: lambda proc: proxy.stop()}
    retry = ("--fetch-retry-minutes", "0.03")  # 1.8 s
    code, stdout, stderr = train(project, env, stored, tmp_path / "run", *retry, at=away)
    warning, last = stderr.strip().splitlines()
    assert warning.startswith(f"warning: cannot reach {stored}/train-"), stderr
    assert warning.endswith("; retrying for 2 s"), stderr
    stopped = re.fullmatch(
        r"stopped at step (\d+) by an unreachable data store"
        rf" \(cannot reach {stored}/train-\d+\.npz: Could not connect to the endpoint URL: \S+;"
        r" retried for \d s\);"
        r" checkpoint \S+/step-000000\d\d\.pt; run the same command to resume",
        last,
    )
    assert code == 128 + signal.SIGUSR1 and stopped, stderr
    steps = [int(n) for n in re.findall(r"^step (\d+)/", stdout, re.MULTILINE)]
    assert steps[-1] == int(stopped[1]) < 60  # the step it stopped at, checkpointed
    proxy.start()
    code, stdout, stderr = train(project, env, stored, tmp_path / "run")
    assert code == 0 and f"at step {stopped[1]}" in stdout, stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == reference


def test_the_loader_check_names_a_slow_store_as_the_bottleneck(project, stored, endpoint, tmp_path):
    env = env_for(project, endpoint, tmp_path / "cache", SLOW_STORE)
    args = (
        "--data",
        stored,
        "--batch-size",
        "64",
        "--shuffle-window",
        "2",
        "--run-dir",
        tmp_path / "r",
    )
    code, stdout, stderr = command(project, env, "check", "loader", *args)
    found = re.search(
        r"loader: FAIL: .*: the data store is the bottleneck: shards were being fetched", stdout
    )
    assert code == 1 and found, stdout + stderr
