"""Tables as they come (classification and regression projects): what a run trains on is said at
its start, a label like a measurement is refused, dates are numbers, near-unique text and rare
levels are noted, the CSV separator is read off the header, an empty label gets advice, and
`split-leak` compares the file's rows, not their encoding. Each test writes its own small table.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_project import _env, render, run

ONE_STEP = ("--max-steps", "1", "--batch-size", "64", "--warmup-steps", "0")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("c") / "tab")


@pytest.fixture(scope="module")
def regressor(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("r") / "reg", task="regression")


def write(path: Path, header: list[str], rows, sep: str = ",") -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, delimiter=sep)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def species(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A feature and a two-class label it decides."""
    x = np.random.default_rng(seed).normal(size=n).round(3)
    return x, np.where(x > 0, "A", "B")


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr


def test_a_run_names_its_label_classes_and_split_sizes(classifier, tmp_path):
    x, y = species(1000)
    data = write(tmp_path / "t.csv", ["x1", "species"], zip(x, y, strict=True))
    done = run(classifier, "train", "--data", data, "--run-dir", tmp_path / "run", *ONE_STEP)
    assert done.returncode == 0, done.stderr
    assert f"data: {data}, label 'species', 2 classes; 900 train / 100 val examples" in done.stdout


def test_a_regression_run_names_its_target_and_range(regressor, tmp_path):
    x = np.linspace(-1, 1, 1000).round(4)
    data = write(tmp_path / "t.csv", ["x1", "price"], zip(x, (100 + 50 * x).round(2), strict=True))
    done = run(regressor, "train", "--data", data, "--run-dir", tmp_path / "run", *ONE_STEP)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("data: "))
    low, high = line.split("target 'price', ")[1].split(" in train")[0].split(" to ")
    assert 50 <= float(low) < 52 and 148 < float(high) <= 150  # the held-out tenth may hold an end
    assert line.endswith("; 900 train / 100 val examples")


def test_a_price_in_the_last_column_is_refused_not_trained(classifier, tmp_path):
    x, _ = species(1000)
    price = (1000 + 300 * x + np.arange(1000) % 400).astype(int)  # whole numbers, ~500 distinct
    data = write(tmp_path / "t.csv", ["x1", "price"], zip(x, price, strict=True))
    stderr = refusal(run(classifier, "train", "--data", data, "--run-dir", tmp_path / "run"))
    assert f"{data}: 'price' (the last column: no --label given) has " in stderr
    assert "name the column to predict with --label" in stderr and "--many-classes" in stderr
    assert not (tmp_path / "run").exists()


def test_a_numeric_label_like_a_measurement_is_refused_unless_confirmed(classifier, tmp_path):
    """40 weights in 2,000 rows is not a tenth of them, but numbers that are not 0..K-1 are a
    measurement more likely than 40 classes; 0..39 as class indices are classes."""
    rng = np.random.default_rng(0)
    grams = rng.integers(0, 40, 2000) * 5 + 250
    rows = zip(rng.normal(size=2000).round(3), grams, grams // 5 - 50, strict=True)
    data = write(tmp_path / "t.csv", ["x1", "grams", "code"], rows)
    args = ("--data", data, "--label", "grams", "--run-dir", tmp_path / "run", *ONE_STEP)
    stderr = refusal(run(classifier, "train", *args))
    assert "'grams' has 40 values in 1,800 training rows" in stderr and "--many-classes" in stderr
    done = run(classifier, "train", *args, "--many-classes")
    assert done.returncode == 0, done.stderr
    assert "label 'grams', 40 classes" in done.stdout
    code = ("--data", data, "--label", "code", "--run-dir", tmp_path / "code", *ONE_STEP)
    done = run(classifier, "train", *code)
    assert done.returncode == 0 and "label 'code', 40 classes" in done.stdout, done.stderr


def test_an_empty_label_column_is_refused_with_advice(classifier, tmp_path):
    x, _ = species(300)
    data = write(tmp_path / "t.csv", ["x1", "kind", "notes"], [(v, "a", "") for v in x])
    stderr = refusal(run(classifier, "train", "--data", data, "--run-dir", tmp_path / "run"))
    assert stderr == (
        f"error: {data}: 'notes' (the last column: no --label given) has no values: name the"
        " column to predict with --label\n"
    )
    done = run(classifier, "inspect-data", "--data", data, "--label", "kind")
    assert "'kind' has" not in done.stderr  # the empty column is no label: refused for one class
    assert "one class only" in done.stderr


def test_dates_are_numbers_with_their_parts_and_predict_reads_them(classifier, tmp_path):
    n = 1000
    x, y = species(n)
    start = np.datetime64("2021-01-01T00:00")
    when = start + np.random.default_rng(1).integers(0, 365 * 24 * 60, n).astype("m8[m]")
    day = (start + np.arange(n).astype("m8[D]")).astype("M8[D]")
    rows = [
        (str(w).replace("T", " "), str(d), v, s) for w, d, v, s in zip(when, day, x, y, strict=True)
    ]
    data = write(tmp_path / "t.csv", ["when", "day", "x1", "species"], rows)
    run_dir = tmp_path / "run"
    done = run(classifier, "train", "--data", data, "--run-dir", run_dir, *ONE_STEP)
    assert done.returncode == 0, done.stderr
    assert "unique on every row" not in done.stderr  # a timestamp is no id
    columns = json.loads((run_dir / "run.json").read_text())["data"]["columns"]
    when_spec, day_spec, _ = columns
    assert when_spec["type"] == "date" and when_spec["parts"] == ["month", "weekday", "hour"]
    assert day_spec["type"] == "date" and day_spec["parts"] == ["month", "weekday"]  # no time
    assert 18_628 < when_spec["median"] < 18_628 + 365  # days since 1970: in 2021
    shown = run(classifier, "inspect-data", "--data", data).stdout
    assert (
        "when: date, 0.0% missing; median 2021-" in shown and "parts month, weekday, hour" in shown
    )
    new = write(tmp_path / "new.csv", ["when", "day", "x1"], [row[:3] for row in rows[:20]])
    out = tmp_path / "p.csv"
    best = run_dir / "checkpoints" / "best.pt"
    done = run(classifier, "predict", new, "-o", out, "--checkpoint", best)
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 21


def test_parquet_dates_and_times_are_dates(regressor, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 600
    rng = np.random.default_rng(0)
    stamps = np.datetime64("2021-01-01T00:00:00", "ns") + rng.integers(0, 10**7, n).astype("m8[s]")
    days = np.datetime64("2021-01-01") + rng.integers(0, 300, n).astype("m8[D]")
    table = {
        "t": pa.array(stamps).cast(pa.timestamp("ns", tz="Europe/Paris")),
        "d": pa.array(days).cast(pa.date32()),
        "y": rng.normal(size=n),
    }
    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    done = run(regressor, "inspect-data", "--data", tmp_path / "t.parquet")
    assert done.returncode == 0, done.stderr
    assert "  t: date, 0.0% missing; median 2021-" in done.stdout and "hour" in done.stdout
    assert "  d: date, 0.0% missing; median 2021-" in done.stdout
    assert "x (7,)" in done.stdout  # each a day count beside its parts: t 1 + 3, d 1 + 2


def test_near_unique_text_is_left_out_and_a_column_mostly_other_is_noted(classifier, tmp_path):
    n = 2000
    x, y = species(n)
    rng = np.random.default_rng(3)
    comment = [f"row {i} said {rng.integers(10**6)}" for i in range(n)]
    comment[1] = comment[0]  # not unique on every row: no id, but as good as one
    code = [f"C{v}" for v in rng.integers(0, 400, n)]  # 400 levels: 32 kept hold about a tenth
    data = write(
        tmp_path / "t.csv",
        ["comment", "code", "x1", "species"],
        zip(comment, code, x, y, strict=True),
    )
    done = run(classifier, "inspect-data", "--data", data)
    assert done.returncode == 0, done.stderr
    assert (
        f"note: {data}: column 'comment' has 1,999 distinct values in 2,000 rows, nearly an id:"
        " left out of the features"
    ) in done.stderr
    other = next(line for line in done.stderr.splitlines() if "column 'code'" in line)
    assert other.startswith("note: column 'code': ") and "(other) feature" in other
    assert 80 <= int(other.split(": ")[2].split("%")[0]) <= 95
    assert "  comment:" not in done.stdout and "  code: text" in done.stdout


@pytest.mark.parametrize(
    ("sep", "point", "said"),
    [
        (";", ",", "fields separated by ';', decimal comma"),
        ("\t", ".", "fields separated by '\\t'"),
    ],
    ids=["semicolon-decimal-comma", "tab"],
)
def test_the_separator_is_read_off_the_header(classifier, tmp_path, sep, point, said):
    x, y = species(1000)
    rows = [
        (f"{v:.3f}".replace(".", point), "a" if v > 1 else "b", s)
        for v, s in zip(x, y, strict=True)
    ]
    data = write(tmp_path / "t.csv", ["x1", "kind", "species"], rows, sep=sep)
    done = run(classifier, "inspect-data", "--data", data)
    assert done.returncode == 0, done.stderr
    assert f"note: {data}: {said}" in done.stderr
    assert "  x1: number, 0.0% missing" in done.stdout and "  kind: text" in done.stdout
    assert "label: 'species'" in done.stdout


def leak_share(project: Path, data: Path) -> tuple[int, int]:
    """diagnose's split-leak count for a run on `data`: (validation rows in train, compared)."""
    package = next((project / "src").iterdir()).name
    code = (
        f"from {package}.tools.loss_findings import leak_share; from types import SimpleNamespace;"
        f"print(*leak_share(SimpleNamespace(config={{'data': {str(data)!r}}})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=_env(project), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return tuple(map(int, done.stdout.split()))


def test_split_leak_compares_the_rows_as_the_file_holds_them(classifier, tmp_path):
    """Ids left out, a timestamp and two two-level columns: encoded, the rows would collide by the
    hundred. As read, one row is repeated (under a new id), and no validation row is in train."""
    n = 1000
    rng = np.random.default_rng(1)
    when = np.datetime64("2020-01-01T00:00") + rng.integers(0, 365 * 24 * 60, n).astype("m8[m]")
    cut, color, label = (rng.choice(["p", "q"], n) for _ in range(3))
    rows = [
        (i, str(w), a, b, c)
        for i, (w, a, b, c) in enumerate(zip(when, cut, color, label, strict=True))
    ]
    rows.append((n, *rows[5][1:]))
    data = write(tmp_path / "leak.csv", ["id", "when", "cut", "color", "species"], rows)
    shared, n_val = leak_share(classifier, data)
    assert n_val == 100 and shared == 0
    twice = write(tmp_path / "twice.csv", ["id", "when", "cut", "color", "species"], rows[:n] * 2)
    shared, n_val = leak_share(classifier, twice)
    assert n_val == 200 and shared > 150  # each held-out row's twin is in train 90% of the time
