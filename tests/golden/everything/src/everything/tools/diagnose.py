"""Tool: reads finished runs and applies the training rules' table for when the loss looks wrong:

    python -m everything diagnose runs/default  # one line a finding
    python -m everything diagnose runs/a runs/b  # and what b no longer shows
    python -m everything diagnose runs/default --json  # for CI

Exit status 1 when a run has a finding. It reads run.json, metrics.jsonl, the latest check summary
(runs/check/summary.json) and, for the leak test, the run's data through load_splits; it writes
nothing. The rules are in loss_findings.py and loop_findings.py, each threshold named with its reason."""

import json

from .findings import Finding, Run, load_run
from .loop_findings import find_clip_pinned, find_loader_bound, find_near_chance, find_schedule
from .loss_findings import find_flat, find_nan, find_overfitting, find_spiky, find_val_better


def diagnose(run: Run, leak_test: bool = True) -> list[Finding]:
    """Every finding of the table that the run's records show, in the table's order."""
    if nan := find_nan(run):  # the curve before a NaN is the blow-up: reading it for the other rows misleads
        return nan + find_loader_bound(run)
    found = [*find_flat(run), *find_overfitting(run), *find_val_better(run, leak_test)]
    found += [*find_spiky(run), *find_loader_bound(run), *find_schedule(run)]
    names = {f.name for f in found}
    if "flat" not in names:  # a loss that does not move keeps its gradient large
        found += find_clip_pinned(run)
    if not names & {"flat", "lr-in-warmup"}:  # each explains a run that learnt next to nothing
        found += find_near_chance(run)
    return found


def config_change(before: Run, after: Run) -> str:
    """What differs between two runs' settings and code: the fix, as far as the records tell."""
    a, b = before.config, after.config
    changed = [f"--{k.replace('_', '-')} {a.get(k)} -> {b.get(k)}" for k in b if a.get(k) != b.get(k)]
    changed = [c for c in changed if not c.startswith("--run-dir")]
    commits = [r.record.get("git", {}).get("commit") for r in (before, after)]
    if commits[0] != commits[1]:
        changed.append(f"code {str(commits[0])[:12]} -> {str(commits[1])[:12]}")
    return ", ".join(changed) or "no change in settings or commit recorded"


def issues_fixed(before: Run, found_before: list[Finding], after: Run, found_after: list[Finding]):
    """The output contract's `**Issues fixed:** <bug -> evidence -> fix>`, one a finding that went away.
    Only a run that ran its course fixes one: in a run stopped early, it may not have shown yet."""
    if unfinished(after):
        return []
    still, fix = {f.name for f in found_after}, config_change(before, after)
    return [
        f"**Issues fixed:** {f.name} in {before.name} -> {f.evidence} -> {fix} (gone in {after.name})"
        for f in found_before
        if f.name not in still
    ]


def unfinished(run: Run) -> str | None:
    """Why `run` did not run its course (it has not finished, or a signal stopped it), or None."""
    finished = run.record.get("finished")
    if not finished:
        return f"{run.name} has not finished"
    if finished.get("stopped_by"):
        return f"{run.name} was stopped by {finished['stopped_by']} at step {finished.get('step', '?')}"
    return None


def run_diagnose(run_dirs: list[str], as_json: bool = False) -> int:
    """Prints each run's findings (and, for two or more, what changed); exit 1 if any run has one."""
    runs = [load_run(d) for d in run_dirs]
    found = [diagnose(run) for run in runs]
    lines, report = [], {"runs": [], "fixed": [], "new": []}
    for run, findings in zip(runs, found, strict=True):
        lines.append(f"{run.name}: {len(findings)} finding{'s' * (len(findings) != 1)}")
        lines += [f"  {f.line()}" for f in findings]
        report["runs"].append({"run_dir": run.name, "findings": [vars(f) for f in findings]})
    for i in range(1, len(runs)):
        (a, fa), (b, fb) = (runs[i - 1], found[i - 1]), (runs[i], found[i])
        names_a, names_b = {f.name for f in fa}, {f.name for f in fb}
        if new := sorted(names_b - names_a):
            lines.append(f"{b.name} shows what {a.name} does not: {', '.join(new)}")
        report["new"] += [{"run_dir": b.name, "since": a.name, "name": n} for n in new]
        gone = [f for f in fa if f.name not in names_b]
        fixed = issues_fixed(a, fa, b, fb)  # a line for each of `gone`, none from an unfinished run
        lines += fixed
        if gone and (why := unfinished(b)):
            lines.append(f"{', '.join(sorted(f.name for f in gone))} not shown, but not fixed: {why}")
        if fixed:
            report["fixed"] += [
                {"run_dir": b.name, "since": a.name, "name": f.name, "line": line}
                for f, line in zip(gone, fixed, strict=True)
            ]
    print(json.dumps(report, indent=2, ensure_ascii=False) if as_json else "\n".join(lines))  # ü, not \u00fc
    return 1 if any(found) else 0
