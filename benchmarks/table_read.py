"""How fast does a classification project read a large table, and does training on it stay at the
loop's floor?

    python benchmarks/table_read.py                    # 1,000,000 rows x 20 columns, about a minute
    python benchmarks/table_read.py --rows 200000 --keep /tmp/tables

It writes a CSV (and the same table as Parquet) of `--rows` rows: 14 numeric columns with 2% of
values missing, 5 text columns of 3 to 40 levels (one with gaps) and a text label of 4 classes
that depends on both kinds. It renders a classification project (`scaffold.render.new_project`,
no git) and, in this process, times the project's own `load_splits` on each file: read
(pyarrow), typed, encoded with statistics of the training split, as tensors. It prints rows read
a second for the read alone and for the whole of load_splits.

Then it runs the project's `check loader` (a subprocess, as a user would) on the CSV and on the
synthetic default with the same batch: examples trained a second with real loading, and the step
time. The table's encoded width (about 100 features) is larger than the default's 16, so its step
is compared with the default's at the same --batch-size; the loader is the same in-memory gather.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from scaffold.render import new_project

LEVELS = (3, 5, 12, 25, 40)  # levels of each text column


def write_table(rows: int, folder: Path) -> tuple[Path, Path]:
    """The CSV and Parquet files of one random table of `rows` rows and 20 columns."""
    rng = np.random.default_rng(0)
    numbers = rng.standard_normal((rows, 14))
    codes = [rng.integers(0, n, rows) for n in LEVELS]
    score = numbers[:, 0] + numbers[:, 1] * numbers[:, 2] + (codes[1] % 2) - 0.1 * codes[2]
    label = np.digitize(score, np.quantile(score, [0.25, 0.5, 0.75]))
    columns: dict[str, pa.Array] = {}
    for i in range(14):
        values = numbers[:, i].round(4)
        columns[f"n{i}"] = pa.array(values, mask=rng.random(rows) < 0.02)
    for i, (n, code) in enumerate(zip(LEVELS, codes, strict=True)):
        names = np.array([f"level-{i}-{j}" for j in range(n)], dtype=object)
        columns[f"t{i}"] = pa.array(names[code], mask=(rng.random(rows) < 0.05) if i == 4 else None)
    columns["label"] = pa.array(np.array(["low", "mid", "high", "top"], dtype=object)[label])
    table = pa.table(columns)
    csv_path, parquet_path = folder / "big.csv", folder / "big.parquet"
    pa_csv.write_csv(table, csv_path)
    pq.write_table(table, parquet_path)
    return csv_path, parquet_path


def time_load(src: Path, pkg: str, path: Path, repeats: int) -> tuple[float, float, int]:
    """Best seconds of `repeats` to read the file alone, and for all of load_splits; features."""
    sys.path.insert(0, str(src))
    try:
        config = importlib.import_module(f"{pkg}.config")
        data = importlib.import_module(f"{pkg}.data")
        columns = importlib.import_module(f"{pkg}.columns")
        read, load = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            columns.read_table(path)
            read.append(time.perf_counter() - start)
            start = time.perf_counter()
            splits = data.load_splits(config.Config(data=str(path)))
            load.append(time.perf_counter() - start)
        return min(read), min(load), splits.n_features
    finally:
        sys.path.remove(str(src))


def check_loader(project: Path, pkg: str, args: list[str]) -> str:
    command = [sys.executable, "-m", pkg, "check", "loader", "--run-dir", "runs/x", *args]
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("loader:")), done.stderr)
    found = re.search(r"training step ([\d.]+) ms; with real loading ([\d,]+) samples/s", line)
    return f"step {found[1]} ms, {found[2]} examples/s" if found else line.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2, help="timings; the best shown")
    parser.add_argument("--keep", type=Path, help="work here (kept) instead of a temporary folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scaffold-tables-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        csv_path, parquet_path = write_table(args.rows, work)
        print(f"wrote {args.rows:,} rows x 20 columns in {time.perf_counter() - start:.1f} s: "
              f"{csv_path} ({csv_path.stat().st_size / 1e6:.0f} MB), "
              f"{parquet_path.name} ({parquet_path.stat().st_size / 1e6:.0f} MB)")  # fmt: skip
        shutil.rmtree(work / "tables", ignore_errors=True)  # fresh, even in a reused --keep folder
        project = new_project(work / "tables", {"task": "classification"}, git=False).path
        pkg = next(p.name for p in (project / "src").iterdir() if (p / "__main__.py").is_file())
        print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
        print("| file | read alone | load_splits (read, type, fit, encode) | features |")
        print("| --- | ---: | ---: | ---: |")
        for path in (csv_path, parquet_path):
            read, load, width = time_load(project / "src", pkg, path, args.repeats)
            print(
                f"| {path.name} | {read:.2f} s, {args.rows / read:,.0f} rows/s "
                f"| {load:.2f} s, {args.rows / load:,.0f} rows/s | {width} |"
            )
        batch = ["--batch-size", "256"]
        print("\n`check loader`, --batch-size 256 (training step, examples trained a second):")
        print(f"- {csv_path.name}: {check_loader(project, pkg, ['--data', str(csv_path), *batch])}")
        print(f"- synthetic default (16 features): {check_loader(project, pkg, batch)}")


if __name__ == "__main__":
    main()
