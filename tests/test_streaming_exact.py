"""A streaming ddp project resumed at another number of processes keeps its global batch: a run
stopped at 2 processes, resumed at 1 and stopped, then finished at 4 (torchrun on the CPU, gloo)
trains on each step's very examples, in memory or streamed from a shard folder, and with
--deterministic ends with the records of a run that never stopped, bit for bit, across an
epoch's end. A number of processes that cannot share a step is refused in one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import warm_python
from test_ddp import _env_ddp, _torchrun
from test_project import _env, records, render
from test_store import SIGTERM_AT

STEPS = 24
# 3,686 training examples: 14 steps of 4 micro-batches of 64 an epoch, whatever the processes;
# the custom task's dropout of 0.1, whose masks each micro-batch keys by its place in the epoch
ARGS = ("train", "--max-steps", str(STEPS), "--batch-size", "64", "--grad-accum-steps", "2",
        "--ckpt-every", "100", "--eval-every", "12", "--log-every", "1", "--deterministic",
        "--num-workers", "0", "--shuffle-window", "2")  # fmt: skip

# Records each training micro-batch's example ids (rank by rank, in the order read) to IDS_TO, and
# sends SIGTERM to rank 0 as it prints step SIGTERM_AT: every rank then stops, with a checkpoint,
# at step SIGTERM_AT + 1 (runtime/stopping.py), however loaded the machine is.
RECORD_IDS = """
import json, os
if "RANK" in os.environ:  # a worker, not torchrun
    from {package}.runtime import loader
    _build = loader.build_loaders
    def build_loaders(*args, **kwargs):
        train, val, sampler = _build(*args, **kwargs)
        read, path = train.dataset.__getitems__, os.environ["IDS_TO"] + "-" + os.environ["RANK"]
        def getitems(batch):
            with open(path, "a") as out:
                out.write(json.dumps(batch[1].tolist()) + "\\n")
            return read(batch)
        train.dataset.__getitems__ = getitems
        return train, val, sampler
    loader.build_loaders = build_loaders
"""
INJECT = SIGTERM_AT + RECORD_IDS


def _render(tmp_path_factory, distributed: str):
    """A streaming project of the custom task, its synthetic data also written as 8 shards."""
    project = render(
        tmp_path_factory.mktemp("exact") / f"exact-{distributed}",
        distributed=distributed,
        streaming=True,
        task="custom",
    )
    package = f"exact_{distributed}"
    (project / "inject").mkdir()
    (project / "inject" / "sitecustomize.py").write_text(INJECT.format(package=package))
    prepare = [sys.executable, "-m", package, "prepare", "--out", "shards", "--shard-mb", "0.004"]
    done = warm_python.run(prepare, cwd=project, env=_env(project), timeout=600)
    assert "wrote 8 train shards (3,686 examples)" in done.stdout, done.stdout + done.stderr
    return project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return _render(tmp_path_factory, "ddp")


def _train(
    project, run_dir: str, nproc: int, ids: str, stop_at: int = 0, data: tuple = ()
) -> subprocess.CompletedProcess:
    env = _env_ddp(project)
    env |= {"PYTHONPATH": f"{project / 'inject'}:{env['PYTHONPATH']}", "IDS_TO": str(project / ids)}
    if stop_at:
        env["SIGTERM_AT"] = str(stop_at)
    command = _torchrun(project, *ARGS, *data, "--run-dir", run_dir, nproc=nproc)
    return warm_python.run(command, cwd=project, env=env, timeout=600)


def _global_batches(project, ids: str, nproc: int, first_step: int) -> dict[int, list[int]]:
    """Each step's examples over every rank: a step is 4 micro-batches, 4 / nproc on each."""
    per_rank = [
        [json.loads(line) for line in (project / f"{ids}-{rank}").read_text().splitlines()]
        for rank in range(nproc)
    ]
    share = 4 // nproc
    return {
        first_step + i + 1: sorted(
            x for mine in per_rank for b in mine[i * share :][:share] for x in b
        )
        for i in range(len(per_rank[0]) // share)
    }


def _chain(project, data: str) -> tuple[list, list]:
    """The uninterrupted run (2 processes, 2 micro-batches each a step) and the chain, stopped at
    step 7 (mid-epoch) on 2 processes, at 14 (an epoch's end) on 1, ended on 4: their records,
    once each step's examples are found the same."""
    given = ("--data", "shards") if data == "shards" else ()
    reference = _train(project, f"runs/{data}", 2, f"ids-{data}", data=given)
    assert reference.returncode == 0, reference.stderr[-3000:]
    chain, batches, run_dir = [], {}, f"runs/{data}-chain"
    for nproc, stop_at, first_step in ((2, 6, 0), (1, 13, 7), (4, 0, 14)):
        done = _train(project, run_dir, nproc, f"ids-{data}-{nproc}", stop_at, given)
        chain.append(done)
        assert done.returncode == (128 + signal.SIGTERM if stop_at else 0), done.stderr[-3000:]
        batches |= _global_batches(project, f"ids-{data}-{nproc}", nproc, first_step)
    resumed = (
        rf"resuming from {run_dir}/checkpoints/step-00000007(\.pt)? at step 7"  # fsdp: a folder
    )
    assert re.search(resumed, chain[1].stdout), chain[1].stdout
    warnings = [line for line in chain[2].stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and (
        f"warning: {run_dir} was trained by 1 processes, resumed by 4: " in warnings[0]
        and "the global batch stays the run's, 4 x 1 micro-batches of 64 a step, and so do its"
        " examples and dropout masks"
        in warnings[0]
    ), warnings
    assert batches == _global_batches(project, f"ids-{data}", 2, 0)  # every step's examples
    assert sorted(batches) == list(range(1, STEPS + 1))
    expected, got = records(project / f"runs/{data}"), records(project / run_dir)
    pairs = [(a["loss"], b["loss"]) for a, b in zip(expected, got, strict=True)]
    print(f"max abs difference of the losses: {max(abs(a - b) for a, b in pairs):.3g}")
    return expected, got


# the in-memory data's order is EpochBatches' own, the shards' by windows: the same machinery after
@pytest.mark.parametrize("data", [pytest.param("synthetic", marks=pytest.mark.slow), "shards"])
def test_a_run_resumed_at_2_then_1_then_4_processes_matches_an_uninterrupted_one_bit_for_bit(
    project, data
):
    expected, got = _chain(project, data)
    assert got == expected  # train and val records, bit for bit


@pytest.mark.slow
def test_fsdp_resumed_at_2_then_1_then_4_processes_trains_on_the_same_examples(tmp_path_factory):
    """FSDP reshards and keeps the global batch too; its losses differ in the last bits only (its
    reduce-scatter adds the ranks' gradients in another order at another number of processes)."""
    expected, got = _chain(_render(tmp_path_factory, "fsdp"), "shards")
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in expected]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(expected, got, strict=True)) < 1e-5


def test_a_number_of_processes_that_cannot_share_a_step_is_refused_in_one_line(project):
    run_dir = project / "runs" / "three"
    stopped = _train(project, "runs/three", 2, "ids-three", stop_at=1)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    records_before = (run_dir / "metrics.jsonl").read_bytes()
    done = _train(project, "runs/three", 3, "ids-three")
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "runs/three trains on 4 micro-batches of 64 a step, which 3 processes cannot share:"
        " resume it on a number that divides 4"
    ) in done.stderr
    assert "Traceback" not in done.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == records_before
