"""Generation projects train on each document of a prepared folder alone (`--documents`): pieces
of at most block_size tokens that never span two documents, padded to a few bucket lengths, with
the padding masked out of the loss; the checks hold with it and a killed run resumes exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import checks_passed
from test_project import records, render, run
from test_tokens import RESUMABLE, TINY, _one_line_exit_2, kill_then_resume, prepare, python


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("documents") / "docs", task="generation")


@pytest.fixture(scope="module")
def folder(project) -> Path:
    """A byte-tokenized folder of 1,200 documents, two in five of 1 to 6 characters, the others of
    12 to 60: with --block-size 16 a short one is a piece, the longest take four."""
    rng = random.Random(0)
    words = [
        "the",
        "cat",
        "a",
        "dog",
        "sees",
        "an",
        "old",
        "man",
        "my",
        "sister",
        "by",
        "the",
        "sea",
    ]
    lines = []
    for _ in range(1200):
        size = rng.randint(1, 6) if rng.random() < 0.4 else rng.randint(12, 60)
        text = " ".join(rng.choice(words) for _ in range(12))[:size]
        lines.append(json.dumps({"text": text}) + "\n")
    (project / "short.jsonl").write_text("".join(lines))
    out = project / "data" / "short"
    done = prepare(project, "--data", "short.jsonl", "--tokenizer", "byte", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


def test_pieces_predict_every_token_once_and_never_span_two_documents(project, folder):
    code = f"""
import json, numpy as np, torch
from {{pkg}}.config import Config
from {{pkg}}.data import PAD_TARGET, bucket_lengths, load_splits
from {{pkg}}.runtime.loader import read_batch
ds = load_splits(Config(data={str(folder)!r}, documents=True, block_size=16, batch_size=16)).train
eot, stream = ds.eot, np.fromfile({str(folder / "train.bin")!r}, dtype=np.uint16)
targets, sizes, widths = [], [], set()
for i in range(len(ds)):
    x, y = ds[i]
    assert len(x) == len(y) <= 16 and (x[1:] == y[:-1]).all()
    assert eot not in x[1:].tolist() and eot not in y[:-1].tolist()  # within one document
    targets += y.tolist()
    sizes.append(len(y))
for first in range(0, len(ds) - 4, 4):
    x, y = read_batch(ds, torch.arange(first, first + 4))
    widths.add(x.shape[1])
    for row, n in enumerate(sizes[first : first + 4]):
        assert (y[row, n:] == PAD_TARGET).all() and (x[row, n:] == eot).all()
        assert (y[row, :n] != PAD_TARGET).all()
    assert x.shape[1] == min(n for n in bucket_lengths(16) if n >= max(sizes[first : first + 4]))
print(json.dumps([targets == stream[1:].tolist(), max(sizes), sorted(widths), bucket_lengths(16)]))
"""
    every_token_once, longest, widths, buckets = json.loads(python(project, code).stdout)
    assert every_token_once  # the pieces' targets, in order, are the stream after its first token
    assert longest == 16 and buckets == [8, 16] and widths == [8, 16]


def test_padding_changes_no_example_s_loss(project, folder):
    """compute_loss of a padded batch is the mean of each example's loss alone, unpadded, and
    padding one example to a longer bucket leaves its loss as it was."""
    code = f"""
import torch
from {{pkg}}.config import Config
from {{pkg}}.data import load_splits
from {{pkg}}.model import build_model, compute_loss
cfg = Config(data={str(folder)!r}, documents=True, block_size=16, n_layer=1, n_head=2, n_embd=32)
splits = load_splits(cfg)
torch.manual_seed(0)
model = build_model(cfg, splits).eval()
samples = [splits.train[i] for i in range(48)]
x, y = splits.train.collate(samples)
alone = torch.stack([compute_loss(model(a[None]), b[None]) for a, b in samples])
together = compute_loss(model(x), y)
short = min(range(48), key=lambda i: len(samples[i][0]))
wide = splits.train.collate([samples[short], (torch.zeros(16, dtype=torch.long),) * 2])
padded = compute_loss(model(wide[0][:1]), wide[1][:1])
print(float((together - alone.mean()).abs()), float((padded - alone[short]).abs()), x.shape[1])
"""
    batch_error, bucket_error, width = python(project, code).stdout.split()
    assert float(batch_error) < 1e-5 and float(bucket_error) < 1e-5 and int(width) == 16


def test_check_all_passes_on_documents_and_a_mixed_batch_fails_it(project, folder, tmp_path):
    args = ("--data", folder, "--documents", *TINY)
    done = run(project, "check", "all", *args)
    assert checks_passed(done), done.stdout + done.stderr
    assert "batch: PASS" in done.stdout and "resume: PASS" in done.stdout

    mixed = render(tmp_path / "mixed", task="generation")
    model = mixed / "src" / "mixed" / "model.py"
    source = model.read_text()
    line = "x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, n_embd)"
    assert line in source
    model.write_text(
        source.replace(line, f"{line}\n        x = x + 0.5 * x.mean(dim=0)  # planted")
    )
    done = run(mixed, "check", "batch", "--data", folder, "--documents", *TINY)
    assert done.returncode == 1
    assert "batch: FAIL" in done.stdout and "depends on example" in done.stdout


@pytest.mark.slow
def test_a_killed_documents_run_resumes_bit_exact(project, folder):
    args = ["train", "--data", str(folder), "--documents", *RESUMABLE]
    whole = run(project, *args, "--run-dir", "runs/docs-whole")
    assert whole.returncode == 0, whole.stderr
    resumed = kill_then_resume(project, [*args, "--run-dir", "runs/docs-killed"], 14)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert records(project / "runs/docs-killed") == records(project / "runs/docs-whole")
    val = [r for r in records(project / "runs/docs-whole") if r["split"] == "val"]
    assert val and all(r["bits_per_byte"] > 0 and r["perplexity"] > 1 for r in val)


def test_documents_need_a_prepared_folder(project, tmp_path):
    done = run(project, "train", "--documents", "--run-dir", tmp_path / "run", *TINY)
    _one_line_exit_2(done, "--documents needs a folder written by `prepare`")
    assert not (tmp_path / "run").exists()
