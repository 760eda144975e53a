"""Generated projects under fault injection: kills, full and read-only disks, corrupt
checkpoints, changed configs, NaN losses and malformed data. Nothing may be lost.

Faults come from tests/fault_inject/sitecustomize.py, which the project's process imports at
start-up (it is on PYTHONPATH here, never in the project): it kills the process or fails a system
call at a chosen point of a checkpoint write. Each test adds what it tried to the session tally
that tests/conftest.py prints at the end.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_python
from conftest import snapshot
from test_project import _command, _env, records, render

FAULTS = Path(__file__).resolve().parent / "fault_inject"
MAX_STEPS = 80
# 16 steps an epoch, a checkpoint every 10 steps, every step logged, bit-exact on the CPU.
SMALL_RUN = (
    "--max-train-examples", "1024", "--batch-size", "64", "--ckpt-every", "10",
    "--eval-every", "25", "--log-every", "1", "--deterministic", "--num-workers", "1",
    "--max-steps", str(MAX_STEPS),
)  # fmt: skip
SUITE = "faults (generated projects)"


def run(project: Path, *args, fault: dict | None = None, limit_memory: bool = False):
    """`python -m <package> ARGS` in the project, with at most one injected fault."""
    env = _env(project)
    if fault is not None:
        env["PYTHONPATH"] = f"{FAULTS}:{env['PYTHONPATH']}"
        env["SCAFFOLD_FAULT"] = json.dumps(fault)

    def small_address_space():  # a label that asks for a huge model fails, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))

    if not limit_memory:  # forked from a warm interpreter (tests/warm_python.py), its fault too
        return warm_python.run(_command(project, args), cwd=project, env=env, timeout=600)
    return subprocess.run(
        _command(project, args),
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=small_address_space if limit_memory else None,
    )


def train(project: Path, run_dir: Path, *extra, fault: dict | None = None):
    return run(project, "train", "--run-dir", run_dir, *SMALL_RUN, *extra, fault=fault)


def is_clean_error(done, code: int = 1) -> bool:
    """Exit `code`, one `error:` line on stderr, no traceback."""
    return (
        done.returncode == code
        and done.stderr.startswith("error: ")
        and len(done.stderr.splitlines()) == 1
        and "Traceback" not in done.stderr
    )


def usable(path: Path) -> bool:
    """Loads without pickled code and holds only finite floating-point tensors."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return isinstance(payload, dict) and all_finite(payload)


def all_finite(value) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(all_finite(v) for v in value)
    return True


def step_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*.pt"))


def newest_usable(run_dir: Path) -> Path | None:
    return next((p for p in reversed(step_files(run_dir)) if usable(p)), None)


def resumed_from(stdout: str) -> tuple[str, int] | None:
    found = re.search(r"^resuming from (\S+) at step (\d+)$", stdout, re.MULTILINE)
    return (found[1], int(found[2])) if found else None


def same_records(run_dir: Path, reference: Path, tally) -> bool:
    """metrics.jsonl equal byte for byte (floats are written in full); a difference is data lost."""
    same = (run_dir / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    tally[SUITE]["data lost"] += not same
    tally[SUITE]["runs recovered"] += same
    return same


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("faults") / "demo")


@pytest.fixture(scope="module")
def reference(project) -> Path:
    """The uninterrupted run every faulted run must end up equal to."""
    run_dir = project / "runs" / "reference"
    done = train(project, run_dir)
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.fixture(autouse=True)
def _tally_inputs(tally):
    tally[SUITE]["data lost"] += 0  # printed even when nothing was lost
    yield


# --- kills: every restart resumes from a valid checkpoint, and the records end up equal -------

# Where a kill lands. "step": from outside, right after the run prints a given step; "time": from
# outside, a given time after start (start-up, loading, resuming); the others inside a checkpoint
# write: its bytes half written ("torn"), written but not renamed ("replace"), renamed but the
# folder not yet synced ("replaced"), or while the oldest checkpoint is being deleted ("unlink").
KILLS = ("step", "time", "torn", "replace", "replaced", "unlink")


def kill_once(project: Path, run_dir: Path, kind: str, rng: random.Random, done_step: int):
    """Start the run with one kill planned; return the finished process and its stdout."""
    command = _command(project, ["train", "--run-dir", run_dir, *SMALL_RUN])
    env = _env(project)
    if kind not in ("step", "time"):
        inside = {
            "torn": {"at": "fsync", "do": "torn"},
            "replace": {"at": "replace", "do": "kill"},
            "replaced": {"at": "replaced", "do": "kill"},
            "unlink": {"at": "unlink", "do": "kill"},
        }[kind]
        nth = rng.randint(1, max(1, min(2, (MAX_STEPS - done_step) // 10)))
        env["PYTHONPATH"] = f"{FAULTS}:{env['PYTHONPATH']}"
        env["SCAFFOLD_FAULT"] = json.dumps({**inside, "match": "step-", "nth": nth})
    target = rng.randint(done_step + 1, MAX_STEPS - 1)  # for "step": always reached
    with subprocess.Popen(
        command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its loader worker too dies with it, closing the pipes
    ) as proc:  # fmt: skip

        def kill_all():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        def reap():  # a process that killed itself leaves its loader worker behind
            proc.wait()
            kill_all()

        threading.Thread(target=reap, daemon=True).start()
        timer = threading.Timer(rng.uniform(0.2, 2.0), kill_all)
        if kind == "time":
            timer.start()
        out = []
        for line in proc.stdout:
            out.append(line)
            if kind == "step" and line.startswith(f"step {target}/"):
                kill_all()
                break
        stdout = "".join(out) + proc.stdout.read()
        stderr = proc.stderr.read()
        proc.wait()
        timer.cancel()
    return proc.returncode, stdout, stderr


def kill_chain(project, reference, run_dir: Path, kinds: list[str], seed: int, tally) -> int:
    """Kill the run once per kind, restarting after each; then let it finish. Returns the kills."""
    rng = random.Random(seed)
    kills = 0
    for kind in kinds:
        expected = newest_usable(run_dir) if run_dir.exists() else None
        done_step = int(expected.stem.split("-")[1]) if expected else 0
        if done_step >= MAX_STEPS:
            break
        tally[SUITE]["inputs tried"] += 1
        code, stdout, stderr = kill_once(project, run_dir, kind, rng, done_step)
        assert code in (0, -signal.SIGKILL), (kind, code, stderr)
        kills += code == -signal.SIGKILL
        tally[SUITE]["faults injected"] += code == -signal.SIGKILL
        resumed = resumed_from(stdout)
        if expected is None:
            assert resumed is None, (kind, stdout)
        elif resumed is not None or "model:" in stdout:  # it got as far as choosing a checkpoint
            assert resumed == (str(expected), done_step), (kind, stdout, stderr)

    expected = newest_usable(run_dir)
    done = train(project, run_dir)
    assert done.returncode == 0, done.stderr
    if expected is not None and int(expected.stem.split("-")[1]) == MAX_STEPS:  # killed at the end
        assert f"{run_dir} is complete at step {MAX_STEPS}" in done.stdout, done.stdout
    elif expected is not None:
        assert resumed_from(done.stdout) == (str(expected), int(expected.stem.split("-")[1]))
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # no half-written file left
    assert all(usable(p) for p in (run_dir / "checkpoints").iterdir())
    assert same_records(run_dir, reference, tally)
    return kills


def test_kills_inside_a_checkpoint_write_lose_nothing(project, reference, tally):
    kinds = ["replace", "torn", "step", "replaced"]
    kills = kill_chain(project, reference, project / "runs" / "kill-fast", kinds, 0, tally)
    assert kills == len(kinds)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_kills_at_random_moments_lose_nothing(project, reference, tally, seed):
    kinds = [random.Random(seed * 101 + i).choice(KILLS) for i in range(6)]
    run_dir = project / "runs" / f"kill-{seed}"
    kills = kill_chain(project, reference, run_dir, kinds, seed, tally)
    assert kills >= len(kinds) - 1  # a timed kill may land after the run has finished


# --- corrupt checkpoints (truncated and zero-byte ones: tests/test_project.py) ----------------


def run_files(run_dir: Path) -> dict[Path, bytes]:
    """A run folder's files and their bytes, but for .lock, which names whoever opened it last."""
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}


def copy_of(reference: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(reference, copy)
    return copy


@pytest.mark.slow
def test_garbage_and_foreign_newest_checkpoints_are_skipped(project, reference, tmp_path, tally):
    copy = copy_of(reference, tmp_path)
    checkpoints = copy / "checkpoints"
    (checkpoints / "step-00000080.pt").write_bytes(random.Random(0).randbytes(50_000))
    torch.save({"weights": torch.ones(3)}, checkpoints / "step-00000070.pt")  # not ours
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 2

    done = train(project, copy)

    assert done.returncode == 0, done.stderr
    assert "step-00000080.pt is unreadable" in done.stdout
    assert "step-00000070.pt is not a checkpoint of this project" in done.stdout
    assert resumed_from(done.stdout) == (str(checkpoints / "step-00000060.pt"), 60)
    assert same_records(copy, reference, tally)


@pytest.mark.slow
def test_a_checkpoint_from_before_digests_resumes_the_run_unverified(
    project, reference, tmp_path, tally
):
    """A project updated in the middle of a run: its newest checkpoint has no digest."""
    copy = copy_of(reference, tmp_path)
    checkpoints = copy / "checkpoints"
    for later in sorted(checkpoints.glob("step-*.pt"))[-2:]:  # the run as it stood at step 60
        later.unlink()
    newest = max(checkpoints.glob("step-*.pt"))
    old = torch.load(newest, weights_only=True)
    del old["digest"]
    torch.save(old, newest)

    done = train(project, copy)

    assert done.returncode == 0, done.stderr
    assert f"warning: checkpoint {newest} has no digest" in done.stdout
    assert resumed_from(done.stdout) == (str(newest), 60)
    assert same_records(copy, reference, tally)


@pytest.mark.slow
def test_a_best_checkpoint_damaged_before_a_resume_is_said_and_never_reported(
    project, reference, tmp_path, tally
):
    copy = copy_of(reference, tmp_path)
    checkpoints = copy / "checkpoints"
    for later in sorted(checkpoints.glob("step-*.pt"))[-2:]:  # the run as it stood at step 60
        later.unlink()
    (checkpoints / "best.pt").write_bytes(b"")  # step 50's, the best: emptied
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1

    done = train(project, copy)

    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "best.pt" in line and "warning" in line]
    assert said == [
        f"warning: checkpoint {checkpoints / 'best.pt'} is unreadable (EOFError): the best model"
        " (step 50) is lost until a better validation"
    ], done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith("at step 50; checkpoint lost")
    assert not (checkpoints / "best.pt").exists()
    assert json.loads((copy / "run.json").read_text())["finished"]["best_checkpoint"] is None
    assert "at step 50; checkpoint lost" in run(project, "report", copy).stdout
    assert same_records(copy, reference, tally)


def flip_bytes_in_largest_tensor(path: Path, count: int = 16) -> str:
    """XOR `count` bytes in the middle of the largest tensor stored in a checkpoint's zip, leaving
    the zip and the pickle intact (torch stores no checksum of them): the name of the record."""
    with zipfile.ZipFile(path) as archive:
        info = max(
            (i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        )
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


def test_flipped_bytes_in_the_weights_are_found_and_the_previous_checkpoint_used(
    project, reference, tmp_path, tally
):
    """16 flipped bytes in step 80's largest tensor: torch.load reads them without complaint (before
    the digest, the run resumed from damaged weights); the digest check reports the file and the
    run resumes from step 70, ending with the reference's records."""
    copy = copy_of(reference, tmp_path)
    checkpoints = copy / "checkpoints"
    flip_bytes_in_largest_tensor(checkpoints / "step-00000080.pt")
    torch.load(checkpoints / "step-00000080.pt", weights_only=True)  # still loads: no zip error
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1

    done = train(project, copy)

    assert done.returncode == 0, done.stderr
    assert (
        f"warning: checkpoint {checkpoints / 'step-00000080.pt'} is damaged (its contents do not"
        " match its digest); trying the previous checkpoint"
    ) in done.stdout
    assert resumed_from(done.stdout) == (str(checkpoints / "step-00000070.pt"), 70)
    assert same_records(copy, reference, tally)


class _Payload:
    """Unpickling this runs code: it creates the file named in `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_a_checkpoint_carrying_pickled_code_never_runs_it(project, reference, tmp_path, tally):
    copy = copy_of(reference, tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"model": _Payload(marker)}, copy / "checkpoints" / "step-00000080.pt")
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1

    done = train(project, copy)

    assert done.returncode == 0, done.stderr
    assert "step-00000080.pt is unreadable" in done.stdout
    assert not marker.exists()
    assert same_records(copy, reference, tally)


# --- a full or read-only disk ------------------------------------------------------------------

NO_SPACE, READ_ONLY = "No space left on device", "Read-only file system"
IO_ERROR = "Input/output error"
# fault, and what the error says ({run}: the run folder)
SAVE_FAULTS = {
    "ENOSPC-writing-a-step": (
        {"at": "fsync", "match": "step-", "nth": 3, "do": "ENOSPC"},
        f"cannot write checkpoint {{run}}/checkpoints/step-00000030.pt: {NO_SPACE}",
    ),
    "ENOSPC-inside-torch.save": (  # torch's zip writer turned this into its own RuntimeError
        {"at": "binwrite", "match": "step-00000030", "nth": 3, "do": "ENOSPC"},
        f"cannot write checkpoint {{run}}/checkpoints/step-00000030.pt: {NO_SPACE}",
    ),
    "EROFS-renaming-a-step": (
        {"at": "replace", "match": "step-", "nth": 3, "do": "EROFS"},
        f"cannot write checkpoint {{run}}/checkpoints/step-00000030.pt: {READ_ONLY}",
    ),
    "ENOSPC-writing-best": (
        {"at": "fsync", "match": "best", "nth": 2, "do": "ENOSPC"},
        f"cannot write checkpoint {{run}}/checkpoints/best.pt: {NO_SPACE}",
    ),
    "EIO-syncing-the-folder": (
        {"at": "dirfsync", "match": "checkpoints", "nth": 3, "do": "EIO"},
        f"{{run}}/checkpoints/best.pt: {IO_ERROR}",
    ),
    "EROFS-deleting-the-oldest": (
        {"at": "unlink", "match": "step-0", "nth": 1, "do": "EROFS"},
        f"{{run}}/checkpoints/step-00000010.pt: {READ_ONLY}",
    ),
    "ENOSPC-writing-metrics": (
        {"at": "write", "match": "metrics.jsonl", "nth": 1},
        f"{{run}}/metrics.jsonl: {NO_SPACE}",
    ),
}
FAST_SAVE_FAULT = "ENOSPC-writing-a-step"


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        pytest.param(*case, id=key, marks=() if key == FAST_SAVE_FAULT else pytest.mark.slow)
        for key, case in SAVE_FAULTS.items()
    ]
    + [
        pytest.param(
            {"at": "fsync", "match": "metrics.jsonl", "nth": 1, "do": "ENOSPC"},
            f"{{run}}/metrics.jsonl: {NO_SPACE}",
            id="ENOSPC-syncing-metrics",
            marks=pytest.mark.slow,
        )
    ],
)
def test_a_failed_write_is_a_clear_error_and_the_run_resumes(
    project, reference, tmp_path, tally, fault, expected
):
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1

    done = train(project, run_dir, fault=fault)

    assert is_clean_error(done), done.stderr
    assert expected.format(run=run_dir) in done.stderr
    if "step-00000030.pt" in expected:  # the previous checkpoints intact, nothing newer
        assert [p.name for p in step_files(run_dir)] == ["step-00000010.pt", "step-00000020.pt"]
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    assert all(usable(p) for p in (run_dir / "checkpoints").iterdir())

    again = train(project, run_dir)  # the disk has room again
    assert again.returncode == 0, again.stderr
    assert same_records(run_dir, reference, tally)


@pytest.mark.slow
def test_a_read_only_run_folder_is_found_before_training(project, reference, tmp_path, tally):
    copy = copy_of(reference, tmp_path)
    before = run_files(copy)
    for run_dir in (copy, tmp_path / "new-run"):
        tally[SUITE]["inputs tried"] += 1
        tally[SUITE]["faults injected"] += 1
        done = run(
            project, "train", "--run-dir", run_dir, *SMALL_RUN, "--max-steps", "120",
            fault={"readonly": str(tmp_path)},
        )  # fmt: skip
        assert is_clean_error(done), done.stderr
        assert f"cannot write to run folder {run_dir}: Read-only file system" in done.stderr
        assert "step 1/" not in done.stdout and "step 81/" not in done.stdout
    assert not (tmp_path / "new-run").exists()
    assert run_files(copy) == before


@pytest.mark.slow
def test_a_run_folder_inside_a_file_is_found_before_training(project, tmp_path, tally):
    (tmp_path / "file").write_text("not a folder\n")
    tally[SUITE]["inputs tried"] += 1
    done = train(project, tmp_path / "file" / "run")
    assert is_clean_error(done), done.stderr
    run_dir, file = tmp_path / "file" / "run", tmp_path / "file"
    assert f"--run-dir {run_dir}: {file} is a file: name a folder" in done.stderr


# --- resuming with another model or data --------------------------------------------------------


@pytest.mark.slow
def test_a_resume_that_changes_model_and_data_names_every_field(
    project, reference, tmp_path, tally
):
    copy = copy_of(reference, tmp_path)
    before = run_files(copy)
    tally[SUITE]["inputs tried"] += 1
    done = train(
        project, copy, "--n-layers", "3", "--dropout", "0.2", "--seed", "1",
        "--max-train-examples", "512",
    )  # fmt: skip
    assert is_clean_error(done, code=2), done.stderr
    for field in ("n_layers 2 -> 3", "dropout 0.1 -> 0.2", "seed 0 -> 1", "max_train_examples"):
        assert field in done.stderr
    assert "max_train_examples 1024 -> 512" in done.stderr
    assert run_files(copy) == before


@pytest.mark.slow
def test_a_resume_on_changed_data_contents_is_refused(project, tmp_path, tally):
    rng = np.random.default_rng(0)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((1200, 6)), y=rng.integers(0, 3, 1200))
    done = train(project, tmp_path / "run", "--data", data, "--max-steps", "20")
    assert done.returncode == 0, done.stderr
    np.savez(data, x=rng.standard_normal((1200, 6)), y=rng.integers(0, 3, 1200))  # same shapes
    tally[SUITE]["inputs tried"] += 1

    again = train(project, tmp_path / "run", "--data", data, "--max-steps", "40")

    assert is_clean_error(again, code=2), again.stderr
    assert "data" in again.stderr


# --- NaN and inf --------------------------------------------------------------------------------

WHAT_TO_CHECK = ("--lr", "precision", "inspect-data")


def test_a_nan_loss_stops_the_run_naming_the_step(project, tmp_path, tally):
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    done = train(project, run_dir, "--lr", "1e30", "--ckpt-every", "1")
    assert is_clean_error(done), done.stderr
    step = int(re.search(r"loss is (?:nan|inf) at step (\d+)", done.stderr)[1])
    assert all(word in done.stderr for word in WHAT_TO_CHECK)
    assert [int(p.stem.split("-")[1]) for p in step_files(run_dir)][-1] == step - 1
    assert all(usable(p) for p in (run_dir / "checkpoints").iterdir())  # every tensor finite


@pytest.mark.slow
def test_a_nan_between_logging_steps_never_reaches_a_checkpoint(project, tmp_path, tally):
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    done = train(project, run_dir, "--lr", "1e30", "--log-every", "20", "--ckpt-every", "5")
    assert is_clean_error(done), done.stderr
    step = int(re.search(r"loss is (?:nan|inf) at step (\d+)", done.stderr)[1])
    assert step <= 5  # stopped at the first save after the loss went bad (step 2), not step 20
    assert all(usable(p) for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_fp16_steps_skipped_by_the_scaler_are_counted_not_fatal(tmp_path, tally):
    project = render(tmp_path / "fp16", device="cuda", precision="fp16")
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    done = run(
        project, "train", "--run-dir", tmp_path / "run", *SMALL_RUN, "--device", "cpu",
        "--max-steps", "40", fault={"scaler_init_scale": 2.0**24},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    train_records = [r for r in records(tmp_path / "run") if r["split"] == "train"]
    skipped = train_records[-1]["skipped_steps"]
    assert 0 < skipped < 40  # the scale came down to where fp16 fits, and training went on
    assert "the GradScaler skipped" in done.stdout
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    # Each skip halves the scale (no growth within 40 steps): the count is exact, not a guess.
    newest = max((tmp_path / "run" / "checkpoints").glob("step-*.pt"))
    scale = torch.load(newest, weights_only=True)["scaler"]["scale"]
    assert 2.0**24 * 0.5**skipped == scale
    assert all(
        a["skipped_steps"] <= b["skipped_steps"] for a, b in itertools.pairwise(train_records)
    )


# --- malformed data: named, exit 2, before any training ---------------------------------------
# (text in a CSV cell, a fractional label, an empty or non-UTF-8 CSV, an npz without y: see
# tests/test_project.py)


def _npz(**arrays):
    def write(path: Path) -> None:
        with path.open("wb") as f:
            np.savez(f, **arrays)

    return write


def _bytes(content: bytes):
    return lambda path: path.write_bytes(content)


def _pickled_npz(marker: Path):
    def write(path: Path) -> None:
        with path.open("wb") as f:
            np.savez(f, x=np.array([_Payload(marker)], dtype=object), y=np.zeros(1))

    return write


MALFORMED = {
    "npz-without-x": ("d.npz", _npz(y=np.zeros(10)), "d.npz: missing array(s) x"),
    "npz-1d-x": ("d.npz", _npz(x=np.zeros(10), y=np.zeros(10)), "need x of shape (N, F)"),
    "npz-text-x": ("d.npz", _npz(x=np.array([["a"]] * 9), y=np.zeros(9)), "must be numeric"),
    "empty-label": (
        "d.csv",
        _bytes(b"a,b,label\n1,2,\n2,3,\n"),
        "d.csv: 'label' (the last column: no --label given) has no values: name the column",
    ),
    "ragged-row": (
        "d.csv",
        _bytes(b"a,b,label\n1,2,0\n3,1\n"),
        "d.csv: CSV parse error: Expected 3 columns, got 2",
    ),
    "header-only": ("d.csv", _bytes(b"a,b,label\n"), "d.csv: need a header row"),
    "inf-feature": ("d.csv", _bytes(b"a,b,label\n1,2,0\n1,inf,1\n"), "example 1 has b inf"),
    "wrong-suffix": (
        "d.txt",
        _bytes(b"a,label\n1,0\n"),
        "d.txt: expected a .csv, .parquet or .npz file",
    ),
    "missing-file": ("d.csv", None, "d.csv: no such file"),
    "gzip-named-csv": (  # was pyarrow's "straddling object straddles two block boundaries"
        "d.csv",
        _bytes(gzip.compress(b"a,b,label\n" + b"1,2,0\n" * 5000)),
        "d.csv: a compressed file (gzip or zip), not CSV text",
    ),
    "label-column-only": ("d.csv", _bytes(b"label\n0\n1\n"), "d.csv: no feature columns"),
    "inf-label": ("d.csv", _bytes(b"a,label\n1,0\n2,inf\n"), "example 1 has label inf"),
    "complex-npz": (
        "d.npz",
        _npz(x=np.ones((9, 2), np.complex64), y=np.zeros(9)),
        "complex64 values",
    ),
}
FAST_MALFORMED = {"npz-without-x", "missing-file"}


@pytest.mark.slow
def test_a_garbage_npz_is_named(project, tmp_path, tally):
    (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 not really a zip file")
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "train", "--data", tmp_path / "d.npz", "--run-dir", tmp_path / "run")
    assert is_clean_error(done, code=2), done.stderr
    assert "d.npz: not a readable .npz" in done.stderr


@pytest.mark.parametrize(
    ("name", "write", "expected"),
    [
        pytest.param(*case, id=key, marks=() if key in FAST_MALFORMED else pytest.mark.slow)
        for key, case in MALFORMED.items()
    ],
)
def test_malformed_data_is_named_before_training(project, tmp_path, tally, name, write, expected):
    if write is not None:
        write(tmp_path / name)
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "train", "--data", tmp_path / name, "--run-dir", tmp_path / "run")
    assert is_clean_error(done, code=2), done.stderr
    assert expected in done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


# The regression and custom tasks read their own files: cases of theirs (once tracebacks, a
# meaningless loss, or a 170 KB error line).
MALFORMED_BY_TASK = {
    "regression-huge-target": (
        "regression",
        "d.csv",
        _bytes(b"a,target\n1,0.5\n2,1e200\n"),
        "example 1 has target 1e+200",
    ),
    "custom-truncated-npz": (
        "custom",
        "d.npz",
        lambda p: p.write_bytes(_npz_bytes()[:300]),
        "not a readable .npz",
    ),
    "custom-object-arrays": (
        "custom",
        "d.npz",
        _npz(x=np.ones((9, 2), object), y=np.zeros(9)),
        "not a readable .npz",
    ),
    "custom-text-inputs": (
        "custom",
        "d.npz",
        _npz(x=np.array([["a"]] * 9), y=np.zeros(9)),
        "the inputs are <U1",
    ),
    "custom-an-npy": (
        "custom",
        "d.npy",
        lambda p: np.save(p, np.zeros((3000, 4))),
        "expected a .npz file",
    ),
}


def _npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((300, 4), np.float32), y=np.zeros(300, np.float32))
    return buffer.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MALFORMED_BY_TASK))
def test_malformed_data_of_each_task_is_one_line_before_training(tracked, tmp_path, tally, case):
    task, name, write, expected = MALFORMED_BY_TASK[case]
    project = tracked("none", task=task)
    write(tmp_path / name)
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "train", "--data", tmp_path / name, "--run-dir", tmp_path / "run")
    assert is_clean_error(done, code=2), done.stderr
    assert expected in done.stderr and len(done.stderr) < 300
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_npz_with_pickled_objects_is_refused_unread(project, tmp_path, tally):
    marker = tmp_path / "code-ran"
    _pickled_npz(marker)(tmp_path / "d.npz")
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "train", "--data", tmp_path / "d.npz", "--run-dir", tmp_path / "run")
    assert is_clean_error(done, code=2), done.stderr
    assert "d.npz" in done.stderr and not marker.exists()


@pytest.mark.slow
def test_a_value_beyond_float32_is_named(project, tmp_path, tally):
    rows = ["a,b,label"] + [f"{i},{i % 7},{i % 3}" for i in range(300)]
    rows[5] = "1e39,2,1"
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "train", "--data", tmp_path / "d.csv", "--run-dir", tmp_path / "run")
    assert is_clean_error(done, code=2), done.stderr
    assert "d.csv" in done.stderr and "example 4" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_label_far_out_of_range_is_a_class_of_its_own_not_an_index(project, tmp_path, tally):
    """Labels are class names, numbers too (tables as they come): 1000000000 is a fourth class with
    one example, not an index that would size a billion-wide head (read under a memory limit)."""
    rows = ["a,b,label"] + [f"{i},{i % 7},{i % 3}" for i in range(300)]
    rows[5] = "4,2,1000000000"
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    tally[SUITE]["inputs tried"] += 1
    done = run(project, "inspect-data", "--data", tmp_path / "d.csv", limit_memory=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "'1000000000': 1}" in done.stdout, done.stdout


# --- stop signals: the step's checkpoint written, the run resumed exactly -----------------------

STOPPED = re.compile(
    r"^stopped at step (\d+) by (SIG\w+); checkpoint (\S+); run the same command to resume$"
)


def signal_at_step(command, cwd, env, step: int, signum: int, to_group: bool):
    """Start `command` and send `signum` once it prints step `step`; returns the process, the
    seconds from signal to exit, stdout and stderr. `to_group`: the whole process group, as a
    terminal's Ctrl-C does."""
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        out, sent = [], None
        for line in proc.stdout:
            out.append(line)
            if sent is None and line.startswith(f"step {step}/"):
                (os.killpg if to_group else os.kill)(proc.pid, signum)
                sent = time.perf_counter()
        proc.wait(timeout=120)
        seconds = time.perf_counter() - sent if sent else None
        stderr = proc.stderr.read()
    return proc, seconds, "".join(out), stderr


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["state"]["step"]


SIGNALLED_AT = 33  # between checkpoints 30 and 40: a stop that saved nothing would lose steps


@pytest.mark.parametrize(
    ("name", "to_group"),
    [("SIGTERM", False), pytest.param("SIGINT", True, marks=pytest.mark.slow), ("SIGUSR1", False)],
    ids=["SIGTERM", "Ctrl-C", "SIGUSR1"],
)
def test_a_stop_signal_checkpoints_that_step_and_the_run_resumes_exactly(
    project, reference, tmp_path, tally, name, to_group
):
    """SIGTERM (kill, SLURM, Kubernetes), Ctrl-C (SIGINT to the process group, loader workers
    included) and SIGUSR1 stop the run after the step in progress, with that step's checkpoint."""
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    run_dir = tmp_path / "run"
    signum = getattr(signal, name)
    command = _command(project, ["train", "--run-dir", run_dir, *SMALL_RUN])
    proc, seconds, _, stderr = signal_at_step(
        command, project, _env(project), SIGNALLED_AT, signum, to_group
    )

    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    stopped = STOPPED.match(stderr.strip())
    assert stopped and stopped[2] == name, stderr
    step, checkpoint = int(stopped[1]), Path(stopped[3])
    assert SIGNALLED_AT < step < MAX_STEPS  # the step in progress when the signal came, or the next
    assert checkpoint == step_files(run_dir)[-1] and checkpoint_step(checkpoint) == step
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    assert seconds < 10, f"{seconds:.2f} s from {name} to exit"
    print(
        f"{name}: signalled after step {SIGNALLED_AT}, stopped at {step}, exit in {seconds:.2f} s"
    )

    again = train(project, run_dir)
    assert again.returncode == 0, again.stderr
    assert resumed_from(again.stdout) == (str(checkpoint), step)
    assert same_records(run_dir, reference, tally)  # bit-identical: the stop cost no steps


@pytest.mark.parametrize("inside", ["torch.save", "fsync"])
def test_a_second_ctrl_c_aborts_at_once_even_inside_a_save(
    project, reference, tmp_path, tally, inside
):
    """Two SIGINTs while step 20's checkpoint is written: no traceback (torch's zip writer raises
    its own RuntimeError when interrupted), no temporary file, step 10's checkpoint intact."""
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    run_dir = tmp_path / "run"
    at = {"torch.save": {"at": "binwrite", "nth": 3}, "fsync": {"at": "fsync", "nth": 1}}[inside]
    done = train(project, run_dir, fault={**at, "match": "step-00000020", "do": "SIGINT2"})

    assert done.returncode == 130, done.stderr
    assert done.stderr == (
        "aborted by a second SIGINT: the newest checkpoint is intact;"
        " run the same command to resume\n"
    )
    assert [p.name for p in step_files(run_dir)] == ["step-00000010.pt"]
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    assert all(usable(p) for p in (run_dir / "checkpoints").iterdir())

    again = train(project, run_dir)
    assert again.returncode == 0, again.stderr
    assert same_records(run_dir, reference, tally)


def test_one_ctrl_c_inside_a_save_finishes_it_then_stops(project, reference, tmp_path, tally):
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    run_dir = tmp_path / "run"
    done = train(
        project,
        run_dir,
        fault={"at": "binwrite", "match": "step-00000020", "nth": 3, "do": "SIGINT"},
    )

    assert done.returncode == 130, done.stderr
    stopped = STOPPED.match(done.stderr.strip())
    assert stopped and int(stopped[1]) == 21, done.stderr  # step 20's save done, then one more step
    assert [checkpoint_step(p) for p in step_files(run_dir)] == [10, 20, 21]
    again = train(project, run_dir)
    assert again.returncode == 0, again.stderr
    assert same_records(run_dir, reference, tally)


# --- one writer per run folder -----------------------------------------------------------------


def test_a_second_writer_is_refused_at_once_naming_the_first(project, tmp_path, tally):
    """Two `train` on one --run-dir: the second exits 2 before writing anything, naming the PID and
    host that hold it; the first goes on undisturbed. The lock is the kernel's (fcntl): the kill
    tests above restart after SIGKILL, so a dead holder never leaves it stuck."""
    tally[SUITE]["inputs tried"] += 1
    run_dir = tmp_path / "run"
    long_run = [*SMALL_RUN, "--max-steps", "100000", "--patience", "0"]  # until stopped
    command = _command(project, ["train", "--run-dir", run_dir, *long_run])
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, cwd=project, env=_env(project), **pipes) as first:
        for line in first.stdout:
            if line.startswith("step 5/"):
                break
        # The first prints a line a step: unread, its pipe fills and blocks it in print, where
        # SIGTERM cannot stop it (seen once in CI, under load: first.wait timed out).
        threading.Thread(target=first.stdout.read, daemon=True).start()
        started = time.perf_counter()
        second = train(project, run_dir)
        seconds = time.perf_counter() - started
        still_running = first.poll() is None
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        first_err = first.stderr.read()

    assert is_clean_error(second, code=2), second.stderr
    assert f"is in use by pid {first.pid} on {socket.gethostname()}" in second.stderr
    assert second.stdout == ""  # refused before loading data, model or checkpoints
    assert seconds < 30, seconds  # at once: python and torch start-up
    assert still_running
    assert first.returncode == 128 + signal.SIGTERM, first_err
    step = int(STOPPED.match(first_err.strip())[1])
    train_steps = [r["step"] for r in records(run_dir) if r["split"] == "train"]
    assert train_steps == list(range(1, step + 1))  # the first run's records all there, once


# --- resume semantics: each setting kept (a change refused) or applied on purpose ---------------


def test_a_resume_that_changes_the_learning_rate_is_refused_naming_it(
    project, reference, tmp_path, tally
):
    """--lr and the schedule fields were ignored on resume (the optimizer's saved lr won) while
    the new checkpoints recorded the new value: now they are kept, and a change refused."""
    copy = copy_of(reference, tmp_path)
    before = run_files(copy)
    tally[SUITE]["inputs tried"] += 1
    done = train(project, copy, "--lr", "1e-3", "--warmup-steps", "5")
    assert is_clean_error(done, code=2), done.stderr
    assert "lr 0.003 -> 0.001" in done.stderr and "warmup_steps 100 -> 5" in done.stderr
    assert run_files(copy) == before


WARM = ("--warmup-steps", "10")  # the cosine decay from step 10 to min_lr at step MAX_STEPS
PEAK_LR, MIN_LR = 3e-3, 3e-4  # the classification project's defaults


@pytest.fixture(scope="module")
def decaying(project) -> Path:
    """A finished run with WARM: its decay is under way when a resume changes --max-steps."""
    run_dir = project / "runs" / "decaying"
    done = train(project, run_dir, *WARM)
    assert done.returncode == 0, done.stderr
    return run_dir


def cosine_lr(step: int, max_steps: int, warmup: int = 10) -> float:
    """optim.lr_factor's learning rate for step `step` (counted from 1) of a plan of max_steps."""
    progress = (step - 1 - warmup) / (max_steps - warmup)
    return MIN_LR + (PEAK_LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def test_a_finished_run_says_it_is_complete_and_a_raised_max_steps_extends_it_smoothly(
    project, decaying, tmp_path, tally
):
    """Raising --max-steps on a finished run made the learning rate jump (the cosine decay was
    re-planned over the new length). The decay keeps its planned horizon; steps past it train at
    min_lr."""
    run_dir = copy_of(decaying, tmp_path)
    before = run_files(run_dir)
    tally[SUITE]["inputs tried"] += 2
    done = train(project, run_dir, *WARM)
    assert done.returncode == 0, done.stderr
    assert (
        f"{run_dir} is complete at step {MAX_STEPS}: raise --max-steps to train on" in done.stdout
    )
    assert run_files(run_dir) == before  # nothing rewritten

    longer = train(project, run_dir, *WARM, "--max-steps", str(MAX_STEPS + 20))
    assert longer.returncode == 0, longer.stderr
    said = f"schedule: the cosine decay keeps its plan of {MAX_STEPS} steps; steps past it train at"
    assert any(line.startswith(said) for line in longer.stdout.splitlines()), longer.stdout
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if r["split"] == "train"}
    assert sorted(lrs) == list(range(1, MAX_STEPS + 21))
    assert lrs[MAX_STEPS - 1] > lrs[MAX_STEPS] > MIN_LR  # still decaying at the planned end
    after = [lrs[s] for s in range(MAX_STEPS + 1, MAX_STEPS + 21)]
    assert after == pytest.approx([MIN_LR] * 20), lrs  # on at the floor: no jump up


def test_a_lowered_max_steps_replans_the_decay_says_so_and_resumes_exactly(
    project, decaying, tmp_path, tally
):
    """A lower --max-steps was accepted silently and the decay kept its old horizon: the last step
    trained at most of the peak rate. Now the decay is re-planned to end there, from the first
    resumed step, and a resume of that session with the same command is still exact."""
    run_dir = copy_of(decaying, tmp_path)
    for step in (70, 80):  # resumed at step 60 of the 80 planned
        (run_dir / "checkpoints" / f"step-{step:08d}.pt").unlink()
    shorter = (*WARM, "--max-steps", "70", "--ckpt-every", "5")
    tally[SUITE]["inputs tried"] += 2

    done = train(project, run_dir, *shorter)

    assert done.returncode == 0, done.stderr
    said = "schedule: --max-steps 70 re-plans the cosine decay to end there, not at step 80"
    assert said in done.stdout.splitlines(), done.stdout
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if r["split"] == "train"}
    planned = {r["step"]: r["lr"] for r in records(decaying) if r["split"] == "train"}
    assert [lrs[s] for s in range(1, 61)] == [planned[s] for s in range(1, 61)]
    replanned = [lrs[s] for s in range(61, 71)]
    assert replanned == pytest.approx([cosine_lr(s, 70) for s in range(61, 71)])
    assert replanned[0] < 0.6 * planned[61]  # stepped down at once, from the first resumed step

    again = copy_of(run_dir, tmp_path / "again")  # stopped after step 65's checkpoint
    (again / "checkpoints" / "step-00000070.pt").unlink()
    resumed = train(project, again, *shorter)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed_from(resumed.stdout) == (str(again / "checkpoints" / "step-00000065.pt"), 65)
    assert "schedule:" not in resumed.stdout  # planned for 70 since step 60
    assert (again / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()


def test_a_max_steps_below_the_step_reached_is_refused(project, reference, tmp_path, tally):
    """It said the run was complete (a run stopped at step 60 of 80 resumed with --max-steps 50),
    or trained on; now it is one line, and nothing is written."""
    copy = copy_of(reference, tmp_path)
    before = run_files(copy)
    tally[SUITE]["inputs tried"] += 1
    done = train(project, copy, "--max-steps", "50")
    assert is_clean_error(done, code=2), done.stderr
    assert done.stderr == (
        f"error: {copy} is at step 80 (of 80 planned), past --max-steps 50: give --max-steps 80"
        " or more, or start over in a new --run-dir\n"
    )
    assert run_files(copy) == before


def test_deleted_checkpoints_are_refused_and_a_run_never_checkpointed_starts_again(
    project, reference, tmp_path, tally
):
    """A run folder whose checkpoints/ was deleted started again at step 0, overwriting its records.
    A run killed before its first checkpoint (checkpoints/ there, empty) still starts again."""
    copy = copy_of(reference, tmp_path)
    shutil.rmtree(copy / "checkpoints")
    before = run_files(copy)
    tally[SUITE]["inputs tried"] += 2
    done = train(project, copy)
    assert is_clean_error(done, code=2), done.stderr
    missing = f"{copy / 'checkpoints'} is missing, so the run in {copy} cannot resume"
    assert done.stderr == f"error: {missing}: start over in a new --run-dir\n"
    assert run_files(copy) == before and not (copy / "checkpoints").exists()

    emptied = copy_of(reference, tmp_path / "emptied")  # its step files deleted, best.pt kept
    for path in step_files(emptied):
        path.unlink()
    before = run_files(emptied)
    tally[SUITE]["inputs tried"] += 1
    done = train(project, emptied)
    assert is_clean_error(done, code=2), done.stderr
    assert done.stderr.startswith(f"error: {emptied / 'checkpoints'} holds no step checkpoint"), (
        done.stderr
    )
    assert run_files(emptied) == before

    run_dir, short = tmp_path / "killed", ("--max-steps", "12")
    first_save = {"at": "replace", "match": "step-", "nth": 1, "do": "kill"}
    assert train(project, run_dir, *short, fault=first_save).returncode == -signal.SIGKILL
    assert (run_dir / "run.json").exists() and not step_files(run_dir)
    again = train(project, run_dir, *short)
    assert again.returncode == 0, again.stderr
    assert resumed_from(again.stdout) is None
    assert [r["step"] for r in records(run_dir) if r["split"] == "train"] == list(range(1, 13))


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (("--seed", "-1"), "seed must be in [0, 2**32)"),
        (("--seed", str(2**32)), "seed must be in [0, 2**32)"),
        (("--device", "cuda:abc"), "device must be cpu, cuda or mps"),
        (("--lr", "inf"), "lr must be a finite number > 0, got inf"),
        (("--lr", "nan"), "lr must be a finite number > 0, got nan"),
        (
            ("--warmup-steps", "100000", "--max-steps", "20"),
            "--warmup-steps 100000 must be below --max-steps 20, or the run ends inside its warmup",
        ),
        (
            ("--warmup-steps", str(MAX_STEPS)),
            f"--warmup-steps {MAX_STEPS} must be below --max-steps",
        ),
    ],
    ids=[
        "seed-negative",
        "seed-too-big",
        "device-unparseable",
        "lr-inf",
        "lr-nan",
        "warmup-past-the-end",
        "warmup-at-the-end",
    ],
)
def test_a_bad_option_is_one_line_and_nothing_is_written(
    project, tmp_path, tally, option, expected
):
    """--seed -1 and --device cuda:abc were tracebacks, --lr inf trained, and so did a warmup past
    the run's end; now refused up front. The default warmup (100 steps) is not held to that: the
    reference run trains MAX_STEPS (80) steps with it."""
    tally[SUITE]["inputs tried"] += 1
    run_dir = tmp_path / "run"
    done = train(project, run_dir, *option)
    assert is_clean_error(done, code=2), done.stderr
    assert expected in done.stderr
    assert not run_dir.exists()


def test_the_command_line_works_with_docstrings_stripped(project, tally):
    """`python -OO` strips docstrings; the parser's description came from one (a crash)."""
    tally[SUITE]["inputs tried"] += 1
    package = next((project / "src").iterdir()).name
    done = subprocess.run(
        [sys.executable, "-OO", "-m", package, "train", "--help"],
        cwd=project, env=_env(project), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--max-steps" in done.stdout


# --- trackers and run records after a kill ------------------------------------------------------

# A kill right after the newest checkpoint's rename, before the tracker was sent its records (MLflow
# lost 4 of 80 steps there), and one before the first checkpoint (its MLflow run stayed RUNNING).
TRACKER_KILLS = {
    "after-a-checkpoint": {"at": "replaced", "match": "step-", "nth": 3, "do": "kill"},
    "before-the-first-checkpoint": {"at": "replace", "match": "step-", "nth": 1, "do": "kill"},
}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A project per tracker and task, each rendered once."""
    projects: dict[tuple[str, str], Path] = {}

    def project_for(tracker: str, task: str = "classification") -> Path:
        if (tracker, task) not in projects:
            folder = tmp_path_factory.mktemp(f"{task}-{tracker}") / "demo"
            projects[tracker, task] = render(folder, tracker=tracker, task=task)
        return projects[tracker, task]

    return project_for


def tracker_series(run_dir: Path, tracker: str) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs as the tracker holds them, in step order."""
    if tracker == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [r.info.status for r in runs] == ["FINISHED"]  # one run, closed
        run_id = runs[0].info.run_id
        tags = client.get_run(run_id).data.metrics
        return {
            tag: sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
            for tag in tags
        }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {
        tag: [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)]  # float32
        for tag in events.Tags()["scalars"]
    }


def series_of(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records(run_dir):
        for name, value in record.items():
            if name not in ("step", "split"):
                series.setdefault(f"{record['split']}/{name}", []).append((record["step"], value))
    return series


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(TRACKER_KILLS))
@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard"])
def test_a_tracker_holds_each_step_once_in_one_run_after_a_kill(
    tracked, tmp_path, tally, monkeypatch, tracker, kill
):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the project's tracker does
    project = tracked(tracker)
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1

    killed = train(project, run_dir, fault=TRACKER_KILLS[kill])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = train(project, run_dir)

    assert done.returncode == 0, done.stderr
    expected = series_of(run_dir)
    assert [step for step, _ in expected["train/loss"]] == list(range(1, MAX_STEPS + 1))
    assert tracker_series(run_dir, tracker) == expected


def killed_after_step_40(project: Path, run_dir: Path) -> None:
    fault = {"at": "replaced", "match": "step-", "nth": 4, "do": "kill"}
    assert train(project, run_dir, fault=fault).returncode == -signal.SIGKILL


# The file, what it is damaged with (None: deleted), and what report and diagnose then say.
DAMAGED_RECORDS = {
    "run.json-deleted": ("run.json", None, "is missing"),
    "run.json-garbage": ("run.json", b"\x00\xff not json", "is damaged (not JSON)"),
    "run.json-wrong-shape": ("run.json", b"123\n", "is damaged (not a run record)"),
    "run.json-other-object": (
        "run.json",
        b'{"foo": 1}\n',
        "is damaged (no valid project, seed, config, git, versions)",
    ),
    "run.json-wrong-inner-shapes": (  # report, diagnose and resumes read these: tracebacks
        "run.json",
        lambda old: json.dumps({**json.loads(old), "git": {"commit": 5}, "resumed": 5}).encode(),
        "is damaged (no valid git.commit, git.dirty, resumed)",
    ),
    "metrics-wrong-shapes": (
        "metrics.jsonl",
        b'123\n{"foo": 1}\n\xff\xfe not utf-8\n',
        "3 damaged lines (21, 22, 23)",
    ),
    "metrics-records-of-wrong-shapes": (  # the first was kept as step 21's record
        "metrics.jsonl",
        b'{"step": 21, "split": "train", "loss": 1.0}\n{"step": 21, "split": "val", "loss": "x"}\n'
        b'{"step": true, "split": "val", "loss": 1.0}\n',
        "3 damaged lines (21, 22, 23)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGED_RECORDS))
def test_damaged_run_records_are_repaired_on_resume_and_named_by_report(
    project, reference, tmp_path, tally, case
):
    """A deleted or garbage run.json, or metrics.jsonl lines of the wrong shape or not UTF-8,
    stopped every later train and report with a traceback."""
    name, damage, said = DAMAGED_RECORDS[case]
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    killed_after_step_40(project, run_dir)
    path = run_dir / name
    if damage is None:
        path.unlink()
    elif callable(damage):
        path.write_bytes(damage(path.read_bytes()))
    elif name == "metrics.jsonl":  # inserted between step 20's records and the rest
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:20]) + damage + b"".join(lines[20:]))
    else:
        path.write_bytes(damage)

    if name == "run.json":  # report and diagnose name it in one line
        for command, code in (("report", 1), ("diagnose", 2)):
            shown = run(project, command, run_dir)
            assert is_clean_error(shown, code=code), shown.stderr
            assert f"error: {path} {said}" in shown.stderr
    else:
        shown = run(project, "report", run_dir)
        assert shown.returncode == 0, shown.stderr
        assert f"warning: {path}: {said} skipped" in shown.stderr
        assert shown.stderr.count("warning: ") == 1, shown.stderr  # read once, said once

    done = train(project, run_dir)

    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert resumed_from(done.stdout) == (str(run_dir / "checkpoints" / "step-00000040.pt"), 40)
    if name == "run.json":
        assert "rebuilt from this command's settings" in done.stderr
        record = json.loads(path.read_text())
        assert record["rebuilt_at_step"] == 40 and record["resumed"][0]["at_step"] == 40
        assert record["finished"]["step"] == MAX_STEPS
    else:
        assert f"warning: {path}: {said} dropped" in done.stderr
    assert same_records(run_dir, reference, tally)
    assert run(project, "report", run_dir).returncode == 0


def test_a_last_metrics_line_cut_off_is_named_by_report_and_dropped_by_the_resume_saying_so(
    project, reference, tmp_path, tally
):
    """A record cut off mid-write (a crash) was dropped on resume without a word."""
    run_dir = copy_of(reference, tmp_path)
    (run_dir / "checkpoints" / "step-00000080.pt").unlink()  # as if it crashed writing step 80's
    path = run_dir / "metrics.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])  # the last record, step 80's validation, cut short
    last = len(data.splitlines())
    tally[SUITE]["inputs tried"] += 1

    shown = run(project, "report", run_dir)
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == f"warning: {path}: its last line ({last}), cut off mid-write, skipped\n"
    done = train(project, run_dir)

    assert done.returncode == 0, done.stderr
    assert done.stderr == f"warning: {path}: its last line ({last}), cut off mid-write, dropped\n"
    assert resumed_from(done.stdout) == (str(run_dir / "checkpoints" / "step-00000070.pt"), 70)
    assert same_records(run_dir, reference, tally)


@pytest.mark.slow
def test_a_deleted_metrics_file_is_named_by_report_and_by_the_resume(project, tmp_path, tally):
    """The resume went on silently without the records it had lost."""
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    killed_after_step_40(project, run_dir)
    (run_dir / "metrics.jsonl").unlink()

    for command, code in (("report", 1), ("diagnose", 2)):
        shown = run(project, command, run_dir)
        assert is_clean_error(shown, code=code), shown.stderr
        assert f"cannot read {run_dir / 'metrics.jsonl'}: No such file or directory" in shown.stderr
    done = train(project, run_dir)

    assert done.returncode == 0, done.stderr
    lost = "is missing: the records up to step 40 are lost"
    assert done.stderr == f"warning: {run_dir / 'metrics.jsonl'} {lost}\n"
    steps = [r["step"] for r in records(run_dir) if r["split"] == "train"]
    assert steps == list(range(41, MAX_STEPS + 1))
    assert run(project, "report", run_dir).returncode == 0


@pytest.mark.slow
def test_a_full_disk_noting_the_trackers_flush_is_one_line_and_the_run_resumes(
    tracked, tmp_path, tally
):
    """run.json is rewritten at each checkpoint of a tracked run (the tracker's last flush)."""
    project = tracked("tensorboard")
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    # run.json's writes: at the start, with the tracker's run, then at each checkpoint (step 10)
    fault = {"at": "write", "match": ".run.json.tmp", "nth": 3, "do": "ENOSPC"}

    done = train(project, run_dir, fault=fault)

    assert is_clean_error(done), done.stderr
    assert f"cannot write {run_dir / 'run.json'}: {NO_SPACE}" in done.stderr
    assert not list(run_dir.glob(".*.tmp"))
    assert json.loads((run_dir / "run.json").read_text())["tracker"]["logged_through"] == 0
    again = train(project, run_dir)
    assert again.returncode == 0, again.stderr
    assert tracker_series(run_dir, "tensorboard") == series_of(run_dir)


@pytest.mark.slow
def test_a_full_disk_while_resuming_is_one_line_and_leaves_the_run_as_it_was(
    project, reference, tmp_path, tally
):
    """A resume rewrites metrics.jsonl up to its checkpoint's step (a temporary file, then a
    rename): a full disk there changes nothing on disk, and the next resume continues exactly."""
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    stopped = train(project, run_dir, fault=SAVE_FAULTS[FAST_SAVE_FAULT][0])  # at step 30's save
    assert is_clean_error(stopped), stopped.stderr
    before = _contents(run_dir)
    fault = {"at": "write", "match": ".metrics.jsonl.tmp", "nth": 1, "do": "ENOSPC"}

    done = train(project, run_dir, fault=fault)

    assert is_clean_error(done), done.stderr
    assert f"cannot write {run_dir / 'metrics.jsonl'}: {NO_SPACE}" in done.stderr
    assert _contents(run_dir) == before
    again = train(project, run_dir)
    assert again.returncode == 0, again.stderr
    assert same_records(run_dir, reference, tally)


@pytest.mark.slow
def test_a_two_process_run_resumed_by_three_is_one_line_and_left_as_it_was(tmp_path, tally):
    """Each rank printed the error (3 lines). torchrun still reports the failed workers after it,
    in its own traceback, and exits 1: it says so whatever a worker's exit status."""
    from test_ddp import _env_ddp, _torchrun

    project = render(tmp_path / "ddp", distributed="ddp")
    run_dir = tmp_path / "run"
    tally[SUITE]["inputs tried"] += 1
    args = ("train", "--run-dir", run_dir, "--max-train-examples", "256", "--batch-size", "16",
            "--ckpt-every", "5", "--num-workers", "0")  # fmt: skip

    def torchrun(max_steps: int, nproc: int):
        command = _torchrun(project, *args, "--max-steps", max_steps, nproc=nproc)
        return subprocess.run(
            command, cwd=project, env=_env_ddp(project), capture_output=True, text=True, timeout=600
        )

    assert torchrun(10, nproc=2).returncode == 0
    before = _contents(run_dir)

    done = torchrun(20, nproc=3)

    assert done.returncode != 0
    ours = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error: ")]
    assert ours == [
        f"error: {run_dir} was trained by 2 processes: resume it with as many"
        " (--nproc-per-node x --nnodes), not 3"
    ]
    assert _contents(run_dir) == before


def _contents(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder but the writer's lock (which names the last writer's PID)."""
    files = (p for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


@pytest.mark.slow
def test_a_file_where_the_checkpoints_go_is_one_line(project, tmp_path, tally):
    """It was a FileExistsError traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("someone's notes\n")
    tally[SUITE]["inputs tried"] += 1
    done = train(project, tmp_path / "run")
    assert is_clean_error(done), done.stderr
    assert "checkpoints is a file, where the checkpoints go" in done.stderr
    assert (tmp_path / "run" / "checkpoints").read_text() == "someone's notes\n"
    assert os.listdir(tmp_path / "run") == ["checkpoints"]  # no lock file left


# Writes that fail as a run starts ({run}: the run folder): in the checks of the folder (a
# probe file in checkpoints/), and in run.json.
START_FAULTS = {
    "ENOSPC-writing-run.json": (
        {"at": "write", "match": ".run.json.tmp", "nth": 1, "do": "ENOSPC"},
        f"cannot write {{run}}/run.json: {NO_SPACE}",
    ),
    "EROFS-making-checkpoints": (
        {"readonly": "{run}/checkpoints"},
        f"cannot write to run folder {{run}}: {READ_ONLY}",
    ),
    "ENOSPC-probing-the-folder": (
        {"at": "write", "match": ".write-test", "nth": 1, "do": "ENOSPC"},
        f"cannot write to run folder {{run}}: {NO_SPACE}",
    ),
}
FAST_START_FAULT = "ENOSPC-writing-run.json"


@pytest.mark.parametrize("folder", ["new", "the-users"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(key, marks=() if key == FAST_START_FAULT else pytest.mark.slow)
        for key in START_FAULTS
    ],
)
def test_a_write_failing_at_start_up_is_one_line_and_leaves_nothing(
    project, tmp_path, tally, case, folder
):
    """They left the run folder behind, with its lock file and checkpoints/ in it."""
    tally[SUITE]["inputs tried"] += 1
    tally[SUITE]["faults injected"] += 1
    if folder == "new":  # two levels of folders made by this start
        run_dir = tmp_path / "runs" / "exp1"
    else:
        run_dir = tmp_path / "mine"
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("the user's\n")
    before = snapshot(tmp_path)
    fault, expected = START_FAULTS[case]
    fault = {k: v.format(run=run_dir) if isinstance(v, str) else v for k, v in fault.items()}

    done = train(project, run_dir, fault=fault)

    assert is_clean_error(done), done.stderr
    assert expected.format(run=run_dir) in done.stderr
    assert snapshot(tmp_path) == before


def test_a_ranks_rng_state_is_its_own_gpus_alone(tmp_path, tally, monkeypatch):
    """Each rank saves and restores the generator of its own (current) GPU: the *_all functions
    start a CUDA context on every visible GPU (64 on an 8-GPU node of 8 ranks) and cannot be
    restored where the number of GPUs differs. CUDA is faked: any call that names another device,
    or all of them, fails the test."""
    import importlib

    tally[SUITE]["inputs tried"] += 1
    project = render(tmp_path / "rngproj", device="cuda", distributed="ddp")
    sys.path.insert(0, str(project / "src"))
    try:
        checkpoint = importlib.import_module("rngproj.runtime.resume")
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m.startswith("rngproj")]:
            del sys.modules[name]
    calls = []

    def get(*args, **kwargs):  # the current device: no device named
        assert not args and not kwargs, ("names a device", args, kwargs)
        calls.append("get")
        return torch.arange(4, dtype=torch.uint8)

    def set_(state, *args, **kwargs):
        assert not args and not kwargs, ("names a device", args, kwargs)
        calls.append("set")

    def every_device(*args, **kwargs):
        raise AssertionError("touched every GPU")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_)
    for name in ("get_rng_state_all", "set_rng_state_all", "manual_seed_all", "device_count"):
        monkeypatch.setattr(torch.cuda, name, every_device)

    state = checkpoint.rng_state()
    checkpoint.set_rng_state(state)

    assert calls == ["get", "set"]
    assert state["cuda"].tolist() == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    [b'{"overfit_loss": 0.01, "resume_m', b'{"foo": 1}\n', b"\xff\xfe"],
    ids=["torn", "other-object", "not-utf8"],
)
def test_a_damaged_check_summary_is_left_out_of_report_and_diagnose(
    project, tmp_path, damage, tally
):
    """runs/check/summary.json was read with a bare json.loads: a torn or foreign one gave a
    traceback from report and diagnose. It records the checks, not the run: left out, said once."""
    tally[SUITE]["inputs tried"] += 1
    run_dir = tmp_path / "run"
    killed_after_step_40(project, run_dir)
    summary = tmp_path / "check" / "summary.json"
    summary.parent.mkdir()
    summary.write_bytes(damage)

    shown = run(project, "report", run_dir)
    diagnosed = run(project, "diagnose", run_dir)

    assert shown.returncode == 0, shown.stderr
    assert "**Sanity:** not checked yet" in shown.stdout
    assert shown.stderr.count("\n") == 1 and shown.stderr.startswith(f"warning: {summary}")
    assert diagnosed.returncode in (0, 1) and "Traceback" not in diagnosed.stderr, diagnosed.stderr
    assert summary.read_bytes() == damage  # reported, never rewritten
