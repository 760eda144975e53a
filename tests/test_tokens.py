"""Generation projects prepare a corpus into memory-mapped token files (char, byte or BPE), train
on them and resume exactly, report bits per byte, sample with the run's tokenizer, and refuse bad
input in one line with exit status 2, leaving nothing half-written."""

from __future__ import annotations

import json
import math
import random
import subprocess
from pathlib import Path

import pytest
from test_project import _command, _env, kill_at_step, records, render, run

# A tiny model: these tests are about the data path, not the learning.
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
TINY += ["--batch-size", "16"]
RESUMABLE = [*TINY, "--max-steps", "30", "--ckpt-every", "10", "--eval-every", "10"]
RESUMABLE += ["--log-every", "1", "--deterministic", "--num-workers", "1"]  # a worker maps it too
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("tokens") / "gen", task="generation")


@pytest.fixture(scope="module")
def text(project) -> Path:
    """About 60 kB of the project's synthetic sentences, with a few non-ASCII characters."""
    path = project / "corpus.txt"
    code = "from {pkg}.data import synthetic_text; print(synthetic_text(2000), end='')"
    body = python(project, code).stdout
    path.write_text(body.replace("the sea", "the séa ✓"))
    return path


def python(project: Path, code: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the project's environment, {pkg} in `code` its package's name."""
    package = next((project / "src").iterdir()).name
    done = subprocess.run(
        [_command(project, [])[0], "-c", code.format(pkg=package)],
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 or not check, done.stderr
    return done


def prepare(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(project, "prepare", *args)


def decoded(project: Path, folder: Path, split: str) -> str:
    """The text of a prepared split, decoded by the folder's own tokenizer."""
    code = (
        "import json, numpy as np; from pathlib import Path\n"
        "from {pkg}.tokens import load_tokenizer\n"
        f"folder = Path({str(folder)!r}); meta = json.loads((folder / 'meta.json').read_text())\n"
        "tok = load_tokenizer(folder / 'tokenizer.json', meta['tokenizer'])\n"
        f"ids = np.fromfile(folder / '{split}.bin', dtype=meta['dtype']).tolist()\n"
        "print(json.dumps(tok.decode(ids)))"
    )
    return json.loads(python(project, code).stdout)


@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe"])
def test_prepare_writes_token_files_that_decode_to_the_text(project, text, tokenizer):
    out = project / "data" / f"one-{tokenizer}"
    done = prepare(
        project, "--data", text, "--tokenizer", tokenizer, "--vocab-size", "300", "--out", out
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == tokenizer and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == {"byte": 257, "bpe": 300}.get(
        tokenizer, len(set(text.read_text())) + 1
    )
    for split in ("train", "val"):
        assert (out / f"{split}.bin").stat().st_size == 2 * meta[f"{split}_tokens"]
    assert meta["train_documents"] == meta["val_documents"] == 1  # one file: its tail is held out
    train, val = decoded(project, out, "train"), decoded(project, out, "val")
    assert train.endswith(EOT) and val.endswith(EOT)
    assert train[: -len(EOT)] + val[: -len(EOT)] == text.read_text()  # lossless, in order
    assert len(val) < len(train) / 5
    n_bytes = len(text.read_bytes())
    assert meta["train_bytes"] + meta["val_bytes"] == n_bytes
    assert meta["bytes_per_token"] == pytest.approx(
        n_bytes / (meta["train_tokens"] + meta["val_tokens"])
    )
    if tokenizer == "bpe":
        assert meta["bytes_per_token"] > 1.5  # merges learnt
    assert not list(out.parent.glob(".*partial"))


def test_prepare_holds_out_whole_documents_of_a_folder_and_a_jsonl(project, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i:02d}.txt").write_text(f"document {i} says hello.\n" * 5)
    (folder / "notes.md").write_text("not read")
    lines = tmp_path / "docs.jsonl"
    lines.write_text(
        "".join(json.dumps({"text": f"line {i} text"}) + "\n" for i in range(30)) + "\n"
    )
    for source, n_val in ((folder, 2), (lines, 3)):
        out = tmp_path / f"out-{source.name}"
        done = prepare(project, "--data", source, "--tokenizer", "byte", "--out", out)
        assert done.returncode == 0, done.stderr
        meta = json.loads((out / "meta.json").read_text())
        assert (meta["train_documents"], meta["val_documents"]) == (10 * n_val - n_val, n_val)
        val = decoded(project, out, "val").split(EOT)[:-1]
        assert len(val) == n_val
    assert val == ["line 9 text", "line 19 text", "line 29 text"]  # every tenth, by position
    first = decoded(project, tmp_path / "out-docs", "val").split(EOT)[0]
    assert first == "document 9 says hello.\n" * 5  # sorted by name


def kill_then_resume(
    project: Path, args: list[str], kill_after: int
) -> subprocess.CompletedProcess:
    kill_at_step(project, args, kill_after)
    return run(project, *args)


@pytest.mark.slow
def test_train_on_a_prepared_folder_resumes_bit_exact_and_refuses_another(project, text):
    data = project / "data" / "resume-bpe"
    assert prepare(project, "--data", text, "--vocab-size", "300", "--out", data).returncode == 0
    whole = run(project, "train", "--data", data, "--run-dir", "runs/whole", *RESUMABLE)
    assert whole.returncode == 0, whole.stderr
    resumed = kill_then_resume(
        project, ["train", "--data", str(data), "--run-dir", "runs/killed", *RESUMABLE], 14
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert records(project / "runs/killed") == records(project / "runs/whole")
    run_json = json.loads((project / "runs/whole/run.json").read_text())
    assert json.dumps(run_json).count(json.loads((data / "meta.json").read_text())["digest"]) >= 1

    other = text.read_text().replace("cat", "cow")
    (project / "other.txt").write_text(other)
    moved = data.with_name("moved")
    data.rename(moved)
    again = prepare(project, "--data", "other.txt", "--vocab-size", "300", "--out", data)
    assert again.returncode == 0, again.stderr
    refused = run(project, "train", "--data", data, "--run-dir", "runs/whole", *RESUMABLE)
    _one_line_exit_2(refused, "digest")


def test_a_worker_maps_the_token_file_itself(project, text):
    data = project / "data" / "mapped"
    assert prepare(project, "--data", text, "--tokenizer", "byte", "--out", data).returncode == 0
    code = (
        "import pickle; from {pkg}.config import Config; from {pkg}.data import load_splits\n"
        f"ds = load_splits(Config(data={str(data)!r}, block_size=16)).train\n"
        "x, y = ds[5]; assert ds._tokens is not None and (x[1:] == y[:-1]).all()\n"
        "copy = pickle.loads(pickle.dumps(ds)); assert copy._tokens is None\n"
        "assert (copy[5][0] == x).all() and copy._tokens is not None; print(len(ds))"
    )
    assert int(python(project, code).stdout) > 1000


@pytest.mark.slow
def test_bits_per_byte_in_every_val_record_and_sample_decodes_bpe(project, text):
    data = project / "data" / "bpb-bpe"
    assert prepare(project, "--data", text, "--vocab-size", "300", "--out", data).returncode == 0
    steps = ("--max-steps", "20", "--eval-every", "10")
    for name, source in (("char", text), ("bpe", data)):
        done = run(
            project, "train", "--data", source, "--run-dir", f"runs/bpb-{name}", *TINY, *steps
        )
        assert done.returncode == 0, done.stderr
    char = [r for r in records(project / "runs/bpb-char") if r["split"] == "val"]
    bpe = [r for r in records(project / "runs/bpb-bpe") if r["split"] == "val"]
    assert len(char) == len(bpe) == 2
    # A character of this text is one UTF-8 byte (but for the few accented ones): bits per byte
    # is the loss in bits, a little less.
    for r in char:
        assert 0.9 * r["loss"] / math.log(2) < r["bits_per_byte"] < r["loss"] / math.log(2)
    per_token = json.loads((data / "meta.json").read_text())["bytes_per_token"]
    for r in bpe:  # a BPE token covers several bytes: bits per byte far below bits per token
        assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2) / per_token, rel=0.1)
        assert r["bits_per_byte"] < r["loss"] / math.log(2) / 1.5

    best = "runs/bpb-bpe/checkpoints/best.pt"
    done = run(
        project, "sample", "--checkpoint", best, "--prompt", "The séa ✓", "--max-new-tokens", "30"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The séa ✓") and len(done.stdout) > len("The séa ✓") + 10
    unprompted = run(project, "sample", "--checkpoint", best)
    assert unprompted.returncode == 0 and unprompted.stdout.startswith(EOT)  # a document's start


def _one_line_exit_2(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    *phases, last = done.stderr.splitlines()  # prepare says each phase as it starts
    assert last.startswith("error: ") and all(line.startswith("prepare: ") for line in phases), (
        done.stderr
    )
    for part in expected:
        assert part in done.stderr, done.stderr


def test_bad_corpora_are_refused_in_one_line_with_nothing_written(project, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(prepare(project, "--data", tmp_path / "empty", "--out", out), "no .txt files")
    bad = tmp_path / "docs"
    bad.mkdir()
    (bad / "a.txt").write_text("fine text\n" * 30)
    (bad / "b.txt").write_bytes(b"good line\nthen \xff\xfe bad\n")
    _one_line_exit_2(prepare(project, "--data", bad, "--out", out), str(bad / "b.txt"), "byte 15")
    _one_line_exit_2(
        prepare(project, "--data", bad / "a.txt", "--vocab-size", "256", "--out", out),
        "at least 257",
    )
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    _one_line_exit_2(prepare(project, "--data", lines, "--out", out), f"{lines}:2", '"text"')
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    for url in ("s3://data/corpus", "s3:/data/corpus"):  # each once a local folder "s3:"
        _one_line_exit_2(prepare(project, "--data", bad / "a.txt", "--out", url), url, "local path")
    assert not (project / "s3:").exists()


def test_bpe_without_the_tokenizers_package_is_one_line(project, text, tmp_path):
    out = tmp_path / "out"
    code = (
        "import runpy, sys; sys.modules['tokenizers'] = None\n"  # as if it were not installed
        f"sys.argv = ['{{pkg}}', 'prepare', '--data', '{text}', '--tokenizer', 'bpe', "
        f"'--out', '{out}']\n"
        "runpy.run_module('{pkg}', run_name='__main__')"
    )
    _one_line_exit_2(
        python(project, code, check=False), "--tokenizer bpe needs the tokenizers package"
    )
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_prepare_on_a_full_disk_is_one_line_and_leaves_nothing(project, text, tmp_path):
    """Two OSError tracebacks before; the token files' writes fail as on a full disk here."""
    out = tmp_path / "out"
    code = (
        "import errno, io, runpy, sys\n"
        "real = io.open\n"
        "class Full:\n"
        "    def __init__(self, f): self.f, self.n = f, 0\n"
        "    def write(self, data):\n"
        "        self.n += len(data)\n"
        "        if self.n > 2000: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "        return self.f.write(data)\n"
        "    def __getattr__(self, name): return getattr(self.f, name)\n"
        "    def __enter__(self): return self\n"
        "    def __exit__(self, *exc): self.f.close()\n"
        "def full(file, mode='r', *args, **kwargs):\n"
        "    f = real(file, mode, *args, **kwargs)\n"
        "    return Full(f) if 'w' in mode and str(file).endswith('.bin') else f\n"
        "io.open = full\n"
        f"sys.argv = ['{{pkg}}', 'prepare', '--data', '{text}', '--tokenizer', 'char', "
        f"'--out', '{out}']\n"
        "runpy.run_module('{pkg}', run_name='__main__')"
    )
    done = python(project, code, check=False)
    assert done.returncode == 1, done.stderr
    said = f"error: cannot write {out}: No space left on device; nothing of it was kept\n"
    assert done.stderr.endswith(said) and "Traceback" not in done.stderr, done.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_corpus_smaller_than_a_block_and_a_damaged_folder_are_refused(project, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("one two\nthree four five\nsix\nseven eight\n")
    folder = tmp_path / "small"
    done = prepare(
        project, "--data", small, "--tokenizer", "char", "--val-fraction", "0.5", "--out", folder
    )
    assert done.returncode == 0, done.stderr
    train = ("train", "--data", folder, "--run-dir", tmp_path / "run", *TINY, "--max-steps", "2")
    _one_line_exit_2(run(project, *train), "windows of 16")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    again = prepare(project, "--data", folder, "--out", tmp_path / "again")
    _one_line_exit_2(
        again, f"{folder}: already prepared (it holds meta.json): `train --data {folder}`"
    )
    one_file = ("train", "--data", folder / "train.bin", "--run-dir", tmp_path / "run")
    _one_line_exit_2(
        run(project, *one_file),
        f"a file of a folder `prepare` wrote: pass the folder, --data {folder}",
    )

    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(
        json.dumps({**meta, "train_tokens": meta["train_tokens"] + 1})
    )
    _one_line_exit_2(run(project, *train), "train.bin", "meta.json says")
    (folder / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "dtype"}))
    _one_line_exit_2(run(project, *train), "no dtype")
    (folder / "meta.json").unlink()
    _one_line_exit_2(run(project, *train), "no meta.json")


def test_a_flipped_byte_in_a_token_file_is_refused_and_an_old_folder_warns(project, text, tmp_path):
    """A flipped byte in a prepared train.bin trained silently: each 16 MiB chunk of the token
    files now has its digest in meta.json, checked when the folder is opened."""
    folder = tmp_path / "prepared"
    assert prepare(project, "--data", text, "--tokenizer", "char", "--out", folder).returncode == 0
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["chunk_bytes"] == 16 << 20 and len(meta["chunk_digests"]["train.bin"]) == 1
    train = ("train", "--data", folder, "--run-dir", tmp_path / "run", *TINY, "--max-steps", "2")
    clean = run(project, *train)
    assert clean.returncode == 0 and "warning" not in clean.stderr, clean.stderr

    data = bytearray((folder / "train.bin").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: the size check cannot see it
    (folder / "train.bin").write_bytes(bytes(data))
    damaged = ("train", "--data", folder, "--run-dir", tmp_path / "damaged", *TINY)
    _one_line_exit_2(
        run(project, *damaged),
        f"{folder / 'train.bin'}: bytes 0-{len(data):,} (chunk 0) do not match their digest",
    )
    assert not (tmp_path / "damaged").exists()

    old = {k: v for k, v in meta.items() if k not in ("chunk_bytes", "chunk_digests")}
    (folder / "meta.json").write_text(json.dumps(old))  # as prepared before the digests
    unverified = run(project, *train, "--run-dir", tmp_path / "old")
    assert unverified.returncode == 0, unverified.stderr
    assert "prepared without chunk digests, so read unverified" in unverified.stderr


def test_train_refuses_what_prepare_reads_and_points_to_prepare(project, tmp_path):
    """Read as characters, a .jsonl would teach the JSON syntax: train refuses it, and a folder of
    .txt files, naming the two commands that train on them."""
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "a document"}\n' * 200)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text\n" * 200)
    for data, found in (
        (lines, "a .jsonl is for `prepare`"),
        (tmp_path / "texts", "a folder of .txt files"),
    ):
        done = run(project, "train", "--data", data, "--run-dir", tmp_path / "run", *TINY)
        _one_line_exit_2(
            done, f"{data}: {found}", f"`prepare --data {data} --out DIR`, then `train --data DIR`"
        )
    assert not (tmp_path / "run").exists()


def test_a_vocabulary_past_uint16_writes_uint32_tokens_that_train_and_decode(project, tmp_path):
    """70,000 distinct characters (CJK and beyond) make a char vocabulary past uint16."""
    chars = [
        chr(c) for c in range(0x4E00, 0x30000) if chr(c).isprintable() and not chr(c).isspace()
    ]
    chars = chars[:70_000]
    assert len(chars) > 1 << 16
    rng = random.Random(0)
    body = "".join(chars) + "".join(rng.choice(chars[:50]) for _ in range(4000))
    corpus = tmp_path / "wide.txt"
    corpus.write_text("\n".join(body[i : i + 60] for i in range(0, len(body), 60)) + "\n")
    out = tmp_path / "wide"
    done = prepare(project, "--data", corpus, "--tokenizer", "char", "--out", out)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 1 << 16
    for split in ("train", "val"):
        assert (out / f"{split}.bin").stat().st_size == 4 * meta[f"{split}_tokens"]
    train, val = decoded(project, out, "train"), decoded(project, out, "val")
    assert train[: -len(EOT)] + val[: -len(EOT)] == corpus.read_text()  # ids past 65,535 intact
    steps = ("--max-steps", "3", "--eval-every", "3", "--n-embd", "16", "--n-head", "2")
    done = run(project, "train", "--data", out, "--run-dir", tmp_path / "run", *TINY, *steps)
    assert done.returncode == 0, done.stderr
    val_records = [r for r in records(tmp_path / "run") if r["split"] == "val"]
    assert val_records and math.isfinite(val_records[-1]["loss"])


def test_the_epoch_order_is_a_keyed_bijection_that_takes_no_memory(project):
    """A prepared corpus has a window at every token: its epoch order is worked out per batch
    (loader.Shuffle), never as an array of every window, and a resumed epoch's batches are the
    uninterrupted epoch's."""
    code = """
import json, tracemalloc, numpy as np
from {pkg}.runtime.loader import EpochBatches, Shuffle
sizes = (1, 2, 3, 7, 64, 1000, 4099)
bijective = all(sorted(Shuffle(n, 0, 0)[np.arange(n)].tolist()) == list(range(n)) for n in sizes)
a, b, c = (Shuffle(5000, s, e)[np.arange(5000)] for s, e in ((0, 0), (0, 1), (1, 0)))
tracemalloc.start()
batches = EpochBatches(10**9, 256, seed=0)
batches.set_epoch(3)
whole = [indices for _, (_, indices) in zip(range(80), batches)]
batches.set_epoch(3, start=70)
resumed = [indices for _, (_, indices) in zip(range(10), batches)]
peak = tracemalloc.get_traced_memory()[1]
seen = np.concatenate([w.numpy() for w in whole])
print(json.dumps([bijective, float((a != b).mean()), float((a != c).mean()),
                  all((r == w).all().item() for r, w in zip(resumed, whole[70:])),
                  len(set(seen.tolist())), int(seen.min()), int(seen.max()), peak]))
"""
    done = python(project, code)

    bijective, other_epoch, other_seed, resumed, distinct, low, high, peak = json.loads(done.stdout)
    assert bijective
    assert other_epoch > 0.99 and other_seed > 0.99  # each epoch and seed its own order
    assert resumed
    assert distinct == 80 * 256 and low >= 0 and high < 10**9 and high > 10**8  # spread over all
    assert peak < 2_000_000  # bytes: a permutation of 1e9 windows would be 8 GB
