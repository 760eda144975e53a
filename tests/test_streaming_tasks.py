"""Streamed data, the tasks' side (issue 43): `prepare` writes each task's data as shards (token
ids, tars of image files, Parquet rows) with an index that describes every shard exactly (bytes,
examples, SHA-256); the shards open with standard tools without the project; `train --data` on
them runs repeatably; and their validation split is the one the local data gives. Each task's
project is rendered once for the module, its synthetic data prepared once.
"""

from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import warm_python
from PIL import Image
from test_project import _env, render, run

TASKS = ("generation", "image", "classification", "regression")
SHARD_MB = {"generation": "0.05", "image": "0.02", "classification": "0.1", "regression": "0.1"}
TRAIN = ("--max-steps", "20", "--batch-size", "16", "--log-every", "5", "--eval-every", "10")


@pytest.fixture(scope="module")
def projects(tmp_path_factory):
    """task -> its streaming project, rendered the first time a test asks."""
    made: dict[str, Path] = {}

    def get(task: str) -> Path:
        if task not in made:
            made[task] = render(tmp_path_factory.mktemp(task) / "demo", task=task, streaming=True)
        return made[task]

    return get


@pytest.fixture(scope="module")
def prepared(projects, tmp_path_factory):
    """task -> (its project, a shard folder of its synthetic data), prepared when first asked."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(task: str) -> tuple[Path, Path]:
        if task not in made:
            project, out = projects(task), tmp_path_factory.mktemp(f"{task}-shards") / "shards"
            source = ()
            if task == "generation":  # its prepare tokenizes a text: the synthetic one, as a file
                text = project / "synthetic.txt"
                text.write_text(
                    python(
                        project,
                        "from demo.data import synthetic_text; print(synthetic_text(), end='')",
                    )
                )
                source = ("--data", text, "--tokenizer", "char")
            done = run(project, "prepare", *source, "--out", out, "--shard-mb", SHARD_MB[task])
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("wrote "), done.stdout
            made[task] = project, out
        return made[task]

    return get


def python(project: Path, code: str) -> str:
    """What `code` prints, run with the project's package importable."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def examples_in(path: Path, dtype: str | None) -> int:
    """A shard's examples counted with standard tools alone: numpy, tarfile, pyarrow."""
    if path.suffix == ".bin":
        return len(np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<")))
    if path.suffix == ".tar":
        with tarfile.open(path) as tar:
            members = tar.getmembers()
            stems = collections.Counter(m.name.split(".")[0] for m in members)
            assert set(stems.values()) == {2}, "an image and its .cls, for every key"
            for m in members:
                data = tar.extractfile(m).read()
                if m.name.endswith(".cls"):
                    assert data.decode().isdigit(), m.name
                else:
                    Image.open(io.BytesIO(data)).verify()
        return len(stems)
    return pq.ParquetFile(path).metadata.num_rows


def checked_index(folder: Path, task: str) -> dict:
    """The index, once every file it names is as it says (bytes, examples, SHA-256 recomputed) and
    the folder holds nothing else."""
    index = json.loads((folder / "index.json").read_text())
    assert (index["format"], index["version"], index["task"]) == ("scaffold-shards", 1, task)
    entries = [entry for split in ("train", "val") for entry in index["splits"][split]]
    assert index["splits"]["train"] and index["splits"]["val"]
    named = {"index.json", *index["files"], *(entry["name"] for entry in entries)}
    assert {path.name for path in folder.iterdir()} == named
    for name, entry in [*index["files"].items(), *((entry["name"], entry) for entry in entries)]:
        data = (folder / name).read_bytes()
        assert (entry["bytes"], entry["sha256"]) == (len(data), sha256(data)), name
    for entry in entries:
        assert entry["examples"] == examples_in(
            folder / entry["name"], index["meta"].get("dtype")
        ), entry
    return index


# What load_splits gives of the local data and of the shards, the same batches compared tensor for
# tensor: `SOURCE` is the local data's --data (None: the synthetic default).
SAME_SPLITS = """
import sys, torch
from demo.config import Config
from demo.data_shards import load_splits
from demo.runtime.loader import read_batch

local = load_splits(Config(data=SOURCE, batch_size=4, **LABEL))
streamed = load_splits(Config(data=sys.argv[1], batch_size=4))
for split in SPLITS:
    ours, theirs = getattr(local, split), getattr(streamed, split)
    assert len(ours) == len(theirs), (split, len(ours), len(theirs))
    everything = torch.arange(len(ours))
    for a, b in zip(read_batch(ours, everything), read_batch(theirs, everything), strict=True):
        assert torch.equal(a, b), split
facts = ("classes", "mean", "std", "n_features", "columns", "label", "y_mean", "y_std", "ids")
ours, theirs = local.describe(), streamed.describe()
print({k: ours[k] for k in facts if k in ours} == {k: theirs[k] for k in facts if k in theirs})
"""


def same_splits(
    project: Path, shards: Path, source: Path | None, label: str | None, splits=("val",)
) -> bool:
    labelled = repr({"label": label} if label else {})
    code = SAME_SPLITS.replace("SOURCE", repr(source and str(source))).replace("LABEL", labelled)
    done = subprocess.run(
        [sys.executable, "-c", code.replace("SPLITS", repr(splits)), str(shards)],
        cwd=project, env=_env(project), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


@pytest.mark.parametrize("task", TASKS)
def test_prepare_writes_shards_that_the_index_describes_and_standard_tools_open(prepared, task):
    _, shards = prepared(task)
    index = checked_index(shards, task)
    assert len(index["splits"]["train"]) >= 3, (
        "--shard-mb cut the synthetic data into several shards"
    )
    if task == "generation":
        assert set(index["files"]) == {"tokenizer.json"}
        assert json.loads((shards / "tokenizer.json").read_text())["vocab"]
    elif task == "image":
        assert index["meta"]["classes"] == ["circle", "cross", "square", "triangle"]
    else:
        assert index["meta"]["label"] in ("label", "target") and index["meta"]["columns"]


def test_generation_shards_hold_the_text_and_validate_on_its_windows(prepared):
    """The token ids of every shard, decoded, are the text; the streamed validation windows are the
    val shard's tokens cut every --block-size."""
    project, shards = prepared("generation")
    code = f"""
import numpy as np, torch
from demo.config import Config
from demo.data import synthetic_text
from demo.data_shards import load_splits
from demo.runtime.loader import read_batch
from demo.tokens import EOT

splits = load_splits(Config(data={str(shards)!r}, block_size=32))
tokens, text = {{}}, ""
for split in ("train", "val"):
    files = [{str(shards)!r} + "/" + e["name"] for e in getattr(splits, split).entries]
    tokens[split] = np.concatenate([np.fromfile(f, dtype="<u2") for f in files])
    text += splits.tokenizer.decode(tokens[split].tolist())
assert text.endswith(EOT) and text.replace(EOT, "") == synthetic_text()
val = torch.from_numpy(tokens["val"].astype(np.int64))
x, y = read_batch(splits.val, torch.arange(len(splits.val)))
at = torch.arange(len(splits.val))[:, None] * 32 + torch.arange(33)  # (windows, 33)
assert torch.equal(x, val[at[:, :-1]]) and torch.equal(y, val[at[:, 1:]])
print(len(splits.val))
"""
    n_val = len(np.fromfile(shards / "val-00000.bin", dtype="<u2"))
    assert int(python(project, code)) == (n_val - 33) // 32 + 1


@pytest.mark.parametrize("task", ["image", "classification", "regression"])
def test_streamed_splits_are_those_of_the_local_data(prepared, task):
    """Every example of both splits, as the loader reads it (an image's augmented training view
    too), and the facts the model and `predict` take (classes, mean and std, encoding)."""
    project, shards = prepared(task)
    assert same_splits(project, shards, None, None, splits=("val", "train"))


def test_image_files_are_sharded_byte_for_byte_and_validate_as_read_from_disk(projects, tmp_path):
    project = projects("image")
    folder = tmp_path / "photos"
    rng = np.random.default_rng(0)
    for i in range(24):
        kind = ("cats", "dogs")[i % 2]
        (folder / kind).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)
        fmt = ("png", "jpg", "png")[i % 3]
        Image.fromarray(pixels).convert("L" if i % 4 == 0 else "RGB").save(
            folder / kind / f"{i}.{fmt}"
        )
    shards = tmp_path / "shards"
    done = run(
        project,
        "prepare",
        "--data",
        folder,
        "--out",
        shards,
        "--batch-size",
        "4",
        "--shard-mb",
        "0.005",
    )
    assert done.returncode == 0, done.stderr
    index = checked_index(shards, "image")
    assert index["meta"]["classes"] == ["cats", "dogs"] and len(index["splits"]["train"]) >= 2
    stored = []
    for entry in [*index["splits"]["train"], *index["splits"]["val"]]:
        with tarfile.open(shards / entry["name"]) as tar:
            stored += [
                tar.extractfile(m).read() for m in tar.getmembers() if not m.name.endswith(".cls")
            ]
    originals = [path.read_bytes() for path in folder.rglob("*.*")]
    assert sorted(stored) == sorted(originals)  # each file's bytes, never re-encoded
    assert same_splits(project, shards, folder, None, splits=("val", "train"))
    again = run(project, "prepare", "--data", shards, "--out", tmp_path / "again")
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"error: {shards}: shards already: `train --data {shards}` streams them"
    ]


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_csv_with_text_columns_is_sharded_as_read_and_validates_as_the_csv_does(
    projects, tmp_path, task
):
    project = projects(task)
    data, rng = tmp_path / "table.csv", np.random.default_rng(1)
    with data.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["id", "colour", "size", "day", "species", "price"])
        for i in range(400):
            colour, size = rng.choice(["red", "green", "blue", ""]), round(float(rng.normal()), 3)
            species = "A" if (size > 0) != (colour == "red") else "B"
            day = f"2024-0{rng.integers(1, 10)}-1{rng.integers(0, 9)}"
            out.writerow(
                [
                    f"id{i}",
                    colour,
                    "" if i % 17 == 0 else size,
                    day,
                    species,
                    round(10 + 3 * size, 2),
                ]
            )
    label = "species" if task == "classification" else "price"
    shards = tmp_path / "shards"
    done = run(
        project, "prepare", "--data", data, "--label", label, "--out", shards, "--shard-mb", "0.005"
    )
    assert done.returncode == 0, done.stderr
    index = checked_index(shards, task)
    assert [spec["name"] for spec in index["meta"]["columns"]] == [
        name for name in ("colour", "size", "day", "species", "price") if name != label
    ]
    assert {spec["type"] for spec in index["meta"]["columns"]} >= {"text", "number", "date"}
    as_read = pa_csv.ConvertOptions(strings_can_be_null=True)  # as columns.read_table reads it
    rows = pa_csv.read_csv(data, convert_options=as_read).drop_columns(["id"])
    stored = [
        pq.read_table(shards / e["name"])
        for e in [*index["splits"]["train"], *index["splits"]["val"]]
    ]
    assert sorted(map(str, (r for t in stored for r in t.to_pylist()))) == sorted(
        map(str, rows.to_pylist())
    )
    assert same_splits(project, shards, data, label, splits=("val", "train"))
    other = "size"  # another column: the shards were encoded for `label`
    refused = run(project, "inspect-data", "--data", shards, "--label", other)
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        f"error: {shards}: shards of the label {label!r}, not --label {other}"
    ]


@pytest.mark.parametrize("task", TASKS)
def test_training_from_a_shard_folder_is_repeatable_to_the_byte(prepared, task, tmp_path):
    """Two runs of 20 steps, the same records to the byte; `predict` takes their checkpoint (an
    image, rows of a table: a validation shard's, read with tarfile and pyarrow)."""
    project, shards = prepared(task)
    metrics = []
    for name in ("first", "second"):
        done = run(project, "train", "--data", shards, "--run-dir", f"runs/{name}", *TRAIN)
        assert done.returncode == 0, done.stderr
        metrics.append((project / "runs" / name / "metrics.jsonl").read_bytes())
    assert metrics[0] == metrics[1]
    steps = [json.loads(line) for line in metrics[0].splitlines()]
    assert [r["step"] for r in steps if r["split"] == "val"] == [10, 20]
    best = project / "runs" / "first" / "checkpoints" / "best.pt"
    if task == "image":
        with tarfile.open(shards / "val-00000.tar") as tar:
            first = tar.getmembers()[0]
            (tmp_path / first.name).write_bytes(tar.extractfile(first).read())
        done = run(project, "predict", tmp_path / first.name, "--checkpoint", best)
        assert done.returncode == 0 and done.stdout.startswith(str(tmp_path / first.name)), done
    elif task != "generation":
        rows = pq.read_table(shards / "val-00000.parquet")
        pa_csv.write_csv(rows, tmp_path / "rows.csv")
        out = tmp_path / "predicted.csv"
        done = run(project, "predict", tmp_path / "rows.csv", "-o", out, "--checkpoint", best)
        assert done.returncode == 0, done.stderr
        assert pa_csv.read_csv(out).num_rows == rows.num_rows


def test_generation_prepares_to_a_url_that_trains_inspects_and_samples(projects, tmp_path):
    """Shards written to a store (moto's S3 server): every object the index names, the index last;
    `train`, `inspect-data` and `sample` (the BPE tokenizer of the index's files) read them."""
    pytest.importorskip("moto")
    import boto3
    from test_store import KEYS, moto_server, s3_keys

    project, corpus = projects("generation"), tmp_path / "corpus.txt"
    words = np.random.default_rng(0).choice(
        ["the", "cat", "sees", "a", "red", "ball", "by", "sea"], 6000
    )
    corpus.write_text(
        "".join(f"{word}\n" if i % 10 == 9 else f"{word} " for i, word in enumerate(words))
    )
    with moto_server() as endpoint:
        store = boto3.client("s3", endpoint_url=endpoint, **s3_keys())
        store.create_bucket(Bucket="data")
        env = {
            **_env(project),
            **KEYS,
            "AWS_ENDPOINT_URL": endpoint,
            "XDG_CACHE_HOME": str(tmp_path),
        }
        url = "s3://data/corpus"

        def command(*args: object) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-m", "demo", *map(str, args)]
            done = warm_python.run(argv, cwd=project, env=env, timeout=300)
            assert done.returncode == 0, done.stderr
            return done

        prepare = ("--tokenizer", "bpe", "--vocab-size", "300", "--shard-mb", "0.01")
        command("prepare", "--data", corpus, "--out", url, *prepare)
        objects = store.list_objects_v2(Bucket="data", Prefix="corpus/")["Contents"]
        stored = {o["Key"].split("/", 1)[1]: o["Size"] for o in objects}
        index = json.loads(store.get_object(Bucket="data", Key="corpus/index.json")["Body"].read())
        named = {**index["files"], **{e["name"]: e for s in index["splits"].values() for e in s}}
        assert stored == {"index.json": stored["index.json"]} | {
            n: e["bytes"] for n, e in named.items()
        }
        assert len(index["splits"]["train"]) >= 2 and index["meta"]["tokenizer"] == "bpe"
        assert "train: " in command("inspect-data", "--data", url).stdout
        command(
            "train",
            "--data",
            url,
            "--run-dir",
            "runs/url",
            "--max-steps",
            "10",
            "--batch-size",
            "8",
        )
        sampled = command(
            "sample", "--checkpoint", "runs/url/checkpoints/best.pt", "--max-new-tokens", "5"
        )
        assert sampled.stdout.strip()


def test_documents_on_shards_are_refused_in_one_line(prepared):
    """A shard may end inside a document, so --documents (whole documents) refuses shards."""
    project, shards = prepared("generation")
    done = run(project, "train", "--data", shards, "--documents", "--run-dir", "runs/documents")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"error: {shards}: --documents needs whole documents, and a shard may end inside one"
    ]
    assert not (project / "runs" / "documents" / "metrics.jsonl").exists()
