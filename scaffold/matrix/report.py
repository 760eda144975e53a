"""What `scaffold matrix` prints and writes about the outcomes: progress, summary, JUnit XML."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from xml.etree import ElementTree

from scaffold.matrix.plan import CROSS_CHECK, LINT_ONLY

if TYPE_CHECKING:
    from scaffold.matrix.runner import Outcome

STEPS = ("render", "lint", "prepare", "check")  # prepare: the generation task's token folder


def summary(outcomes: Sequence[Outcome], wall: float, slowest: int = 5) -> str:
    """The table printed at the end: counts, times, the slowest combinations, each failure."""
    passed = [o for o in outcomes if o.passed]
    failed = [o for o in outcomes if not o.passed]
    rendered = sum("render" in o.seconds and o.step != "render" for o in outcomes)
    linted = sum("lint" in o.seconds and o.step != "lint" for o in outcomes)
    checked = sum("check" in o.seconds for o in outcomes)
    kinds = Counter(o.plan.kind for o in outcomes)  # "all", a twin's check, resume+init, ...
    twins = ", ".join(
        _kind_count(k, n)
        for k, n in sorted(kinds.items(), key=lambda kind: kind[0] in (CROSS_CHECK, LINT_ONLY))
        if k != "all"
    )
    lines = [
        f"combinations {len(outcomes)}: passed {len(passed)}, failed {len(failed)} "
        f"(rendered {rendered}, lint-clean {linted}, checks run {checked}: "
        f"check all on {kinds['all']}{', ' + twins if twins else ''})",
    ]
    if outcomes:
        totals = sorted(o.total for o in outcomes)
        lines.append(
            f"time per combination: median {_median(totals):.1f} s, slowest {totals[-1]:.1f} s; "
            + ", ".join(
                f"{step} median {_median(times):.1f} s"
                for step in STEPS
                if (times := [o.seconds[step] for o in outcomes if step in o.seconds])
            )
        )
        by_task: dict[str, list[float]] = {}
        for o in outcomes:
            key = f"{o.answers.get('task')}{'+compile' if o.answers.get('compile') else ''}"
            by_task.setdefault(key, []).append(o.total)
        job: dict[str, float] = {}
        for o in outcomes:
            job[o.plan.kind] = job.get(o.plan.kind, 0.0) + o.total
        lines.append(
            "job time by check (the sum over combinations, all jobs together): "
            + ", ".join(f"{k} {_duration(job[k])} ({kinds[k]})" for k in sorted(job))
        )
        lines.append(
            "median by task: "
            + ", ".join(f"{k} {_median(sorted(v)):.1f} s" for k, v in sorted(by_task.items()))
        )
        lines.extend(_family_table(outcomes))
        lines.extend(cost_model(outcomes))
        lines.append("slowest:")
        width = max(len(o.name) for o in outcomes)
        for o in sorted(outcomes, key=lambda o: -o.total)[:slowest]:
            steps = "  ".join(f"{s} {o.seconds[s]:5.1f}" for s in STEPS if s in o.seconds)
            lines.append(f"  {o.name:<{width}}  {o.total:6.1f} s  ({steps})")
    for o in failed:
        lines.append("")
        where = f" (kept in {o.project})" if o.project else ""
        lines.append(f"FAILED {o.name} at {o.step}{where}, {o.plan.label}")
        lines.append(_indent(o.tail()))
    lines.append(f"matrix wall time: {_duration(wall)}")
    return "\n".join(lines)


def _kind_count(kind: str, count: int) -> str:
    if kind == CROSS_CHECK:
        return f"--help on {count}"
    if kind == LINT_ONLY:
        return f"no check (lint only) on {count}"
    return f"checks {', '.join(kind.split('+'))} on {count}"


# What one more boolean answer is taken to read, for the cost model: the task and distributed
# answer, as finetune, streaming, compile and the accumulation do (their primaries: 15 each).
NEW_ANSWER_PRIMARIES = 5 * 3


def cost_model(outcomes: Sequence[Outcome]) -> list[str]:
    """Job-minutes by phase (render and lint of every combination; each kind of check) and what
    one more boolean answer would add: its primaries' checks at the mean `check all`, and the
    render of twice the combinations (its lint: the distinct texts its pieces add, about none)."""
    render = sum(o.seconds.get("render", 0.0) for o in outcomes if o.plan.which == LINT_ONLY)
    share = render / max(1, sum(o.plan.which == LINT_ONLY for o in outcomes))
    lint = sum(o.seconds.get("lint", 0.0) for o in outcomes)
    by_kind: dict[str, list[float]] = {}
    for o in outcomes:
        checked = sum(t for step, t in o.seconds.items() if step != "lint")
        if o.plan.which != LINT_ONLY:
            checked -= share  # its share of the in-memory render: counted under render
            by_kind.setdefault(o.plan.kind, []).append(checked)
    renders = share * len(outcomes)
    phases = [f"render {renders / 60:.1f}", f"lint {lint / 60:.1f}"]
    phases += [f"{k} {sum(v) / 60:.1f} ({len(v)})" for k, v in sorted(by_kind.items())]
    alls = by_kind.get("all", [])
    check = sum(alls) / len(alls) if alls else 0.0
    added = NEW_ANSWER_PRIMARIES * check + renders
    return [
        "job-minutes by phase: " + ", ".join(phases),
        f"one more boolean answer reading task and distributed: {NEW_ANSWER_PRIMARIES} primaries"
        f" at {check:.1f} s a check all and {len(outcomes):,} more renders: about"
        f" {added / 60:.1f} job-minutes",
    ]


FAMILY = ("task", "distributed")  # the rows of the job-time table


def _family_table(outcomes: Sequence[Outcome]) -> list[str]:
    """Job time by task and distributed mode: each check's (and count), then render and lint
    together, slowest family first: where the matrix's time goes."""
    kinds = sorted({o.plan.kind for o in outcomes}, key=lambda k: (k != "all", k))
    rows: dict[str, dict[str, list[float]]] = {}
    for o in outcomes:
        name = " ".join(str(o.answers.get(k, "-")) for k in FAMILY)
        row = rows.setdefault(name, {})
        checked = sum(t for step, t in o.seconds.items() if step not in ("render", "lint"))
        row.setdefault(o.plan.kind, []).append(checked)
        row.setdefault("render+lint", []).append(
            o.seconds.get("render", 0.0) + o.seconds.get("lint", 0.0)
        )
    columns = [*kinds, "render+lint"]
    width = max(len(name) for name in rows)
    lines = ["job time by family (checks with prepare, and count; render and lint apart):"]
    lines.append(f"  {'':<{width}}  " + "".join(f"{c:>16}" for c in [*columns, "total"]))
    by_total = sorted(rows.items(), key=lambda item: -sum(sum(v) for v in item[1].values()))
    for name, row in by_total:
        cells = [
            f"{_duration(sum(row[c]))} ({len(row[c])})"
            if c in row and c != "render+lint"
            else (_duration(sum(row[c])) if c in row else "-")
            for c in columns
        ]
        total = _duration(sum(sum(v) for v in row.values()))
        lines.append(f"  {name:<{width}}  " + "".join(f"{c:>16}" for c in [*cells, total]))
    return lines


def write_junit(outcomes: Sequence[Outcome], path: Path, wall: float) -> None:
    """A JUnit XML report: one test case a combination, its failing step as the failure."""
    suite = ElementTree.Element(
        "testsuite",
        name="scaffold matrix",
        tests=str(len(outcomes)),
        failures=str(sum(not o.passed for o in outcomes)),
        errors="0",
        time=f"{wall:.3f}",
    )
    for o in outcomes:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"matrix.{o.answers.get('task', 'project')}",
            name=o.name,
            time=f"{o.total:.3f}",
        )
        if not o.passed:
            failure = ElementTree.SubElement(case, "failure", message=f"{o.step} failed")
            failure.text = o.tail(200)
    path.parent.mkdir(parents=True, exist_ok=True)
    ElementTree.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def progress_line(outcome: Outcome, done: int, total: int, failed: int, elapsed: float) -> str:
    status = "ok" if outcome.passed else f"FAILED at {outcome.step}"
    notes = "".join(f"; {note}" for note in outcome.notes)
    return (
        f"[{done}/{total}] {failed} failed, {_duration(elapsed)}: "
        f"{outcome.name} {status} ({outcome.total:.1f} s){notes}"
    )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
