"""Tool: compare runs, curves of several runs in one figure, and a summary of one run:

    python -m everything plot runs/first runs/second -o curves.png
    python -m everything report runs/second --since runs/first

Both read the run folders' run.json and metrics.jsonl (and the latest check's summary); report
also runs diagnose on it, whose leak test reads the run's data."""

from pathlib import Path

from ..runtime.records import RunRecordError, check_summary_path, commit_label, read_metrics
from .checks import sanity
from .diagnose import diagnose, issues_fixed, unfinished
from .findings import DiagnoseError, Run, load_run


class ReportError(RuntimeError):
    """A run folder that cannot be reported on."""


def plot(run_dirs: list[str], output: str) -> Path:
    """Train and validation loss, and each validation metric, against step; one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ReportError('plot needs matplotlib: pip install -e ".[plot]"') from None
    try:
        runs = {run_dir: read_metrics(Path(run_dir)) for run_dir in run_dirs}
    except RunRecordError as error:
        raise ReportError(str(error)) from None
    names = {k for records in runs.values() for r in records if r["split"] == "val" for k in r}
    extra = sorted(names - {"step", "split", "loss"})  # the task's validation metrics
    fig, (axes,) = plt.subplots(1, 1 + len(extra), figsize=(5 * (1 + len(extra)), 4), squeeze=False)
    for i, (run_dir, records) in enumerate(runs.items()):
        color = f"C{i}"  # one colour a run: train solid, validation dashed with markers
        for split, style in (("train", "-"), ("val", "o--")):
            points = [(r["step"], r["loss"]) for r in records if r["split"] == split]
            if points:
                axes[0].plot(*zip(*points, strict=True), style, color=color, ms=3, label=f"{run_dir} {split}")
        for ax, name in zip(axes[1:], extra, strict=True):
            points = [(r["step"], r[name]) for r in records if r["split"] == "val" and name in r]
            if points:
                ax.plot(*zip(*points, strict=True), "o--", color=color, ms=3, label=run_dir)
    for ax, name in zip(axes, ["loss", *(f"val {name}" for name in extra)], strict=True):
        ax.set(xlabel="step", title=name)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    return Path(output)


def report(run_dir: str, since: str | None = None) -> str:
    """The Run, Sanity, Throughput, Results and Issues lines; with `since`, an earlier run: what got fixed."""
    try:
        run = load_run(run_dir)
        before = load_run(since) if since else None
    except DiagnoseError as error:
        raise ReportError(str(error)) from None
    record = run.record
    lines = [
        f"**Run:** {record['project']} commit {commit_label(record['git'])}, config {run.name}/run.json, "
        f"seed {record['seed']}, torch {record['versions']['torch']}"
    ]
    if weights := record.get("init_from"):  # train --init-from: what the run started from
        kept = ", ".join(weights["reinitialised"]) or "none"
        source = f"{weights['source']} (sha256 {weights['sha256'][:12]})"
        lines.append(f"**Weights:** {source}; re-initialised (model.HEAD): {kept}")
    if run.summary is not None:
        lines.append(f"**Sanity:** {sanity(run.summary)} ({check_summary_path(run.dir)})")
        share = f"{run.summary['loader_share']:.1%}"
    else:
        other = f"not checked on this run's code and data: {run.other_checks}"
        why = other if run.other_checks else "not checked yet"
        lines.append(f"**Sanity:** {why}: python -m {__package__.rpartition('.')[0]} check all")
        share = "n/a"
    finished = record.get("finished")
    speed = f"{finished['examples_per_s']:,.0f} samples/s" if finished else "n/a (not finished)"
    if finished and "data_wait_share" in finished:  # the run's own, over its whole loop
        share = f"{finished['data_wait_share']:.1%}"
    lines.append(f"**Throughput:** {speed}, GPU util n/a, data-loader time share {share}")
    if run.val:
        best = min(run.val, key=lambda r: r["loss"])
        shown = ", ".join(f"{k} {v:.4g}" for k, v in best.items() if k not in ("step", "split"))
        where = run.dir / "checkpoints" / "best"
        if "://" in run.name:  # as the run's end found it on the store (not finished: not known)
            where = (finished or {}).get("best_checkpoint", f"{run.name}/checkpoints/best")
        elif not where.exists():
            where = None
        lines.append(f"**Results:** best val {shown} at step {best['step']}; checkpoint {where or 'lost'}")
    else:
        lines.append("**Results:** no validation yet")
    return "\n".join(lines + issues(run, before))


def issues(after: Run, before: Run | None) -> list[str]:
    """The Issues lines: findings still open in this run, and those fixed since an earlier one."""
    found = diagnose(after)
    lines = [f"**Issues found:** {'; '.join(f.line() for f in found)}"] if found else []
    if before is not None:
        fixed = issues_fixed(before, diagnose(before), after, found)  # none from an unfinished run
        if not fixed and (why := unfinished(after)):
            fixed = [f"**Issues fixed:** not judged: {why}; compare a run that ran its course"]
        lines += fixed or [f"**Issues fixed:** none since {before.name}"]
    return lines
