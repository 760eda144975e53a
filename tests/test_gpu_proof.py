"""benchmarks/gpu_proof.py, the one command for a lent GPU: what it plans, and its one line on a
machine without CUDA (how CI runs it)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaffold.combinations import combination_id, values, varied_questions
from scaffold.matrix import plan

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_proof.py"


def proof(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the proof would run")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    ran = proof("--out", str(tmp_path / "out"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        f"gpu_proof: no CUDA GPU here (torch {torch.__version__}): nothing to run"
    ]
    assert ran.stderr == ""
    assert not (tmp_path / "out").exists()


def test_the_plan_holds_every_cuda_primary_the_mfu_run_find_batch_size_ddp_and_fsdp():
    ran = proof("--list")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    planned = {line.split(": ", 1)[0].strip(): [] for line in lines if line.startswith("  ")}
    for line in lines:
        if line.startswith("  "):
            part, text = line.strip().split(": ", 1)
            planned[part].append(text)
    assert list(planned) == ["mfu", "find-batch-size", "ddp", "fsdp", "matrix"]

    # Every cuda combination that is a primary when checked on its own device (the device a base
    # answer, read by every answer): each base primary (tracker none) and each answer's primaries.
    questions = varied_questions()
    cuda = [
        answers
        for product in itertools.product(*(values(q) for q in questions))
        if (answers := dict(zip([q.name for q in questions], product, strict=True)))["device"]
        == "cuda"
    ]
    expected = {combination_id(a) for a in cuda if plan.proving(a, native_device=True)}
    matrix = planned["matrix"][1:]
    assert set(matrix) == expected and len(matrix) == len(expected)
    base = {"tracker": "none", "compile": False, "grad_accum_steps": 1, "finetune": False}
    bases = [a for a in cuda if a.items() >= {**base, "streaming": False}.items()]
    assert len(bases) == 5 * 3 * 3 and {combination_id(a) for a in bases} <= expected

    assert planned["mfu"] == [f"{sys.executable} {REPO / 'benchmarks' / 'gpu_throughput.py'}"]
    assert "find-batch-size" in planned["find-batch-size"][0]
    for mode in ("ddp", "fsdp"):
        [command] = planned[mode]
        assert command.startswith(f"(in proof-{mode}) NPROC=2 bash scripts/train_single_node.sh")
        assert f"2 processes on one GPU, `train` 200 steps, generation-none-cuda-{mode}" in (
            ran.stdout
        )
        # fsdp's run is the one with recomputed blocks (issue 41: a lent GPU proves them too)
        assert command.endswith("--activation-checkpointing 1") == (mode == "fsdp"), command
