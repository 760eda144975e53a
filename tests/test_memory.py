"""Activation checkpointing (--activation-checkpointing N): the model's repeated blocks recompute
their activations in the backward pass, and training is the very same, bit for bit, as without it;
a block that recomputes differently is a finding of `check batch`."""

from __future__ import annotations

import pytest
from test_project import records, render, run

pytestmark = pytest.mark.slow

TRIAL = ("--max-steps", "12", "--log-every", "1", "--eval-every", "6", "--deterministic")


@pytest.mark.parametrize(
    "task, extra",
    [
        ("image", ("--max-train-examples", "64", "--batch-size", "16")),  # BatchNorm in every block
        ("generation", ("--max-train-examples", "256", "--n-layer", "3")),  # dropout in every block
        ("classification", ()),
    ],
)
def test_recomputed_blocks_train_bit_identical_to_kept_ones(tmp_path, task, extra):
    """Every block and every second one recomputed: the train and validation records (the latter
    read BatchNorm's running statistics) equal those of a run that kept its activations."""
    project = render(tmp_path / f"ac-{task}", task=task)
    reference = None
    for every in ("0", "1", "2"):
        flags = ("--run-dir", f"runs/ac{every}", "--activation-checkpointing", every)
        done = run(project, "train", *flags, *TRIAL, *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        got = records(project / "runs" / f"ac{every}")
        assert any(r["split"] == "val" for r in got)
        reference = reference or got
        assert got == reference, every


# A block whose forward draws from Python's random module (a random scale written with it):
# torch's checkpointing replays torch's random state, not Python's, so the recomputation saves
# other inputs for GELU's backward than the forward used, and the gradients belong to neither.
JITTER = """

class Jitter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 0.5 * random.random())
"""


def test_a_block_that_recomputes_differently_fails_check_batch(tmp_path):
    project = render(tmp_path / "jitter")
    model = project / "src" / "jitter" / "model.py"
    text = model.read_text().replace("import math\n", "import math\nimport random\n", 1)
    text = text.replace("\n\nclass MLP", JITTER + "\n\nclass MLP", 1)
    text = text.replace(
        "nn.GELU(), nn.Dropout(dropout)]", "Jitter(), nn.GELU(), nn.Dropout(dropout)]", 1
    )
    model.write_text(text)
    kept = run(project, "check", "batch")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    recomputed = run(project, "check", "batch", "--activation-checkpointing", "1")
    assert recomputed.returncode == 1, recomputed.stdout + recomputed.stderr
    line = next(line for line in recomputed.stdout.splitlines() if line.startswith("batch: FAIL"))
    assert "body.0.0.weight's gradient differs with --activation-checkpointing 1" in line, line
    assert "random numbers drawn outside torch" in line


def test_check_all_passes_with_every_block_recomputed_and_a_bad_value_is_one_line(tmp_path):
    project = render(tmp_path / "acall")
    done = run(project, "check", "all", "--activation-checkpointing", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "recomputed blocks give the gradients of kept ones" in done.stdout
    assert "batch: PASS" in done.stdout and "resume: PASS" in done.stdout
    bad = run(project, "train", "--activation-checkpointing", "-1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    last = bad.stderr.strip().splitlines()[-1]
    assert last.endswith("activation_checkpointing must be >= 0, got -1")

    model = (
        project / "src" / "acall" / "model.py"
    )  # a model.py of its owner's, from before the flag
    model.write_text(model.read_text().replace("def repeated_blocks(", "def _blocks("))
    undeclared = run(project, "train", "--activation-checkpointing", "1", "--max-steps", "1")
    assert undeclared.returncode == 2 and "Traceback" not in undeclared.stderr
    assert undeclared.stderr.strip().splitlines()[-1] == (
        "error: --activation-checkpointing: model.py declares no repeated_blocks(model)"
    )
