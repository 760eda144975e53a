"""FSDP2 projects on the CPU with gloo: 2 processes train like 1 process with the global batch, a
killed run resumes bit for bit, a checkpoint of 2 processes loads exactly under 1 and 4, a
damaged shard is caught, and `export` writes weights a plain model loads."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import launchers
import pytest
import torch
import warm_python
from test_ddp import (
    SMALL,
    _alive,
    _env_ddp,
    _full_disk,
    _port,
    _torchrun,
    _workers,
    group_starts,
)
from test_project import _env, records, render
from waiting import wait_until

PACKAGE = "fsdp_demo"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return render(tmp_path_factory.mktemp("fsdp") / "fsdp-demo", distributed="fsdp")


def _train(project, run_dir: str, steps: int, batch: int, nproc: int = 2, timeout: int = 600,
           extra: tuple[str, ...] = ()):  # fmt: skip
    args = (
        "train",
        "--run-dir",
        run_dir,
        "--max-steps",
        str(steps),
        "--batch-size",
        str(batch),
        *SMALL,
        *extra,
    )
    if nproc == 1:  # a plain process: a group of one
        command, env = [sys.executable, "-m", PACKAGE, *args], _env(project)
    else:
        command, env = (
            _torchrun(project, *args, nproc=nproc, extra=("--nnodes", "1")),
            _env_ddp(project),
        )
    done = warm_python.run(command, cwd=project, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_process_run(project):
    """40 steps with 2 processes of batch 16, checkpoints every 10: the reference below."""
    _train(project, "runs/two", 40, 16)
    return project / "runs" / "two"


def test_two_processes_match_one_process_with_the_global_batch(project, two_process_run):
    """With dropout off, 2 processes x batch 16 equal 1 process x 32 step by step: the same
    examples a step, the same initial weights on every rank, gradients averaged over the shards."""
    _train(project, "runs/one", 40, 32, nproc=1)
    one = [r for r in records(project / "runs" / "one") if r["split"] == "train"]
    two = [r for r in records(two_process_run) if r["split"] == "train"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 41))
    worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, two, strict=True))
    norms = max(
        abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(one, two, strict=True)
    )
    print(
        f"fsdp 1 x 32 vs 2 x 16: worst relative difference of the train loss {worst:.2e},"
        f" of the grad norm {norms:.2e}"
    )
    assert worst < 1e-5 and norms < 1e-4
    val_one = [r["accuracy"] for r in records(project / "runs" / "one") if r["split"] == "val"]
    val_two = [r["accuracy"] for r in records(two_process_run) if r["split"] == "val"]
    assert val_one == val_two


def test_a_checkpoint_is_a_folder_of_shards_and_export_writes_plain_weights(
    project, two_process_run
):
    checkpoints = two_process_run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best",
        "step-00000020",
        "step-00000030",
        "step-00000040",
    ]
    newest = checkpoints / "step-00000040"
    assert (newest / "state.pt").is_file() and (newest / ".metadata").is_file()
    assert len(list(newest.glob("*.distcp"))) == 2  # one file a rank
    out = project / "exported.pt"
    command = [sys.executable, "-m", PACKAGE, "export", "--checkpoint", newest, "--out", out]
    done = warm_python.run(command, cwd=project, env=_env(project), timeout=600)
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    missing = ["export", "--checkpoint", "runs/none/checkpoints/best"]
    refused = warm_python.run(
        [sys.executable, "-m", PACKAGE, *missing], cwd=project, env=_env(project), timeout=600
    )
    assert refused.returncode == 1 and not (project / "runs" / "none").exists()
    assert refused.stderr == "error: checkpoint runs/none/checkpoints/best does not exist\n"
    check = f"""
import torch
from {PACKAGE}.config import Config
from {PACKAGE}.data import load_splits
from {PACKAGE}.model import build_model
cfg = Config(max_train_examples=1024)
model = build_model(cfg, load_splits(cfg))
model.load_state_dict(torch.load({str(out)!r}, weights_only=True))  # strict: every key, every shape
print("loaded")
"""
    loaded = subprocess.run([sys.executable, "-c", check], cwd=project, env=_env(project),
                            capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr[-2000:]
    weights = torch.load(out, weights_only=True)
    assert all(
        isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in weights.values()
    )  # no DTensors


RESHARD_CHECK = """
import sys
import torch
import torch.distributed as dist
from pathlib import Path
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from {package}.runtime.checkpoint import CheckpointDir, load, load_shards
from {package}.runtime.distributed import shutdown
from {package}.config import Config
from {package}.data import load_splits
from {package}.runtime.engine import Engine, setup

cfg = Config(max_train_examples=1024, batch_size=16, dropout=0.0, num_workers=0)
device, _ = setup(cfg)
engine = Engine(cfg, load_splits(cfg), device)
rank = dist.get_rank()
checkpoints = CheckpointDir(Path(sys.argv[1]), keep_last=3, main=rank == 0)
path, checkpoint = checkpoints.load_latest()
checkpoint |= load_shards(path, engine.state_dict())
engine.load_state_dict(checkpoint)
whole = load(path)  # the checkpoint as written, on this one process
full = StateDictOptions(full_state_dict=True)
model, optimizer = get_state_dict(engine.model, engine.optimizer, options=full)
same_model = model.keys() == whole["model"].keys() and all(
    torch.equal(model[k], whole["model"][k]) for k in model
)
moments = [
    (f"optimizer.state.{{name}}.{{k}}", t)
    for name, s in optimizer["state"].items()
    for k, t in s.items()
]
same_optimizer = len(moments) == len(whole["optimizer"]) and all(
    torch.equal(torch.as_tensor(t), whole["optimizer"][key]) for key, t in moments
)
world = dist.get_world_size()
print(f"rank {{rank}} of {{world}}: model {{same_model}} optimizer {{same_optimizer}}", flush=True)
shutdown()  # as the project leaves its group: a bare destroy_process_group aborted 3 of 20 at exit
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4])
def test_a_two_process_checkpoint_loads_exactly_under_another_number_of_processes(
    project, two_process_run, nproc
):
    """Resharded: every rank's shards of the model and of AdamW's moments, gathered, equal the
    checkpoint's tensors bit for bit; then training goes on from it."""
    script = project / "reshard_check.py"
    script.write_text(RESHARD_CHECK.format(package=PACKAGE))
    checkpoints = str(two_process_run / "checkpoints")
    if nproc == 1:
        command, env = [sys.executable, str(script), checkpoints], _env(project)
    else:
        port = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   *port,
                   str(script), checkpoints]  # fmt: skip
        env = _env_ddp(project)
    done = warm_python.run(command, cwd=project, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Each rank prints its line at once; torchrun's pipes may join two without a newline (CI saw
    # "... optimizer Truerank 0 of 4: ...", which a word pattern read as one line).
    said = "(?:True|False)"
    lines = sorted(re.findall(rf"rank \d+ of \d+: model {said} optimizer {said}", done.stdout))
    assert lines == [f"rank {r} of {nproc}: model True optimizer True" for r in range(nproc)], (
        done.stdout
    )

    run_dir = project / "runs" / f"reshard-{nproc}"
    subprocess.run(["cp", "-r", str(two_process_run), str(run_dir)], check=True)
    resumed = _train(project, f"runs/reshard-{nproc}", 50, 16, nproc=nproc)
    assert resumed.stdout.count("resuming from") == 1
    warning = [line for line in resumed.stdout.splitlines() if "resharded exactly" in line]
    assert len(warning) == 1 and f"trained by 2 processes, resumed by {nproc}" in warning[0]
    train = [r for r in records(run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 51))
    assert [r for r in records(run_dir) if r["step"] <= 40] == records(two_process_run)


@pytest.mark.slow
def test_recomputed_blocks_train_and_reshard_bit_identical_to_kept_ones(project, two_process_run):
    """With --activation-checkpointing 1 on 2 ranks, the records of the reference run that kept
    its activations, bit for bit; its checkpoint resumed on 1 and on 3 processes trains on exactly
    as the reference's does (the blocks are recomputed before sharding, their names unchanged)."""
    recompute = ("--activation-checkpointing", "1")
    _train(project, "runs/ac", 40, 16, extra=recompute)
    assert records(project / "runs" / "ac") == records(two_process_run)
    for nproc in (1, 3):
        for name, source, extra in (("ac", "ac", recompute), ("kept", "two", ())):
            run_dir = project / "runs" / f"{name}-on-{nproc}"
            shutil.copytree(project / "runs" / source, run_dir)
            resumed = _train(project, f"runs/{run_dir.name}", 46, 16, nproc=nproc, extra=extra)
            assert f"trained by 2 processes, resumed by {nproc}" in resumed.stdout
        recomputed = records(project / "runs" / f"ac-on-{nproc}")
        assert [r["step"] for r in recomputed if r["split"] == "train"] == list(range(1, 47))
        assert recomputed == records(project / "runs" / f"kept-on-{nproc}")


@pytest.mark.slow
def test_a_killed_run_resumes_bit_identical(project, two_process_run):
    """SIGKILL of both workers and torchrun after step 25 is logged: nothing runs the stop
    handlers. The same command resumes from the newest checkpoint and ends with the very records."""
    command = _torchrun(project, "train", "--run-dir", "runs/killed", "--max-steps", "40",
                        "--batch-size", "16",
                        *SMALL, extra=("--nnodes", "1"))  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    workers = {}
    deadline = time.monotonic() + 300
    try:
        for line in launcher.stdout:
            if line.startswith("step 25/"):
                workers = _workers(launcher, PACKAGE)
                for pid in workers.values():  # each in a session of its own
                    os.kill(pid, signal.SIGKILL)
                launcher.kill()
                break
            assert time.monotonic() < deadline
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
    assert workers
    # Rank 0 holds the run folder's lock until the kernel has ended it: a resume before is refused.
    assert wait_until(lambda: not any(_alive(pid) for pid in workers.values()), timeout=30)
    run_dir = project / "runs" / "killed"
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    resumed = _train(project, "runs/killed", 40, 16)
    step = int(
        next(
            line for line in resumed.stdout.splitlines() if line.startswith("resuming from")
        ).split()[-1]
    )
    print(
        f"fsdp: killed after step 25 was logged (checkpoints then: {leftovers});"
        f" resumed at step {step}"
    )
    assert step in (20, 30)
    assert records(run_dir) == records(two_process_run)  # bit for bit
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_damaged_shard_is_reported_and_the_previous_checkpoint_used(project, two_process_run):
    run_dir = project / "runs" / "damaged"
    subprocess.run(["cp", "-r", str(two_process_run), str(run_dir)], check=True)
    newest = run_dir / "checkpoints" / "step-00000040"
    shard = sorted(newest.glob("*.distcp"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    done = _train(project, "runs/damaged", 50, 16)
    assert done.stdout.count(f"checkpoint {newest.relative_to(project)} is damaged") == 1, (
        done.stdout[-2000:]
    )
    assert "resuming from runs/damaged/checkpoints/step-00000030 at step 30" in done.stdout
    kept = [r for r in records(run_dir) if r["step"] <= 30]
    assert kept == [r for r in records(two_process_run) if r["step"] <= 30]


@pytest.mark.slow
def test_a_killed_worker_is_restarted_by_torchrun_and_the_run_ends_bit_identical(
    project, two_process_run
):
    """SIGKILL of rank 1 alone after step 25 under --max-restarts 1: torchrun restarts the group,
    which clears the dead save's temporary folder, resumes from the newest checkpoint folder and
    ends with the very records of the uninterrupted run."""
    command = _torchrun(project, "train", "--run-dir", "runs/restarted", "--max-steps", "40",
                        "--batch-size", "16", *SMALL,
                        extra=("--nnodes", "1", "--max-restarts", "1"))  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output, killed = [], None
    try:
        for line in launcher.stdout:
            output.append(line)
            if line.startswith("step 25/") and killed is None:
                killed = _workers(launcher, PACKAGE)[1]
                os.kill(killed, signal.SIGKILL)
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            for pid in _workers(launcher, PACKAGE).values():
                os.kill(pid, signal.SIGKILL)
            launcher.kill()
            launcher.wait()
    log = "".join(output)
    assert killed and launcher.returncode == 0, log[-4000:]
    resumed = [line for line in log.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 1 and resumed[0].endswith(("at step 20", "at step 30")), log[-3000:]
    run_dir = project / "runs" / "restarted"
    assert records(run_dir) == records(two_process_run)  # bit for bit


def test_a_resume_with_another_model_size_is_refused_in_one_line(project, two_process_run):
    """The settings are compared before any shard loads: a wider model gets the one line naming
    the change, not DCP's shape error from every rank."""
    run_dir = project / "runs" / "wider"
    subprocess.run(["cp", "-r", str(two_process_run), str(run_dir)], check=True)
    command = _torchrun(project, "train", "--run-dir", "runs/wider", "--max-steps", "50",
                        "--batch-size", "16", *SMALL, "--hidden-dim", "64",
                        extra=("--nnodes", "1", "--max-restarts", "3"))  # fmt: skip
    done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=300)
    assert done.returncode == 2  # a refusal, ended at once: a restart would refuse again
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "hidden_dim" in errors[0] and "-> 64" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert records(run_dir) == records(two_process_run)  # left as it was


def test_a_model_edit_that_changes_shapes_is_refused_in_one_line_naming_them(
    project, two_process_run, tmp_path
):
    """An edit to model.py (the first layer widened) is found in the shards' index before any
    shard loads: one line naming the tensors and their whole shapes, saved -> now, not DCP's size
    error from every rank; exit 2, as for a changed setting."""
    edited = tmp_path / "edited"
    shutil.copytree(project / "src", edited / "src")
    shutil.copytree(two_process_run, edited / "runs" / "two")
    model = edited / "src" / PACKAGE / "model.py"
    old = "nn.Linear(width, hidden_dim), nn.LayerNorm(hidden_dim)"
    assert old in model.read_text()
    model.write_text(
        model.read_text().replace(
            old, "nn.Linear(width, 2 * hidden_dim), nn.LayerNorm(2 * hidden_dim)"
        )
    )
    command = _torchrun(edited, "train", "--run-dir", "runs/two", "--max-steps", "50",
                        "--batch-size", "16", *SMALL, extra=("--nnodes", "1"))  # fmt: skip
    done = warm_python.run(command, cwd=edited, env=_env_ddp(edited), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "runs/two/checkpoints/step-00000040 holds a model with other shapes" in errors[0]
    assert "(body.0.0.weight (256, 16) -> (512, 16), body.0.0.bias (256,) -> (512,)," in errors[0]
    assert "Traceback" not in done.stderr
    assert records(edited / "runs" / "two") == records(two_process_run)  # left as it was


def test_checkpoints_by_the_clock_are_taken_by_every_rank_at_one_step_and_resume_exactly(
    project, two_process_run
):
    """--ckpt-minutes near zero: a checkpoint by the clock nearly every step, whichever rank's
    clock is due first (one all-reduce decides for all: a rank saving alone would hang DCP). The
    records equal the reference's, and a resume from a clock's checkpoint ends bit-identical."""
    args = ("train", "--run-dir", "runs/clock", "--max-steps", "40", "--batch-size", "16", *SMALL,
            "--ckpt-every", "1000", "--ckpt-minutes", "0.0001", "--keep-last", "100")  # fmt: skip
    command = _torchrun(project, *args, extra=("--nnodes", "1"))
    done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = project / "runs" / "clock"
    steps = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert len(steps) >= 5 and steps[-1] == 40, steps
    assert records(run_dir) == records(two_process_run)
    for step in steps:
        if step > 25:
            shutil.rmtree(run_dir / "checkpoints" / f"step-{step:08d}")
    command = _torchrun(project, *args, extra=("--nnodes", "1"))
    done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = max(step for step in steps if step <= 25)
    assert (
        f"resuming from runs/clock/checkpoints/step-{resumed:08d} at step {resumed}" in done.stdout
    )
    assert records(run_dir) == records(two_process_run)  # bit for bit


def test_a_full_disk_on_rank_1_is_named_by_rank_and_reason_with_no_traceback(project):
    """Every rank writes its shards: rank 1's fill the disk. DCP gathers each rank's exception into
    a CheckpointException whose text is one traceback a rank; the line names rank 1 and the disk
    full instead, rank 0 says it, and the job ends with 1 and that line, restarting nothing (3
    restarts of a disk that stays full before)."""
    fault = {"at": "fsync", "match": ".distcp", "nth": 1, "do": "ENOSPC", "rank": 1}
    done = _full_disk(project, "runs/full", fault)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-4000:]
    assert group_starts(done) == 1, output[-4000:]
    # Rank 0 says it, unless the agent's SIGTERM (sent once rank 1 has exited) ends it first;
    # the launcher's last line says it in any case.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("fsdp_demo: rank ") and len(errors) <= 1, output[-4000:]
    reason = last.split(" ended the job: ", 1)[1]
    assert reason.startswith("error: cannot write checkpoint runs/full/checkpoints/step-00000010")
    assert reason.endswith(": rank 1: No space left on device"), output[-4000:]
    assert errors in ([], [reason])


def test_a_full_disk_inside_torch_save_of_the_state_file_says_so_and_restarts_nothing(project):
    """Rank 0 writes state.pt with torch.save, whose zip writer turns the failed write into its own
    RuntimeError: the line was "[enforce fail at inline_container.cc:672] unexpected pos 704 vs
    598", after a traceback and 3 restarts. It names the checkpoint and the full disk now."""
    fault = {"at": "binwrite", "match": "state.pt", "nth": 2, "do": "ENOSPC"}
    done = _full_disk(project, "runs/full-state", fault)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-4000:]
    assert group_starts(done) == 1, output[-4000:]
    reason = "error: cannot write checkpoint runs/full-state/checkpoints/step-00000010: No space"
    assert done.stderr.rstrip().splitlines()[-1] == (
        f"fsdp_demo: rank 0 ended the job: {reason} left on device"
    ), output[-4000:]
    checkpoints = project / "runs" / "full-state" / "checkpoints"
    assert not list(checkpoints.iterdir())  # nothing half written is left


@pytest.mark.parametrize(
    "name",
    [
        "SIGTERM",
        pytest.param("SIGINT", marks=pytest.mark.slow),
        pytest.param("SIGUSR1", marks=pytest.mark.slow),
    ],
)
def test_a_stop_signal_to_one_worker_ends_the_job_with_its_status_spending_no_restart(
    project, two_process_run, name
):
    """A stop signal to rank 1 alone, with restarts allowed: every rank stops at the same step with
    its shards written, and the job exits with 128 plus the signal's number as for one to the
    launcher. The launcher restarted the group instead, which trained to the end: the job exited 0
    with a restart spent."""
    run_dir, signum = f"runs/rank-stopped-{name}", getattr(signal, name)
    command = _torchrun(project, "train", "--run-dir", run_dir, "--max-steps", "40",
                        "--batch-size", "16", *SMALL,
                        extra=("--nnodes", "1", "--max-restarts", "3"))  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output = []
    for line in launcher.stdout:
        output.append(line)
        if line.startswith("step 15/"):
            os.kill(_workers(launcher, PACKAGE)[1], signum)
    launcher.wait(timeout=120)
    log = "".join(output)
    assert launcher.returncode == 128 + signum and "Traceback" not in log, log[-3000:]
    assert sum(line.startswith("model: ") for line in log.splitlines()) == 1, log[-3000:]
    stopped = [line for line in log.splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and f"by {name}" in stopped[0], log[-3000:]
    assert log.rstrip().splitlines()[-1] == stopped[0] and "aborted" not in log, log[-3000:]
    step = int(stopped[0].split()[3])
    saved = project / run_dir / "checkpoints" / f"step-{step:08d}"
    state = torch.load(saved / "state.pt", map_location="cpu", weights_only=True)
    assert state["state"]["step"] == step and len(state["rng"]) == 2  # both ranks' streams
    _train(project, run_dir, 40, 16)
    assert records(project / run_dir) == records(two_process_run)  # bit for bit


def test_sigterm_to_the_launcher_ends_the_job_with_143_and_the_resume_is_bit_identical(
    project, two_process_run
):
    """SIGTERM to the launcher (what SLURM and Kubernetes send): every rank stops at one step with
    its shards written, rank 0 says so, and the job exits 143 without torchrun's traceback."""
    command = _torchrun(project, "train", "--run-dir", "runs/stopped", "--max-steps", "40",
                        "--batch-size", "16", *SMALL, extra=("--nnodes", "1"))  # fmt: skip
    launcher = subprocess.Popen(command, cwd=project, env=_env_ddp(project), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output = []
    for line in launcher.stdout:
        output.append(line)
        if line.startswith("step 15/"):
            launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)
    log = "".join(output)
    assert launcher.returncode == 143 and "Traceback" not in log, log[-3000:]
    stopped = [line for line in log.splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and "by SIGTERM" in stopped[0], log[-3000:]
    _train(project, "runs/stopped", 40, 16)
    assert records(project / "runs" / "stopped") == records(two_process_run)  # bit for bit


def test_the_skypilot_task_trains_stops_on_sigterm_and_resumes_bit_identical(
    project, two_process_run
):
    """scripts/train_skypilot.yaml's command on 2 "nodes" of 1 process, with SkyPilot's variables:
    stopped by SIGTERM, it resumes bit for bit (tests/test_ddp.py runs both launchers; the
    Kubeflow manifest runs the same script)."""
    args = ["--run-dir", "runs/skypilot", "--max-steps", "40", "--batch-size", "16", *SMALL]
    launchers.stop_and_resume(project, "skypilot", args, _env_ddp(project), two_process_run, _port)


def test_compile_runs_training_forwards_compiled_and_evaluation_eagerly(tmp_path, monkeypatch):
    """With --compile each shard unit's forward is compiled for training steps only: a graph for
    each block width in each mode ran past torch.compile's 8 graphs a piece of code, past which
    blocks silently ran uncompiled (the matrix's image fsdp checks printed the limit's warning)."""
    project = render(tmp_path / "compiled-fsdp", distributed="fsdp", compile=True)
    monkeypatch.syspath_prepend(str(project / "src"))
    sharding = importlib.import_module("compiled_fsdp.runtime.sharding")
    compiled = []

    def fake_compile(forward, **options):
        assert options == {"dynamic": False}

        def run(*args, **kwargs):
            compiled.append(args[0].shape)
            return forward(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    unit = torch.nn.Linear(3, 2)
    unit.forward = sharding.compiled_for_training(unit)
    unit(torch.ones(4, 3)).sum().backward()  # a training step: compiled
    with torch.no_grad():
        unit(torch.ones(5, 3))  # no gradients, as in validation: eager
    unit.eval()
    unit(torch.ones(6, 3))  # eval mode: eager
    assert compiled == [torch.Size([4, 3])]
