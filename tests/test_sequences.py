"""The custom task reads variable-length sequences from a .npz with `lengths`: batches padded at
the end to a few bucket lengths, the padding masked from the loss, and `check batch` proving that
no example's loss depends on its padding (a model that reads it fails)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import checks_passed
from test_project import records, render, run
from test_tokens import _one_line_exit_2, python


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("sequences") / "seqs", task="custom", device="cpu")


def write_sequences(path: Path, n: int = 1500, per_row: bool = False) -> Path:
    """Sequences of 1 to 40 rows of 2 inputs; the target is the mean over the rows so far of a
    curve of them: at each row, or once per sequence (at its last row)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 41, size=n)
    x = rng.uniform(-3, 3, size=(lengths.sum(), 2)).astype(np.float32)
    curve = np.sin(2 * x[:, 0]) + 0.3 * x[:, 1]
    starts = np.cumsum(lengths) - lengths
    if per_row:
        first = np.repeat(starts, lengths)
        sums = np.cumsum(curve) - np.repeat(np.cumsum(curve)[starts] - curve[starts], lengths)
        y = sums / (np.arange(len(x)) - first + 1)
    else:
        y = np.add.reduceat(curve, starts) / lengths
    np.savez(path, x=x, y=y.astype(np.float32), lengths=lengths)
    return path


def test_check_all_passes_on_sequences_padded_to_few_lengths(project):
    data = write_sequences(project / "seqs.npz")

    shown = run(project, "inspect-data", "--data", "seqs.npz")
    done = run(project, "check", "all", "--data", "seqs.npz")

    assert shown.returncode == 0, shown.stderr
    assert "train: 1,350 examples, inputs (40, 2), targets (40,) (padded)" in shown.stdout
    assert "targets [" in shown.stdout and "on 1 rows" in shown.stdout
    assert checks_passed(done), done.stdout + done.stderr
    assert "no example depends on another; nor on its padding" in done.stdout
    assert data.is_file()


def test_padded_batches_take_the_bucket_lengths_and_mask_the_padding(project):
    write_sequences(project / "rows.npz", per_row=True)
    code = """
import json, torch
from {pkg}.config import Config
from {pkg}.data import bucket_lengths, load_splits
from {pkg}.runtime.loader import read_batch
from {pkg}.model import compute_loss
ds = load_splits(Config(data="rows.npz")).train
widths = set(read_batch(ds, torch.arange(i, i + 2))[0].shape[1] for i in range(0, 400, 2))
x, y = read_batch(ds, torch.arange(8))
lengths = [len(ds[i][0]) for i in range(8)]
real = [int((~y[i].isnan()).sum()) for i in range(8)]
out = torch.randn(y.shape)
padded = out.clone(); padded[y.isnan()] = 1e6  # outputs at padded rows must not count
alone = [compute_loss(out[i : i + 1, : lengths[i]], y[i : i + 1, : lengths[i]]) for i in range(8)]
losses = [compute_loss(padded, y), torch.stack(alone).mean(), compute_loss(out, y)]
print(json.dumps([sorted(widths), bucket_lengths(40), lengths == real, *map(float, losses)]))
"""
    done = python(project, code)

    assert done.returncode == 0, done.stderr
    widths, buckets, every_row_labelled, masked, per_example, loss = json.loads(done.stdout)
    assert buckets == [10, 20, 40] and set(widths) <= set(buckets) and len(widths) > 1
    assert every_row_labelled
    assert masked == pytest.approx(loss) == pytest.approx(per_example)


def test_a_model_that_reads_the_padding_fails_check_batch(project, tmp_path):
    edited = render(tmp_path / "peek", task="custom", device="cpu")
    model = edited / "src" / "peek" / "model.py"
    causal = "running = encoded.cumsum(dim=1) / rows[:, None]"
    assert causal in model.read_text()
    peeking = "running = encoded + encoded.mean(dim=1, keepdim=True)"  # every row sees all rows
    model.write_text(model.read_text().replace(causal, peeking))
    write_sequences(edited / "seqs.npz", n=400)

    done = run(edited, "check", "batch", "--data", "seqs.npz")

    assert done.returncode == 1, done.stdout + done.stderr
    assert "the model reads the padding" in done.stdout
    assert "no example depends on another" in done.stdout  # across examples it is still clean


def test_training_on_sequences_logs_validation_mae(project, tmp_path):
    write_sequences(project / "train-rows.npz", per_row=True)
    run_dir = tmp_path / "run"

    args = ["--data", "train-rows.npz", "--max-steps", "30", "--run-dir", str(run_dir)]
    done = run(project, "train", *args)

    assert done.returncode == 0, done.stderr
    val = [r for r in records(run_dir) if r.get("split") == "val"]
    assert val and all(np.isfinite(r["mae"]) and 0 < r["mae"] < 2 for r in val)


@pytest.mark.parametrize(
    "arrays, expected",
    [
        ({"lengths": [3, 3]}, "lengths add up to 6 rows; x has 5"),
        ({"lengths": [5, 0]}, "at least one row"),
        ({"lengths": [2.5, 2.5]}, "lengths must be (N,) integers"),
        ({"lengths": [2, 3], "y": [1.0, 2.0, 3.0]}, "y has 3 values; need one per sequence (2)"),
    ],
    ids=["sum", "empty-sequence", "float-lengths", "targets"],
)
def test_bad_sequence_files_are_one_line(project, tmp_path, arrays, expected):
    values = {"x": np.zeros((5, 2), np.float32), "y": np.zeros(2, np.float32), **arrays}
    path = tmp_path / "bad.npz"
    np.savez(path, **{key: np.asarray(value) for key, value in values.items()})

    done = run(project, "train", "--data", str(path), "--run-dir", str(tmp_path / "run"))

    _one_line_exit_2(done, expected)
    assert not (tmp_path / "run").exists()
