"""DDP projects on the CPU with gloo: 2 processes train exactly like 1 process with the global
batch, two torchrun "nodes" on this machine train together, and a killed worker is restarted by
torchrun and the run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import launchers
import pytest
import torch
import warm_python
from test_project import _env, records, render

FAULTS = Path(__file__).resolve().parent / "fault_inject"

SMALL = ("--max-train-examples", "1024", "--ckpt-every", "10", "--eval-every", "25",
         "--log-every", "1", "--deterministic", "--num-workers", "0", "--dropout", "0")  # fmt: skip


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(project, *args, nproc=2, extra=(), **popen) -> list[str]:
    """The project's launcher (runtime/launch.py: torchrun with its exit statuses), as scripts/
    run it: on port 0 unless given one (a port probed free can be another test's by the time
    torchrun binds it, and torchrun then waits in that job's rendezvous)."""
    package = next((project / "src").iterdir()).name
    return [sys.executable, "-m", f"{package}.runtime.launch", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{popen.pop('port', 0)}",
            *extra, "-m", package, *map(str, args)]  # fmt: skip


def _env_ddp(project) -> dict[str, str]:
    return {
        **_env(project),
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return render(tmp_path_factory.mktemp("ddp") / "ddp-demo", distributed="ddp")


@pytest.fixture(scope="module")
def two_process_run(project):
    """60 steps with 2 processes of batch 16: the reference for the tests below."""
    command = _torchrun(
        project,
        "train",
        "--run-dir",
        "runs/two",
        "--max-steps",
        "60",
        "--batch-size",
        "16",
        *SMALL,
        extra=("--nnodes", "1"),
    )
    done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return project / "runs" / "two"


def test_two_processes_match_one_process_with_the_global_batch(project, two_process_run):
    args = ["train", "--run-dir", "runs/one", "--max-steps", "60", "--batch-size", "32", *SMALL]
    command = [sys.executable, "-m", "ddp_demo", *args]
    single = warm_python.run(command, cwd=project, env=_env(project), timeout=600)
    assert single.returncode == 0, single.stderr
    one = [r for r in records(project / "runs" / "one") if r["split"] == "train"]
    two = [r for r in records(two_process_run) if r["split"] == "train"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 61))
    worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, two, strict=True))
    print(f"worst relative difference of the train loss, 1 vs 2 processes: {worst:.2e}")
    assert worst < 1e-4
    val_one = [r["accuracy"] for r in records(project / "runs" / "one") if r["split"] == "val"]
    val_two = [r["accuracy"] for r in records(two_process_run) if r["split"] == "val"]
    assert val_one == val_two  # the whole validation split, each example once, over both ranks


def test_two_nodes_on_this_machine_train_together(project):
    port = _port()
    args = ("train", "--run-dir", "runs/nodes", "--max-steps", "20", "--batch-size", "16", *SMALL)
    commands = [
        _torchrun(project, *args, nproc=1, port=port,
                  extra=("--nnodes", "2", "--node-rank", str(rank), "--rdzv-id", "rehearsal"))
        for rank in (0, 1)
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for command in commands
    ]  # fmt: skip
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    train = [r for r in records(project / "runs" / "nodes") if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert "ranks: 2" in "".join(outputs)


def _workers(launcher: subprocess.Popen, package: str) -> dict[int, int]:
    """torchrun's worker processes, rank -> pid (its other children, if any, are left out)."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    workers = {}
    for pid in map(int, children.stdout.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone already
            continue
        rank = [v[len(b"RANK=") :] for v in env if v.startswith(b"RANK=")]
        if package.encode() in argv and rank:
            workers[int(rank[0])] = pid
    return workers


def _stop(launcher: subprocess.Popen, package: str) -> None:
    """Ends torchrun and its workers (each worker is in a session of its own)."""
    launcher.terminate()  # torchrun stops its workers on SIGTERM
    try:
        launcher.wait(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in _workers(launcher, package).values():
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(project, two_process_run):
    """SIGKILL of rank 1 after step 25 (checkpoints every 10 steps): torchrun --max-restarts 1
    restarts the group, which resumes from the newest checkpoint and ends with the very records
    of the uninterrupted run. torchrun keeps one store for all restarts; before distributed.py gave
    each restart keys of its own, the restarted group read the dead group's addresses and failed to
    connect (Gloo connectFullMesh ... Connection refused) or hung there: 12 tries of 17."""
    command = _torchrun(
        project,
        "train",
        "--run-dir",
        "runs/killed",
        "--max-steps",
        "60",
        "--batch-size",
        "16",
        *SMALL,
        extra=("--nnodes", "1", "--max-restarts", "1"),
    )
    env = _env_ddp(project)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: one store for all
    launcher = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in launcher.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    started = time.monotonic()
    deadline = started + 300  # a hang fails the test, it does not stall the suite
    output: list[str] = []
    workers: dict[int, int] = {}
    killed_after = killed_at = None
    try:
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                pytest.fail("torchrun hung; its output:\n" + "".join(output)[-4000:])
            if line is None:
                break
            output.append(line)
            if line.startswith("ranks: ") and not workers:  # both workers are up by now
                workers = _workers(launcher, "ddp_demo")
                assert sorted(workers) == [0, 1], "".join(output)
            if line.startswith("step 25/") and killed_at is None:
                os.kill(workers[1], signal.SIGKILL)
                killed_after, killed_at = 25, time.monotonic()
        launcher.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if launcher.poll() is None:
            _stop(launcher, "ddp_demo")
    log = "".join(output)
    assert launcher.returncode == 0, log[-4000:]
    assert killed_at is not None, "the run never logged step 25:\n" + log[-3000:]
    resumed = [line for line in log.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 1, log[-4000:]  # restarted once, and the restart resumed
    before = log[: log.index(resumed[0])]  # what the first group logged, up to its end
    last_logged = max(int(line.split()[1].split("/")[0]) for line in before.splitlines()
                      if line.startswith("step ") and "/" in line.split()[1])  # fmt: skip
    resumed_at = int(resumed[0].rsplit(" ", 1)[1])
    print(
        f"killed rank 1 (pid {workers[1]}) after step {killed_after} was logged; the first group"
        f" logged up to step {last_logged}; {resumed[0]}; finished"
        f" {time.monotonic() - killed_at:.1f} s after the kill, {time.monotonic() - started:.1f} s"
        " in all"
    )
    assert last_logged < 60  # killed before the end
    assert resumed_at % 10 == 0 and max(10, last_logged - 10) <= resumed_at <= last_logged
    assert records(project / "runs" / "killed") == records(two_process_run)  # bit for bit


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_stop_with_their_launcher_killed_and_a_relaunch_resumes_bit_identical(
    project, two_process_run
):
    """kill -9 of torchrun left both workers training on (each in a session of its own, holding
    the run folder). Each worker now asks Linux for a signal when its launcher dies, and stops as
    on SIGTERM: both stop at the same step with its checkpoint, within seconds, and the same
    command resumes from it."""
    command = _torchrun(
        project, "train", "--run-dir", "runs/orphaned", "--max-steps", "60", "--batch-size", "16",
        *SMALL, extra=("--nnodes", "1"),
    )  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in launcher.stdout:  # the workers write to it too, after the launcher is gone
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    output, workers, killed_at = [], {}, None
    deadline = time.monotonic() + 300
    try:
        while (line := lines.get(timeout=max(deadline - time.monotonic(), 0.1))) is not None:
            output.append(line)
            if line.startswith("ranks: ") and not workers:
                workers = _workers(launcher, "ddp_demo")
            if line.startswith("step 25/") and killed_at is None:
                launcher.kill()  # SIGKILL: torchrun can pass nothing on
                killed_at = time.monotonic()
        # The pipe closes when the workers close their output, a moment before the kernel has
        # ended them (CI saw one still exiting): the time counted is until both pids are gone.
        gone_by = (killed_at or 0) + 30
        while any(_alive(pid) for pid in workers.values()) and time.monotonic() < gone_by:
            time.sleep(0.05)
        stopped_in = time.monotonic() - (killed_at or 0)
    finally:
        launcher.kill()
        for pid in workers.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    log = "".join(output)
    assert sorted(workers) == [0, 1] and killed_at is not None, log[-3000:]
    assert not any(_alive(pid) for pid in workers.values()), f"alive {stopped_in:.1f} s after"
    assert stopped_in < 20, log[-3000:]
    # Linux sends the parent-death signal again each time the dying launcher's thread that is a
    # worker's parent ends and another takes its place: sent as SIGTERM, a second one aborted the
    # worker ("aborted by a second SIGTERM", though none was sent). It is SIGHUP now, taken once.
    assert "the launcher ended: stopping after this step" in log.splitlines(), log[-3000:]
    stopped = [line for line in log.splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and "aborted" not in log, log[-3000:]
    step = int(stopped[0].split()[3])
    assert 25 <= step < 60

    again = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = [line for line in again.stdout.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 1 and int(resumed[0].rsplit(" ", 1)[1]) >= step - 10, again.stdout
    assert records(project / "runs" / "orphaned") == records(two_process_run)  # bit for bit


def _python(project, code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the project's environment, which must exit 0."""
    done = subprocess.run([sys.executable, "-c", code], cwd=project, env=_env(project),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_loader_workers_start_from_a_server_that_imported_all_they_unpickle(project):
    """Loader workers start from a forkserver (not forked from a rank: CPython gh-112275). Each one
    unpickles its dataset, collate and seeding functions, importing any module the server has not:
    runtime/loader.py (and with it torch.distributed's FSDP and checkpoint machinery) took a worker
    0.8 s of every start. Every module those objects name must be one the server preloads."""
    probe = (
        "import multiprocessing.forkserver, pickle, pickletools, subprocess, sys, torch\n"
        "from ddp_demo.config import Config\n"
        "from ddp_demo.data import load_splits\n"
        "from ddp_demo.runtime.loader import build_loaders\n"
        "cfg = Config(num_workers=1)\n"
        "train, val, _ = build_loaders(load_splits(cfg), cfg, torch.device('cpu'))\n"
        "named = set()\n"
        "for loader in (train, val):\n"
        "    sent = (loader.dataset, loader.collate_fn, loader.worker_init_fn)\n"
        "    for op, arg, _ in pickletools.genops(pickle.dumps(sent, protocol=2)):\n"
        "        if op.name == 'GLOBAL':\n"
        "            named.add(arg.split()[0])\n"
        "preload = multiprocessing.forkserver._forkserver._preload_modules\n"
        "check = f'import sys, {\", \".join(preload)}; print(sorted(sys.modules))'\n"
        "loaded = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True)\n"
        "missing = sorted(m for m in named if m not in eval(loaded.stdout))\n"
        "print(sorted(named), preload, 'missing:', missing)\n"
    )
    done = _python(project, probe)
    assert "ddp_demo.runtime.loader" in done.stdout, done.stdout  # the functions' module is named
    assert done.stdout.rstrip().endswith("missing: []"), done.stdout


def test_a_repeat_of_the_launchers_death_signal_inside_its_handler_does_not_abort_the_stop(project):
    """CI saw the race: Linux sends SIGHUP once per thread of the dying launcher, and one arrived
    before the handler's first line, so Python ran the handler again inside it (its SIG_IGN not yet
    set) and the worker raised SIGTERM twice: "aborted by a second SIGTERM", no checkpoint. A
    direct second call stands in for that nested one: the stop must be noted once and not abort."""
    probe = (
        "import signal\n"
        "from ddp_demo.runtime import distributed\n"
        "from ddp_demo.runtime.stopping import StopSignals\n"
        "with StopSignals() as stop:\n"
        "    distributed._launcher_ended(signal.SIGHUP, None)\n"
        "    distributed._launcher_ended(signal.SIGHUP, None)\n"
        "print('stopping by', signal.Signals(stop.signum).name)\n"
    )
    done = _python(project, probe)
    assert done.stdout.splitlines() == ["stopping by SIGTERM"], done.stdout + done.stderr
    assert done.stderr.splitlines() == ["the launcher ended: stopping after this step"], done.stderr


# --- stop signals under torchrun: every rank stops at the same step, with its checkpoint ---------

STOPPED = re.compile(r"^stopped at step (\d+) by (SIG\w+); checkpoint (\S+); run the same command")


def _signal_torchrun(project, run_dir: str, after_step: int, send, env=None, restarts: int = 0):
    """torchrun's 60-step run of batch 16; `send(launcher)` once rank 0 logs `after_step`. Returns
    the launcher, its merged output and the seconds from the signal to torchrun's exit."""
    command = _torchrun(project, "train", "--run-dir", run_dir, "--max-steps", "60", "--batch-size",
                        "16", *SMALL, extra=("--nnodes", "1", "--max-restarts", str(restarts)),
                        )  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=env or _env_ddp(project),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
    output, sent = [], None
    try:
        for line in launcher.stdout:
            output.append(line)
            if sent is None and line.startswith(f"step {after_step}/"):
                send(launcher)
                sent = time.perf_counter()
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            _stop(launcher, "ddp_demo")
    seconds = time.perf_counter() - sent if sent else None
    return launcher, "".join(output), seconds


def _stopped(log: str) -> tuple[int, str, Path]:
    found = [m for line in log.splitlines() if (m := STOPPED.match(line))]
    assert len(found) == 1, log[-3000:]  # rank 0 alone says it
    return int(found[0][1]), found[0][2], Path(found[0][3])  # relative to the project


def _resume_and_compare(project, run_dir: str, reference: Path, step: int) -> None:
    command = _torchrun(project, "train", "--run-dir", run_dir, "--max-steps", "60",
                        "--batch-size", "16", *SMALL, extra=("--nnodes", "1"))  # fmt: skip
    done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"at step {step}\n" in done.stdout
    metrics = (project / run_dir / "metrics.jsonl").read_bytes()
    assert metrics == (reference / "metrics.jsonl").read_bytes()  # bit-identical: no step lost


SIGNALLED_AT = 23  # between checkpoints 20 and 30


@pytest.mark.parametrize(
    "name",
    [
        "SIGTERM",
        pytest.param("SIGINT", marks=pytest.mark.slow),
        pytest.param("SIGUSR1", marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_torchrun_stops_every_rank_at_one_step(project, two_process_run, name):
    """SIGTERM and SIGINT (Ctrl-C) are torchrun's own: it passes them on to the workers. SIGUSR1
    it passes on when told to (--signals-to-handle, as the scripts/ launchers do)."""
    signum = getattr(signal, name)
    env = {**_env_ddp(project), "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR1"}
    run_dir = f"runs/stop-{name}"
    launcher, log, seconds = _signal_torchrun(
        project, run_dir, SIGNALLED_AT, lambda p: p.send_signal(signum), env
    )
    step, by, checkpoint = _stopped(log)
    assert by == name
    assert SIGNALLED_AT < step < 60
    saved = torch.load(project / checkpoint, map_location="cpu", weights_only=True)
    assert saved["state"]["step"] == step and len(saved["rng"]) == 2  # both ranks' streams
    assert sorted(p.name for p in (project / run_dir / "checkpoints").glob("step-*.pt"))[-1] == (
        f"step-{step:08d}.pt"
    )
    assert launcher.returncode == 128 + signum, log[-3000:]  # as a shell reports a signal's end
    assert "Traceback" not in log, log[-3000:]
    print(f"ddp {name}: signalled at step {SIGNALLED_AT}, stopped at {step}, exit {seconds:.2f} s")
    assert seconds < 30
    _resume_and_compare(project, run_dir, two_process_run, step)


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("SIGTERM", 0),
        pytest.param("SIGINT", 1, marks=pytest.mark.slow),
        pytest.param("SIGUSR1", 1, marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_one_worker_ends_the_job_as_one_to_torchrun_and_spends_no_restart(
    project, two_process_run, name, rank
):
    """A stop signal to one worker alone (a `kill` of its PID), with restarts allowed: the flag is
    all-reduced each step, so every rank stops at the same step with its checkpoint and exits with
    128 plus the signal's number. The launcher restarted that group (the job then trained to the
    end and exited 0, a restart spent), and once one rank had exited SIGTERMed the rest: for a rank
    that got the first signal, a second, aborting its checkpoint. Now it waits for every rank and
    ends the job with their status."""
    run_dir = f"runs/stop-rank{rank}-{name}"
    signum = getattr(signal, name)

    def to_one_worker(launcher):
        os.kill(_workers(launcher, "ddp_demo")[rank], signum)

    launcher, log, seconds = _signal_torchrun(
        project, run_dir, SIGNALLED_AT, to_one_worker, restarts=3
    )
    step, by, checkpoint = _stopped(log)
    assert by == name and SIGNALLED_AT < step < 60, log[-3000:]
    assert launcher.returncode == 128 + signum, log[-3000:]
    starts = sum(line.startswith("model: ") for line in log.splitlines())  # rank 0's, at each start
    assert starts == 1 and "resuming from" not in log, log[-3000:]  # no restart
    assert "aborted" not in log and "Traceback" not in log, log[-3000:]
    assert log.rstrip().splitlines()[-1] == _stopped_line(log), log[-3000:]  # torchrun adds nothing
    saved = torch.load(project / checkpoint, map_location="cpu", weights_only=True)
    assert saved["state"]["step"] == step and len(saved["rng"]) == 2  # both ranks' streams
    assert sorted(p.name for p in (project / run_dir / "checkpoints").glob("step-*.pt"))[-1] == (
        f"step-{step:08d}.pt"
    )
    print(f"ddp {name} to rank {rank}: signalled at step {SIGNALLED_AT}, stopped at {step},"
          f" exit {launcher.returncode} in {seconds:.2f} s")  # fmt: skip
    assert seconds < 30
    _resume_and_compare(project, run_dir, two_process_run, step)


def _stopped_line(log: str) -> str:
    return next(line for line in log.splitlines() if STOPPED.match(line))


def test_the_slurm_job_stops_on_its_warning_signal_and_requeues(project, two_process_run, tmp_path):
    """scripts/train.slurm run as SLURM would, with a fake `srun` (runs its command) and a fake
    `scontrol` (records its arguments) on PATH: SIGUSR1 to the batch script (--signal=B:USR1)
    stops the run with a checkpoint and calls `scontrol requeue <job id>`; the requeued job (the
    same id) resumes and ends with the records of an uninterrupted run."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "scontrol.log"
    (fake / "srun").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    (fake / "scontrol").write_text(
        f'#!/usr/bin/env bash\necho "$@" >> {calls}\n'
        '[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1\nexit 0\n'
    )
    (fake / "torchrun").write_text(
        f'#!/usr/bin/env bash\nexec {sys.executable} -m torch.distributed.run "$@"\n'
    )
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {**_env_ddp(project), "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(project),
           "MASTER_PORT": str(_port())}  # fmt: skip
    job = ["bash", "scripts/train.slurm", "--max-steps", "60", "--batch-size", "16", *SMALL]
    with subprocess.Popen(job, cwd=project, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as script:  # fmt: skip
        output, sent = [], None
        for line in script.stdout:
            output.append(line)
            if sent is None and line.startswith(f"step {SIGNALLED_AT}/"):
                script.send_signal(signal.SIGUSR1)
                sent = time.perf_counter()
        script.wait(timeout=120)
    seconds = time.perf_counter() - sent
    log = "".join(output)
    step, by, checkpoint = _stopped(log)
    assert by == "SIGTERM" and SIGNALLED_AT < step < 60, log[-3000:]
    assert checkpoint.parent == Path("runs/4242/checkpoints")
    assert "requeue 4242" in calls.read_text().splitlines(), log[-3000:]
    print(
        f"slurm SIGUSR1: signalled at step {SIGNALLED_AT}, stopped at {step}, exit {seconds:.2f} s"
    )

    env["MASTER_PORT"] = str(_port())
    again = warm_python.run(job, cwd=project, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {checkpoint} at step {step}" in again.stdout
    assert calls.read_text().count("requeue") == 1  # a job that ends is not requeued
    metrics = (project / "runs" / "4242" / "metrics.jsonl").read_bytes()
    assert metrics == (two_process_run / "metrics.jsonl").read_bytes()


def test_a_second_ddp_launch_on_a_running_run_folder_is_refused(project):
    """The run folder's lock under torchrun: a second launch on the same --run-dir fails, its rank
    0 naming the first's holder in one line, while the first runs on undisturbed until stopped."""
    run_dir = "runs/two-writers"
    until_stopped = ("--max-steps", "100000", "--patience", "0", "--batch-size", "16", *SMALL)

    def launch() -> list[str]:  # each launch its own rendezvous port
        return _torchrun(
            project, "train", "--run-dir", run_dir, *until_stopped,
            extra=("--nnodes", "1", "--max-restarts", "3"),
        )  # fmt: skip

    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    first = subprocess.Popen(launch(), cwd=project, env=_env_ddp(project), **pipes)
    try:
        for line in first.stdout:
            if line.startswith("step 10/"):
                break
        lines: list[str] = []  # read on while the second starts: a full pipe would block the first
        drain = threading.Thread(target=lambda: lines.extend(first.stdout), daemon=True)
        drain.start()
        second = warm_python.run(launch(), cwd=project, env=_env_ddp(project), timeout=300)
        still_running = first.poll() is None
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        drain.join(timeout=30)
        rest = "".join(lines)
    finally:
        if first.poll() is None:
            _stop(first, "ddp_demo")

    refusals = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert second.returncode == 2, second.stderr[-3000:]  # a refusal: never restarted
    assert len(refusals) == 1 and f"on {socket.gethostname()}" in refusals[0], second.stderr[-3000:]
    assert "is in use by pid" in refusals[0] and "Traceback" not in second.stderr
    last = second.stderr.rstrip().splitlines()[-1]
    assert last == f"ddp_demo: rank 0 ended the job: {refusals[0]}"
    assert still_running
    step, by, _ = _stopped(rest)
    assert by == "SIGTERM"
    train_steps = [r["step"] for r in records(project / run_dir) if r["split"] == "train"]
    assert train_steps == list(range(1, step + 1))  # the first run's records all there, once


def test_a_torch_older_than_the_floor_is_one_line_not_a_ddp_traceback(project):
    """On a GPU machine with torch 2.11, DDP raised `unexpected keyword argument
    'forward_sync_buffers'` in every rank: the project's torch>=2.13 is now said in one line."""
    code = (
        "import sys, torch\n"
        "class OldDDP(torch.nn.Module):\n"  # torch 2.11's signature: no forward_sync_buffers
        "    def __init__(self, module, device_ids=None, broadcast_buffers=True):\n"
        "        super().__init__()\n"
        "torch.nn.parallel.DistributedDataParallel = OldDDP\n"
        "from ddp_demo.runtime import distributed\n"
        "from ddp_demo.config import ConfigError\n"
        "try:\n"
        "    distributed.wrap(torch.nn.Linear(2, 2), None, torch.device('cpu'))\n"
        "except ConfigError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=_env(project), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"torch {torch.__version__} is older than this project's torch>=2.13"
    )


def _full_disk(project, run_dir: str, fault: dict, nproc: int = 2) -> subprocess.CompletedProcess:
    """A 30-step run under the launcher, with 3 restarts allowed, whose `fault` fills the disk at a
    save (in every process the launcher starts, as a disk that stays full)."""
    env = _env_ddp(project)
    env["PYTHONPATH"] = f"{FAULTS}:{env['PYTHONPATH']}"
    env["SCAFFOLD_FAULT"] = json.dumps(fault)
    command = _torchrun(project, "train", "--run-dir", run_dir, "--max-steps", "30", "--batch-size",
                        "16", *SMALL, nproc=nproc,
                        extra=("--nnodes", "1", "--max-restarts", "3"))  # fmt: skip
    return warm_python.run(command, cwd=project, env=env, timeout=300)


def group_starts(done: subprocess.CompletedProcess) -> int:
    """How many times the launcher started the group: rank 0 names the model at each start."""
    return sum(line.startswith("model: ") for line in done.stdout.splitlines())


def test_a_full_disk_on_rank_0_ends_the_job_in_its_line_with_no_traceback_from_a_rank(project):
    """Rank 0 alone writes under ddp. Its checkpoint at step 20 meets a full disk: it says so in
    one line; rank 1, whose next all-reduce loses rank 0, says nothing (gloo's traceback before),
    and the launcher ends the job with 1 and one line naming rank 0 and its reason, restarting
    nothing: a full disk stays full (the group was restarted 3 times before the job ended)."""
    fault = {"at": "fsync", "match": "step-", "nth": 2, "do": "ENOSPC"}
    done = _full_disk(project, "runs/full", fault)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-4000:]
    assert group_starts(done) == 1, output[-4000:]
    reason = "cannot write checkpoint runs/full/checkpoints/step-00000020.pt: No space left on"
    reason += " device"
    assert f"error: {reason}" in done.stderr.splitlines(), output[-4000:]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last == f"ddp_demo: rank 0 ended the job: error: {reason}"


# --- the cluster launchers: Kubeflow Trainer and SkyPilot, run as 2 nodes on this machine --------


@pytest.mark.parametrize("launcher", launchers.LAUNCHERS)
def test_a_cluster_launcher_trains_stops_on_sigterm_and_resumes_bit_identical(
    project, two_process_run, launcher
):
    """The command of scripts/train_<launcher>.yaml, run on 2 "nodes" of 1 process with what the
    engine sets on each: SIGTERM to both stops every rank at one step with its checkpoint and
    exits 143; the same command then resumes, bit for bit."""
    args = ["--run-dir", f"runs/{launcher}", "--max-steps", "60", "--batch-size", "16", *SMALL]
    launchers.stop_and_resume(project, launcher, args, _env_ddp(project), two_process_run, _port)
