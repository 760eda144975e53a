"""A generated project's run on an object store (`--run-dir s3://...`), against a real S3-compatible
server (moto's, started here on localhost): a run killed mid-way and resumed on a "fresh machine"
(its cache deleted, another working folder) ends bit for bit as an uninterrupted one; a kill
between a checkpoint's files and its manifest leaves the previous checkpoint in use; an outage
(a proxy stopped and started) is ridden out, or stops the run in one line once it outlasts the
retries; an unreachable store or refused credentials fail in one line naming the URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hung import drained, killed_after
from test_ddp import _workers
from test_project import _command, _env, render


@pytest.fixture(autouse=True)
def _s3_libraries():
    """boto3, s3fs and moto, or the test is skipped: checked here, not as the module is collected
    (importing them took seconds of every collection)."""
    for name in ("boto3", "s3fs", "moto"):
        pytest.importorskip(name)


MAX_STEPS = 80
SMALL_RUN = (
    "--max-train-examples", "1024", "--batch-size", "64", "--ckpt-every", "10",
    "--eval-every", "25", "--log-every", "1", "--deterministic", "--num-workers", "1",
    "--max-steps", str(MAX_STEPS),
)  # fmt: skip
# A run of SMALL_RUN takes 10-40 s here: one past this hung, and fails with what it was doing.
RUN_LIMIT_S = 300
READ = {"cwd": "/", "capture_output": True, "text": True, "timeout": 120}
KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
FINAL = "checkpoints/step-00000080.pt"
SHARDED_STEPS = 40
# Gives each rank of a launch a cache of its own (the launcher, which has no RANK, keeps its own).
PER_RANK_CACHE = """
import os
if "RANK" in os.environ:
    os.environ["XDG_CACHE_HOME"] += "-rank" + os.environ["RANK"]
"""
# Kills the process as its upload thread builds the manifest of step KILL_AT_MANIFEST: that
# checkpoint's files and the records are uploaded, its manifest is not.
# Kills the process as its upload thread prunes the checkpoints older than KILL_AT_PRUNE's: that
# checkpoint's manifest is written, the older ones are not yet deleted.
KILL_AT_PRUNE = """
import os, signal
from {package}.runtime import store
_remove_unlisted = store.RunStore._remove_unlisted
def remove_unlisted(self, manifests):
    if any(step == int(os.environ["KILL_AT_PRUNE"]) for step, _ in manifests):
        os.kill(os.getpid(), signal.SIGKILL)
    return _remove_unlisted(self, manifests)
store.RunStore._remove_unlisted = remove_unlisted
"""
# Sends SIGTERM to the process as it prints step SIGTERM_AT, where that is set: the signal is
# caught before the next step begins, so the run stops, with a checkpoint, at step SIGTERM_AT + 1
# however loaded the machine is (a signal from the test, sent as it reads that line, can land a
# step later).
SIGTERM_AT = """
import os, signal, sys
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
"""
KILL_AT_MANIFEST = """
import json, os, signal
_dumps = json.dumps
def dumps(obj, *args, **kwargs):
    at = int(os.environ["KILL_AT_MANIFEST"])
    if isinstance(obj, dict) and "files" in obj and obj.get("step") == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return _dumps(obj, *args, **kwargs)
json.dumps = dumps
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(**env):
    """An S3 server on localhost; its endpoint URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


class Proxy:
    """A TCP proxy on localhost to `port`; stop() cuts its connections and refuses new ones until
    start()."""

    def __init__(self, port: int) -> None:
        self.target, self.port, self.open = port, free_port(), []
        self.start()

    def start(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def stop(self) -> None:
        for sock in [self.server, *self.open]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            sock.close()
        self.open = []

    def _accept(self, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                client = server.accept()[0]
                upstream = socket.create_connection(("127.0.0.1", self.target))
                self.open += [client, upstream]
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)


@pytest.fixture(scope="module")
def endpoint():
    with moto_server() as url:
        import boto3

        client = boto3.client("s3", endpoint_url=url, **s3_keys())
        client.create_bucket(Bucket="runs")
        yield url


def s3_keys() -> dict:
    return {
        "aws_access_key_id": KEYS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": KEYS["AWS_SECRET_ACCESS_KEY"],
        "region_name": KEYS["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("store") / "demo")


@pytest.fixture(scope="module")
def reference(project) -> Path:
    """The uninterrupted run, in a local folder, that every run on the store must equal."""
    run_dir = project / "runs" / "reference"
    done = subprocess.run(
        _command(project, ["train", "--run-dir", run_dir, *SMALL_RUN]),
        cwd=project, env=_env(project), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run_dir


def env_for(project: Path, endpoint: str, cache: Path, **extra) -> dict:
    where = {"AWS_ENDPOINT_URL": endpoint, "XDG_CACHE_HOME": str(cache)}
    return {**_env(project), **KEYS, **where, **extra}


def train(
    project, url, cwd, env, stop_at: int | None = None, at=None, args=()
) -> tuple[int, str, str]:
    """Trains the run at `url` from `cwd`; with `stop_at`, SIGKILLs it (its group) once it printed
    that step; `at` maps steps to calls made with the process once it printed them."""
    command = _command(project, ["train", "--run-dir", url, *SMALL_RUN, *args])
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc, killed_after(proc.pid, RUN_LIMIT_S) as hung:  # fmt: skip
        reader, errors = drained(proc.stderr)
        out = []
        for line in proc.stdout:
            out.append(line)
            for step, call in (at or {}).items():
                if line.startswith(f"step {step}/"):
                    call(proc)
            if stop_at is not None and line.startswith(f"step {stop_at}/"):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        stdout = "".join(out) + proc.stdout.read()
        proc.wait()
        reader.join()
    with contextlib.suppress(ProcessLookupError):  # its loader worker
        os.killpg(proc.pid, signal.SIGKILL)
    stderr = "".join(errors)
    assert not hung, f"{hung[0]}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    return proc.returncode, stdout, stderr


def stored(endpoint: str, prefix: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **s3_keys())
    listed = client.list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", [])
    body = {o["Key"]: client.get_object(Bucket="runs", Key=o["Key"])["Body"] for o in listed}
    return {key[len(prefix) + 1 :]: data.read() for key, data in body.items()}


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, **s3_keys())


def resumed_at(stdout: str) -> int:
    found = re.search(r"^resuming from \S+ at step (\d+)$", stdout, re.MULTILINE)
    return int(found[1]) if found else 0


def same_model(checkpoint: bytes, reference: Path) -> bool:
    ours = torch.load(io.BytesIO(checkpoint), weights_only=True)["model"]
    theirs = torch.load(reference, weights_only=True)["model"]
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_run_killed_and_its_disk_lost_resumes_on_a_fresh_machine_bit_for_bit(
    project, reference, endpoint, tmp_path
):
    url = "s3://runs/fresh"
    first, second = tmp_path / "machine-1", tmp_path / "machine-2"
    for machine in (first, second):
        (machine / "work").mkdir(parents=True)
    env = env_for(project, endpoint, first / "cache")
    code, _, _ = train(project, url, first / "work", env, stop_at=45)
    assert code == -signal.SIGKILL
    shutil.rmtree(first)  # every local file the run wrote, its staging folder and cache included
    env = env_for(project, endpoint, second / "cache")
    code, stdout, stderr = train(project, url, second / "work", env)
    assert code == 0, stderr
    # Step 40's push waited for step 30's upload: step 30 at least is complete on the store.
    assert resumed_at(stdout) >= 30, stdout
    files = stored(endpoint, "fresh")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)
    assert "checkpoints/step-00000080.json" in files  # its manifest: complete
    # The read commands take the URL too, from a third machine's cache.
    env = env_for(project, endpoint, tmp_path / "reader")
    report = subprocess.run(_command(project, ["report", url]), env=env, **READ)
    assert report.returncode == 0 and "**Results:** best val loss" in report.stdout, report.stderr
    export = [*("export", "--checkpoint", f"{url}/checkpoints/best.pt", "--out"), tmp_path / "w.pt"]
    done = subprocess.run(_command(project, export), env=env, **READ)
    best = torch.load(reference / "checkpoints" / "best.pt", weights_only=True)["model"]
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert done.returncode == 0 and all(torch.equal(weights[k], best[k]) for k in best), done.stderr


def test_a_kill_between_a_checkpoints_files_and_its_manifest_leaves_the_previous_one_in_use(
    project, reference, endpoint, tmp_path
):
    url = "s3://runs/cut"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILL_AT_MANIFEST)
    env = env_for(project, endpoint, tmp_path / "cache")
    killing = {**env, "PYTHONPATH": f"{inject}:{env['PYTHONPATH']}", "KILL_AT_MANIFEST": "20"}
    code, _, _ = train(project, url, project, killing)
    assert code == -signal.SIGKILL
    files = stored(endpoint, "cut")
    assert "checkpoints/step-00000020.pt" in files and "checkpoints/step-00000020.json" not in files
    code, stdout, stderr = train(project, url, project, env)
    assert code == 0, stderr
    assert resumed_at(stdout) == 10, stdout
    files = stored(endpoint, "cut")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)


def test_kills_just_after_checkpoints_each_on_a_fresh_machine_lose_nothing(
    project, reference, endpoint, tmp_path
):
    """Each kill lands a step after a checkpoint, with its upload likely in flight; each restart
    is on a machine of its own, so only the store carries the run."""
    url = "s3://runs/chain"
    stops = [21, 51, None]
    for machine, stop_at in enumerate(stops):
        env = env_for(project, endpoint, tmp_path / f"cache-{machine}")
        code, stdout, stderr = train(project, url, project, env, stop_at=stop_at)
        assert code == (0 if stop_at is None else -signal.SIGKILL), stderr
        if machine:  # at least the checkpoint before the one in flight when it was killed
            assert resumed_at(stdout) >= stops[machine - 1] - 11, stdout
    files = stored(endpoint, "chain")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)


def test_a_second_start_of_a_url_on_one_machine_is_refused_before_it_touches_the_first(
    project, reference, endpoint, tmp_path
):
    url = "s3://runs/twice"
    env = env_for(project, endpoint, tmp_path / "cache")  # one machine: one staging folder
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
    command = _command(project, ["train", "--run-dir", url, *SMALL_RUN])
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(
        command, cwd=tmp_path / "a", env=env, start_new_session=True, **pipes
    ) as first:
        for line in first.stdout:
            if line.startswith("step 25/"):
                break
        # Paused with step 20 written in the staging folder, perhaps not yet uploaded: a start
        # that pulled the store's checkpoint into the folder would delete it and cut the records.
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            second = subprocess.run(command, cwd=tmp_path / "b", env=env, timeout=120, **pipes)
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        first.stdout.read()
        stderr = first.stderr.read()
    assert second.returncode == 2, second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {url} (staged in ") and f"in use by pid {first.pid} " in last
    assert "Traceback" not in second.stderr
    assert first.returncode == 0, stderr
    assert stored(endpoint, "twice")["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()


def outage(endpoint: str, project: Path, cache: Path, **extra) -> tuple[Proxy, dict]:
    """A proxy to the store, to stop and start, and the environment of a run that uses it."""
    proxy = Proxy(int(endpoint.rsplit(":", 1)[1]))
    return proxy, env_for(project, f"http://127.0.0.1:{proxy.port}", cache, **extra)


def test_an_outage_of_13_s_is_ridden_out_as_training_goes_on(
    project, reference, endpoint, tmp_path
):
    proxy, env = outage(endpoint, project, tmp_path / "cache")
    back = {}

    def away(proc):
        proxy.stop()
        threading.Timer(
            13, lambda: (back.setdefault("at", time.monotonic()), proxy.start())
        ).start()

    def last_step(proc):
        back.setdefault("last step", time.monotonic())

    code, _, stderr = train(
        project, "s3://runs/outage", project, env, at={25: away, MAX_STEPS: last_step}
    )
    assert code == 0, stderr
    assert "; retrying for 300 s" in stderr and "Traceback" not in stderr  # it met the outage
    assert back["last step"] < back["at"]  # the loop trained on; the run's end waited for the store
    files = stored(endpoint, "outage")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)
    assert "checkpoints/step-00000080.json" in files


def test_an_outage_past_the_retries_stops_the_run_at_a_checkpoint_in_one_line_losing_nothing(
    project, reference, endpoint, tmp_path
):
    proxy, env = outage(endpoint, project, tmp_path / "cache")
    url, fast = "s3://runs/gone", {**env, "AWS_MAX_ATTEMPTS": "1"}  # each try fails at once
    retry = ("--upload-retry-minutes", "0.02")  # 1.2 s
    code, stdout, stderr = train(
        project, url, project, fast, at={25: lambda _: proxy.stop()}, args=retry
    )
    warning, last = stderr.strip().splitlines()
    assert warning.startswith("warning: cannot upload to s3://runs/gone: ") and warning.endswith(
        "retrying for 1 s"
    )
    stopped = re.fullmatch(
        r"error: cannot upload to s3://runs/gone: Could not connect to the endpoint URL: \S+; "
        r"retried for \d s; not stored from step (\d+) on: run the same command once it is back",
        last,
    )
    assert code == 1 and stopped, stderr
    steps = [int(n) for n in re.findall(r"^step (\d+)/", stdout, re.MULTILINE)]
    assert steps[-1] % 10 == 0, stdout  # it stopped at a checkpoint
    proxy.start()
    code, stdout, stderr = train(project, url, project, env)
    assert code == 0, stderr
    assert 0 < resumed_at(stdout) < int(stopped[1]), stdout
    files = stored(endpoint, "gone")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)


def test_a_second_stop_signal_ends_an_upload_retrying_saying_so(
    project, reference, endpoint, tmp_path
):
    proxy, env = outage(endpoint, project, tmp_path / "cache", AWS_MAX_ATTEMPTS="1")
    url, retry = "s3://runs/abort", ("--upload-retry-minutes", "1")

    def stop(
        proc,
    ):  # the first signal ends the loop at a checkpoint, and the run waits for the store
        os.kill(proc.pid, signal.SIGTERM)
        threading.Timer(3, os.kill, (proc.pid, signal.SIGTERM)).start()

    at = {25: lambda _: proxy.stop(), 30: stop}
    started = time.monotonic()
    code, stdout, stderr = train(project, url, project, env, at=at, args=retry)
    assert code == 128 + signal.SIGTERM and time.monotonic() - started < 30, stderr
    *_, warning, aborted = stderr.strip().splitlines()
    step = re.fullmatch(rf"warning: step (\d+) is not on {url}: its upload was cut short", warning)
    assert step and int(step[1]) in (30, 31), stderr
    assert aborted.startswith("aborted by a second SIGTERM: ") and "Traceback" not in stderr
    proxy.start()
    code, stdout, stderr = train(project, url, project, env)
    assert code == 0, stderr
    assert 0 < resumed_at(stdout) <= 20, stdout
    files = stored(endpoint, "abort")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)


# What only looks like a store URL, or a URL where a command takes a local path: each once trained
# or wrote into a local folder named "s3:" (or "nosuch:"), some exiting 0.
NOT_A_URL, LOCAL_ONLY = "is not a store URL", "takes a local path here, not a URL"
NOT_URLS = {
    "one-slash": (["train", "--run-dir", "s3:/runs/x"], f"s3:/runs/x {NOT_A_URL}"),
    "no-bucket": (["train", "--run-dir", "s3://"], f"s3:// {NOT_A_URL}"),
    "empty-bucket": (["train", "--run-dir", "s3:///x"], f"s3:///x {NOT_A_URL}"),
    "unknown-scheme": (["train", "--run-dir", "nosuch://runs/x"], f"nosuch://runs/x {NOT_A_URL}"),
    "data-url": (["train", "--data", "s3://runs/d.csv"], f"train {LOCAL_ONLY}"),
    "read-one-slash": (["diagnose", "runs/a", "s3:/runs/x"], f"s3:/runs/x {NOT_A_URL}"),
    "since-one-slash": (["report", "runs/a", "--since", "gs:/runs/x"], f"gs:/runs/x {NOT_A_URL}"),
    "checkpoint-one-slash": (["export", "--checkpoint", "s3:/x/checkpoints/best.pt"], NOT_A_URL),
    "checkpoint-outside-checkpoints": (
        ["export", "--checkpoint", "s3://runs/x/best.pt"],
        "a checkpoint on a store is RUN_URL/checkpoints/NAME",
    ),
    "export-out-url": (["export", "--out", "s3://runs/m.pt"], f"export {LOCAL_ONLY}"),
    "plot-output-url": (["plot", "runs/a", "-o", "s3://runs/c.png"], f"plot {LOCAL_ONLY}"),
    "predict-url": (["predict", "s3://runs/rows.csv"], f"predict {LOCAL_ONLY}"),
}


@pytest.mark.parametrize("case", list(NOT_URLS))
def test_a_mistyped_url_or_a_url_for_a_local_path_is_one_line_and_writes_nothing(
    project, tmp_path, tally, case
):
    args, expected = NOT_URLS[case]
    tally["faults (generated projects)"]["inputs tried"] += 1
    env = env_for(project, f"http://127.0.0.1:{free_port()}", tmp_path / "cache")
    done = subprocess.run(_command(project, args), env=env, **READ | {"cwd": tmp_path})
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
    assert len(done.stderr.splitlines()) == 1 and expected in done.stderr, done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []  # no "s3:" folder, no cache


def test_an_unreachable_store_fails_in_one_line_naming_it(project, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = env_for(project, nowhere, tmp_path / "cache", AWS_MAX_ATTEMPTS="1")
    code, _, stderr = train(project, "s3://runs/nowhere", tmp_path, env)
    assert code == 1 and stderr.startswith("error: ") and len(stderr.splitlines()) == 1, stderr
    assert "s3://runs/nowhere" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "runs").exists()


def test_refused_credentials_fail_in_one_line_naming_the_store(project, tmp_path):
    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as strict:  # checks keys: ours are unknown
        env = env_for(project, strict, tmp_path / "cache")
        code, _, stderr = train(project, "s3://runs/refused", tmp_path, env)
    assert code == 1 and stderr.startswith("error: ") and len(stderr.splitlines()) == 1, stderr
    assert "s3://runs/refused" in stderr and "Traceback" not in stderr


def manifests(files: dict) -> list[str]:
    return sorted(name for name in files if re.fullmatch(r"checkpoints/step-\d+\.json", name))


def test_unreadable_manifests_are_skipped_each_named_and_the_run_resumes_before_them(
    project, reference, endpoint, tmp_path
):
    url, s3 = "s3://runs/torn", client(endpoint)
    env = env_for(project, endpoint, tmp_path / "cache-1")
    code, _, _ = train(project, url, project, env, stop_at=45)
    assert code == -signal.SIGKILL
    *_, intact, no_files, empty = manifests(stored(endpoint, "torn"))
    s3.put_object(Bucket="runs", Key=f"torn/{empty}", Body=b"")
    s3.put_object(Bucket="runs", Key=f"torn/{no_files}", Body=json.dumps({"step": 1}).encode())
    env = env_for(project, endpoint, tmp_path / "cache-2")
    checkpoint = f"{url}/{intact.replace('.json', '.pt')}"  # the newest it can read holds it
    export = [*("export", "--checkpoint", checkpoint, "--out"), tmp_path / "w.pt"]
    done = subprocess.run(_command(project, export), env=env, **READ)
    assert done.returncode == 0, done.stderr
    code, stdout, stderr = train(project, url, tmp_path, env)
    assert code == 0, stderr
    assert f"warning: {url}/{empty} is unreadable (JSONDecodeError(" in stderr
    assert f"warning: {url}/{no_files} is unreadable (KeyError('files'))" in stderr
    assert resumed_at(stdout) == int(re.search(r"\d+", intact)[0]), stdout
    files = stored(endpoint, "torn")
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)


@pytest.mark.parametrize("stop_at", [49, 60])  # stopped at step 50, the best, or at 61, past it
def test_a_lost_best_object_loses_the_best_model_alone_and_says_so(
    project, reference, endpoint, tmp_path, stop_at
):
    url, prefix = f"s3://runs/best-{stop_at}", f"best-{stop_at}"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SIGTERM_AT)
    env = env_for(project, endpoint, tmp_path / "cache-1")
    env = {**env, "PYTHONPATH": f"{inject}:{env['PYTHONPATH']}", "SIGTERM_AT": str(stop_at)}
    code, _, stderr = train(project, url, project, env)
    assert code == 128 + signal.SIGTERM
    assert f"stopped at step {stop_at + 1} by SIGTERM" in stderr, stderr
    for name in stored(endpoint, prefix):  # every manifest lists the one best object
        if name.startswith("checkpoints/best-"):
            client(endpoint).delete_object(Bucket="runs", Key=f"{prefix}/{name}")
    env = env_for(project, endpoint, tmp_path / "cache-2")
    code, stdout, stderr = train(project, url, tmp_path, env)
    assert code == 0, stderr
    assert f"warning: cannot read {url}/checkpoints/best-" in stderr
    assert resumed_at(stdout) == stop_at + 1, stdout
    files = stored(endpoint, prefix)
    assert files["metrics.jsonl"] == (reference / "metrics.jsonl").read_bytes()
    assert same_model(files[FINAL], reference / FINAL)
    best = json.loads(files["run.json"])["finished"]["best_checkpoint"]
    reader = env_for(project, endpoint, tmp_path / "reader")
    report = subprocess.run(_command(project, ["report", url]), env=reader, **READ)
    if stop_at == 49:  # the checkpoint resumed is the best's own step
        assert "the best model (step 50) is made again from its step's checkpoint" in stdout
        assert best == f"{url}/checkpoints/best.pt" and f"checkpoint {best}" in report.stdout
        export = [*("export", "--checkpoint", best, "--out"), tmp_path / "w.pt"]
        done = subprocess.run(_command(project, export), env=reader, **READ)
        assert done.returncode == 0, done.stderr
        weights = torch.load(tmp_path / "w.pt", weights_only=True)
        theirs = torch.load(reference / "checkpoints" / "best.pt", weights_only=True)["model"]
        assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
    else:
        assert "the best model (step 50) is lost until a better validation" in stdout
        assert stdout.strip().splitlines()[-1].endswith("at step 50; checkpoint lost")
        assert best is None and "at step 50; checkpoint lost" in report.stdout, report.stdout


def test_a_finished_runs_next_start_prunes_what_a_kill_left_and_mends_its_final_checkpoint(
    project, reference, endpoint, tmp_path
):
    url, s3 = "s3://runs/mend", client(endpoint)
    inject = tmp_path / "inject"
    inject.mkdir()
    package = next((project / "src").iterdir()).name
    (inject / "sitecustomize.py").write_text(KILL_AT_PRUNE.format(package=package))
    env = env_for(project, endpoint, tmp_path / "cache")
    killing = {**env, "PYTHONPATH": f"{inject}:{env['PYTHONPATH']}", "KILL_AT_PRUNE": "80"}
    code, _, _ = train(project, url, project, killing)
    assert code == -signal.SIGKILL
    assert len(manifests(stored(endpoint, "mend"))) == 4  # --keep-last 3, and the one a kill left
    final = stored(endpoint, "mend")[FINAL]
    s3.put_object(Bucket="runs", Key=f"mend/{FINAL}", Body=final[:1000])  # damaged on the store
    code, stdout, stderr = train(project, url, project, env)  # the same machine: its copy intact
    assert code == 0, stderr
    assert f"warning: {url}/{FINAL} was lost or damaged: uploaded again" in stderr
    assert f"{url} is complete at step {MAX_STEPS}" in stdout
    files = stored(endpoint, "mend")
    assert files[FINAL] == final and manifests(files)[0] == "checkpoints/step-00000060.json"
    s3.delete_object(Bucket="runs", Key="mend/metrics.jsonl")
    reader = env_for(project, endpoint, tmp_path / "reader")
    report = subprocess.run(_command(project, ["report", url]), env=reader, **READ)
    assert report.returncode == 1, report.stderr
    assert f"cannot read {url}/metrics.jsonl" in report.stderr


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("store-fsdp") / "sharded", distributed="fsdp")


def launch(project, url, env, stop_at: int | None = None, cwd: Path | None = None):
    """scripts/train_single_node.sh (2 processes); with `stop_at`, SIGKILLs its workers and the
    launcher once that step is printed. Its exit status and output."""
    command = [project / "scripts" / "train_single_node.sh", "--run-dir", url, *SMALL_RUN,
               "--num-workers", "0", "--max-steps", str(SHARDED_STEPS)]  # fmt: skip
    with subprocess.Popen(command, cwd=cwd or project, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as launcher:  # fmt: skip
        out = []
        for line in launcher.stdout:
            out.append(line)
            if stop_at is not None and line.startswith(f"step {stop_at}/"):
                for pid in _workers(launcher, "sharded").values():  # each in a session of its own
                    os.kill(pid, signal.SIGKILL)
                launcher.kill()
                break
        launcher.wait()
    return launcher.returncode, "".join(out)


def sharded_env(project, endpoint, cache: Path, **extra) -> dict:
    return env_for(project, endpoint, cache, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # whole_model: one process
def test_fsdp_a_run_killed_and_its_disk_lost_resumes_on_a_fresh_machine_bit_for_bit(
    sharded, endpoint, tmp_path
):
    """Checkpoint folders of shards on the store: rank 0 uploads and pulls them for both ranks."""
    code, out = launch(sharded, tmp_path / "reference", sharded_env(sharded, endpoint, tmp_path))
    assert code == 0, out[-3000:]
    url, first, second = "s3://runs/sharded", tmp_path / "machine-1", tmp_path / "machine-2"
    code, out = launch(sharded, url, sharded_env(sharded, endpoint, first / "cache"), stop_at=35)
    assert code == -signal.SIGKILL, out[-3000:]
    shutil.rmtree(first)  # its staging folder with it
    second.mkdir()
    env = sharded_env(sharded, endpoint, second / "cache")
    code, out = launch(sharded, url, env, cwd=second)
    assert code == 0, out[-3000:]
    # Step 30's push waited for step 20's upload: step 20 at least is complete on the store.
    assert resumed_at(out) >= 20, out[-3000:]
    files = stored(endpoint, "sharded")
    assert files["metrics.jsonl"] == (tmp_path / "reference" / "metrics.jsonl").read_bytes()
    final = json.loads(files[f"checkpoints/step-{SHARDED_STEPS:08d}.json"])["files"]
    shards = [name for name in final if name.endswith(".distcp")]  # .metadata, state.pt name paths
    assert len(shards) == 4  # 2 ranks' shards of the step and of best
    for name in shards:  # the model and optimizer, bit for bit
        ours = tmp_path / "reference" / "checkpoints" / name
        assert final[name]["sha256"] == hashlib.sha256(ours.read_bytes()).hexdigest(), name
    print(
        f"fsdp on the store: killed -9 after step 35, resumed on a fresh cache at step"
        f" {resumed_at(out)}; metrics.jsonl equal ({len(files['metrics.jsonl'].splitlines())}"
        f" records), {len(shards)} shard files equal; last lines:\n"
        + "".join(line for line in out.splitlines(keepends=True)[-6:] if line.startswith("step"))
    )
    # `export` takes the URL of a checkpoint folder, from a third machine's cache.
    env = env_for(sharded, endpoint, tmp_path / "reader")
    export = ["export", "--checkpoint", f"{url}/checkpoints/best", "--out", tmp_path / "w.pt"]
    done = subprocess.run(_command(sharded, export), env=env, **READ)
    assert done.returncode == 0, done.stderr
    ours = torch.load(tmp_path / "w.pt", weights_only=True)
    theirs = whole_model(tmp_path / "reference" / "checkpoints" / "best")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def whole_model(folder: Path) -> dict:
    """A checkpoint folder's model weights, whole, read here on one process."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.")
    }
    dcp.load(tensors, checkpoint_id=folder, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in tensors.items()}


def test_fsdp_ranks_that_do_not_share_the_staging_folder_are_refused_in_one_line(
    sharded, endpoint, tmp_path
):
    """Each rank its own cache, as on machines that share no disk: rank 0 alone uploads, from a
    folder the others' shards never reach."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(PER_RANK_CACHE)
    env = sharded_env(sharded, endpoint, tmp_path / "cache")
    env["PYTHONPATH"] = f"{inject}:{env['PYTHONPATH']}"
    code, out = launch(sharded, "s3://runs/unshared", env)
    assert code == 2, out[-3000:]
    assert "error: --run-dir s3://runs/unshared: not every rank sees the staging folder" in out
    assert "Traceback" not in out and "XDG_CACHE_HOME" in out
    assert not stored(endpoint, "unshared")
