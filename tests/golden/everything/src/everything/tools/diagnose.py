"""Tool: reads finished runs and applies the training rules' table for when the loss looks wrong:

    python -m everything diagnose runs/default  # one line a finding
    python -m everything diagnose runs/a runs/b  # and what b no longer shows
    python -m everything diagnose runs/default --json  # for CI

Exit status 1 when a run has a finding.

It reads run.json, metrics.jsonl, the latest check summary (runs/check/summary.json) and, for the
leak test, the run's data through load_splits. It writes nothing.
"""

import hashlib
import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.records import (
    RunRecordError,
    check_summary_path,
    read_check_summary,
    read_metrics,
    read_record,
)

# Thresholds, each with why that value.
MIN_TRAIN_RECORDS = 5  # fewer logged train steps than this say nothing about a curve
ENDS = 3  # train records averaged at each end of a stretch: one batch is noisy
FLAT_MIN_DROP = 0.05  # a working loop takes 5% off the initial loss in its first hundreds of steps
OVERFIT_MIN_EVALS = 3  # validations in a row above the best: one bad validation is noise
OVERFIT_RISE = 0.10  # their mean is 10% above the best validation loss: more than eval noise
OVERFIT_TRAIN_DROP = 0.05  # while train loss fell by 5% or more over the same stretch
VAL_BETTER_MARGIN = 0.30  # val loss 30% below train: far past the noise of a batch's loss
VAL_BETTER_SHARE = 0.5  # on over half of the validations in the run's second half
LEAK_MIN_SHARE = 0.05  # val inputs also in train: text repeats a few windows naturally (1 in 244)
LEAK_MAX_EXAMPLES = 300_000  # examples hashed per split: seconds, not minutes
SPIKE_WINDOW = 20  # train records in the running baseline (their median)
SPIKE_FACTOR = 1.5  # a loss 1.5x its running median is a spike, not batch-to-batch noise
SPIKE_MIN_RISE = 0.05  # and above it by 5% of the initial loss: near zero, wiggles are large ratios
SPIKE_MIN_COUNT = 3  # spikes before a run is spiky: one can be a bad batch
LOADER_BOUND_SHARE = 0.5  # time waiting for data: past half, loading is slower than the step itself
CLIP_PINNED_SHARE = 0.9  # steps after warmup with the gradient norm over the clip: the clip always acts
# and their median norm 10x the clip: just over it costs AdamW little (it rescales its updates),
# ten times over, the clip is far too low or the gradients keep growing
CLIP_PINNED_FACTOR = 10.0
SCHEDULE_FLOOR_SHARE = 0.10  # share of the run spent at the decay's floor: it ended before the run
LR_JUMP_FACTOR = 1.5  # after warmup the lr only decays: a rise by half is a restarted schedule
SKIPPED_MAX_SHARE = 0.05  # fp16 steps the gradient scaler skipped: a few at the start find the scale

CHECKS = {  # the first checks the training rules give, by finding
    "nan": "learning rate too high; fp16 overflow (switch to bf16 or check the scaler); "
    "log of zero or division by zero in a custom loss",
    "flat": "gradients not flowing (requires_grad, detached tensors); learning rate far too low; "
    "labels misaligned",
    "overfitting": "more data or augmentation; regularisation (--dropout, --weight-decay); "
    "early stopping (--patience) and best",
    "val-better-than-train": "dropout or augmentation only in train (normal), or leakage between splits",
    "split-leak": "the same examples in both splits (duplicated rows?): deduplicate before splitting",
    "spiky": "learning rate too high or no warmup (--warmup-steps); bad samples (inspect-data); "
    "batch too small",
    "loader-bound": "raise --num-workers; move decoding out of the main process; profile one window",
    "lr-in-warmup": "the run ended inside its warmup: more --max-steps or fewer --warmup-steps",
    "lr-jump": "the schedule restarted without warmup, a cause of spikes: keep --max-steps when resuming, "
    "or start a new run",
    "schedule-ended-early": "the schedule is built for fewer steps than the run trained (an edited "
    "lr_factor?): build it for max_steps",
    "grad-norm-pinned": "every update is clipped far below its norm: --grad-clip too low for this "
    "model, or gradients growing (learning rate too high)",
}


class DiagnoseError(RuntimeError):
    """A run folder that cannot be read."""


@dataclass
class Finding:
    name: str
    evidence: str  # what the records show, with steps and values
    step: int | None = None  # where it starts, when it has a start
    checks: str = field(init=False)

    def __post_init__(self) -> None:
        self.checks = CHECKS[self.name]

    def line(self) -> str:
        return f"{self.name}: {self.evidence}; first checks: {self.checks}"


@dataclass
class Run:
    dir: Path
    record: dict  # run.json
    train: list[dict]  # metrics.jsonl's train records, in step order
    val: list[dict]
    summary: dict | None  # the check summary beside the run, if `check all` wrote one

    @property
    def config(self) -> dict:
        return self.record.get("config", {})


def load_run(run_dir: str) -> Run:
    path = Path(run_dir)
    try:
        record = read_record(path)
        metrics = read_metrics(path)
    except RunRecordError as error:
        raise DiagnoseError(str(error)) from None
    except OSError as error:
        raise DiagnoseError(f"cannot read {path / 'metrics.jsonl'}: {error.strerror}") from None
    train = [r for r in metrics if r["split"] == "train"]
    return Run(path, record, train, [r for r in metrics if r["split"] == "val"], read_check_summary(path))


def diagnose(run: Run, leak_test: bool = True) -> list[Finding]:
    """Every finding of the table that the run's records show, in the table's order."""
    nan = find_nan(run)
    if nan:  # the curve before a NaN is the blow-up itself: reading it for the other rows misleads
        return nan + find_loader_bound(run)
    found = [*find_flat(run), *find_overfitting(run), *find_val_better(run, leak_test)]
    found += [*find_spiky(run), *find_loader_bound(run), *find_schedule(run)]
    if not any(f.name == "flat" for f in found):  # a loss that does not move keeps its gradient large
        found += find_clip_pinned(run)
    return found


def find_nan(run: Run) -> list[Finding]:
    precision = run.record.get("precision", "fp16")
    scaled = bool(run.train) and "skipped_steps" in run.train[-1]  # the gradient scaler's count
    skipped = run.train[-1]["skipped_steps"] if scaled else 0
    scaler = f", the gradient scaler skipped {skipped} steps" if scaled else ""
    for i, r in enumerate(run.train):
        # With a scaler an inf gradient norm is a skipped step, counted below, not a failure.
        if math.isfinite(r["loss"]) and (scaled or math.isfinite(r["grad_norm"])):
            continue
        what = f"loss {r['loss']}" if not math.isfinite(r["loss"]) else f"grad_norm {r['grad_norm']}"
        if i:
            b = run.train[i - 1]
            before = f"before it, step {b['step']}: loss {b['loss']:.4g}, grad_norm {b['grad_norm']:.4g}"
        else:
            before = "at the first logged step"
        evidence = f"{what} at step {r['step']} (lr {r['lr']:.3g}); {before}; precision {precision}{scaler}"
        if i >= 2:
            first = run.train[0]
            evidence += f"; the loss went {first['loss']:.4g} at step {first['step']} -> {b['loss']:.4g}"
        return [Finding("nan", evidence, r["step"])]
    steps = run.train[-1]["step"] if run.train else 0
    if scaled and skipped > SKIPPED_MAX_SHARE * steps:
        evidence = f"fp16 gradients overflowed on {skipped} of {steps} steps, skipped by the gradient scaler"
        return [Finding("nan", f"{evidence} ({skipped / steps:.0%}); precision {precision}")]
    return []


def _finite(records: list[dict]) -> list[dict]:
    return [r for r in records if math.isfinite(r["loss"])]


def _mean_loss(records: list[dict]) -> float:
    return statistics.fmean(r["loss"] for r in records)


def find_flat(run: Run) -> list[Finding]:
    train = _finite(run.train)
    if len(train) < MIN_TRAIN_RECORDS:
        return []
    first, last = _mean_loss(train[:ENDS]), _mean_loss(train[-ENDS:])
    if first - last >= FLAT_MIN_DROP * abs(first):
        return []
    evidence = (
        f"train loss {first:.4g} at steps {train[0]['step']}-{train[ENDS - 1]['step']}, "
        f"{last:.4g} at steps {train[-ENDS]['step']}-{train[-1]['step']} "
        f"({(last - first) / abs(first):+.1%}, not the -{FLAT_MIN_DROP:.0%} a working loop makes); "
        f"lr peak {max(r['lr'] for r in train):.3g}"
    )
    if all(r["grad_norm"] == 0 for r in train):
        evidence += "; grad_norm 0 at every logged step: no gradient reaches the parameters"
    return [Finding("flat", evidence, train[0]["step"])]


def _train_near(run: Run, step: int) -> float:
    """Mean train loss of the ENDS records up to `step`."""
    before = [r for r in _finite(run.train) if r["step"] <= step][-ENDS:]
    return _mean_loss(before) if before else math.nan


def find_overfitting(run: Run) -> list[Finding]:
    val = _finite(run.val)
    if not val:
        return []
    best_i = min(range(len(val)), key=lambda i: val[i]["loss"])
    best, after = val[best_i], val[best_i + 1 :]
    if len(after) < OVERFIT_MIN_EVALS:
        return []
    rose = _mean_loss(after) > best["loss"] * (1 + OVERFIT_RISE)
    train_then, train_now = _train_near(run, best["step"]), _train_near(run, after[-1]["step"])
    if not (rose and train_now < train_then * (1 - OVERFIT_TRAIN_DROP)):
        return []
    finished, cfg = run.record.get("finished") or {}, run.config
    if finished.get("step", math.inf) < cfg.get("max_steps", 0) and len(after) >= cfg.get("patience", 0) > 0:
        return []  # early stopping caught it, the rules' own remedy, and best holds the best point
    evidence = (
        f"val loss best {best['loss']:.4g} at step {best['step']} (checkpoints/best), "
        f"{after[-1]['loss']:.4g} by step {after[-1]['step']} over {len(after)} validations, "
        f"while train loss fell {train_then:.4g} -> {train_now:.4g}"
    )
    return [Finding("overfitting", evidence, best["step"])]


def find_val_better(run: Run, leak_test: bool) -> list[Finding]:
    leak = leak_share(run) if leak_test else None
    found = []
    if leak is not None and leak[0] > LEAK_MIN_SHARE * leak[1]:
        shared, n_val = leak
        evidence = f"{shared:,} of {n_val:,} validation inputs ({shared / n_val:.1%}) are in train (by hash)"
        found.append(Finding("split-leak", evidence))
    late = [r for r in _finite(run.val) if r["step"] >= run.val[-1]["step"] / 2] if run.val else []
    pairs = [(r, _train_near(run, r["step"])) for r in late]
    better = [(r, t) for r, t in pairs if r["loss"] < t * (1 - VAL_BETTER_MARGIN)]
    if not late or len(better) <= VAL_BETTER_SHARE * len(late):
        return found
    r, t = better[-1]
    dropout = run.config.get("dropout", 0)
    if leak is None:
        why = "leak test not run (the data is not where run.json says)"
    elif leak[0] > LEAK_MIN_SHARE * leak[1]:
        why = "leakage: see split-leak"
    elif dropout:
        return found  # the rules' normal case: dropout is on in training only, and no input is shared
    else:
        why = "no validation input is in train by hash and dropout is off: augmentation in train only?"
    evidence = (
        f"val loss {r['loss']:.4g} against train {t:.4g} at step {r['step']}, "
        f"{len(better)} of {len(late)} late validations {VAL_BETTER_MARGIN:.0%}+ below train; {why}"
    )
    return [*found, Finding("val-better-than-train", evidence, better[0][0]["step"])]


def leak_share(run: Run) -> tuple[int, int] | None:
    """(validation inputs also found in train, validation inputs hashed), or None if the data is gone."""
    from ..config import Config, ConfigError  # the data is read only for this test
    from ..data import DataError, load_splits

    try:
        splits = load_splits(Config(**run.config))
    except (ConfigError, DataError, OSError, TypeError):
        return None

    def hashes(dataset) -> set[bytes]:
        n = min(len(dataset), LEAK_MAX_EXAMPLES)
        return {hashlib.blake2b(dataset[i][0].numpy().tobytes(), digest_size=16).digest() for i in range(n)}

    train, n_val = hashes(splits.train), min(len(splits.val), LEAK_MAX_EXAMPLES)
    val = [hashlib.blake2b(splits.val[i][0].numpy().tobytes(), digest_size=16).digest() for i in range(n_val)]
    return sum(h in train for h in val), n_val


def find_spiky(run: Run) -> list[Finding]:
    train = _finite(run.train)
    if len(train) < MIN_TRAIN_RECORDS:
        return []
    floor = SPIKE_MIN_RISE * abs(_mean_loss(train[:ENDS]))
    spikes = []  # (record, its baseline)
    for i in range(1, len(train)):
        base = statistics.median(r["loss"] for r in train[max(0, i - SPIKE_WINDOW) : i])
        if train[i]["loss"] > base * SPIKE_FACTOR and train[i]["loss"] - base > floor:
            spikes.append((train[i], base))
    if len(spikes) < SPIKE_MIN_COUNT:
        return []
    worst, base = max(spikes, key=lambda s: s[0]["loss"] / s[1])
    warmup = run.config.get("warmup_steps", 0)
    phase = "in warmup" if worst["step"] <= warmup else f"after the {warmup}-step warmup"
    evidence = (
        f"{len(spikes)} spikes over {SPIKE_FACTOR}x the running median of {SPIKE_WINDOW} records; "
        f"largest at step {worst['step']}: loss {worst['loss']:.4g} against {base:.4g}, "
        f"lr {worst['lr']:.3g} ({phase}); first at step {spikes[0][0]['step']}"
    )
    return [Finding("spiky", evidence, spikes[0][0]["step"])]


def find_loader_bound(run: Run) -> list[Finding]:
    found = []
    finished = run.record.get("finished") or {}
    share = finished.get("data_wait_share")
    if share is not None and share > LOADER_BOUND_SHARE:
        evidence = (
            f"its training steps waited for data {share:.0%} of their time "
            f"({finished['examples_per_s']:,.0f} examples/s, num_workers={run.config.get('num_workers')})"
        )
        found.append(Finding("loader-bound", evidence))
    checks = (run.summary or {}).get("checks", {})
    if not found and checks.get("loader") is False:
        evidence = f"check loader failed: {run.summary['loader_share']:.0%} of a step waiting for data"
        found.append(Finding("loader-bound", evidence + f" ({check_summary_path(run.dir)})"))
    return found


def find_schedule(run: Run) -> list[Finding]:
    train, cfg = run.train, run.config
    if len(train) < MIN_TRAIN_RECORDS or "warmup_steps" not in cfg:
        return []
    peak, last = max(r["lr"] for r in train), train[-1]
    if last["step"] < cfg["warmup_steps"]:
        evidence = (
            f"lr {last['lr']:.3g} at the last step {last['step']}, {last['lr'] / cfg.get('lr', peak):.0%} "
            f"of the way up"
            f" a {cfg['warmup_steps']}-step warmup"
        )
        return [Finding("lr-in-warmup", evidence, last["step"])]
    after = [r for r in train if r["step"] > cfg["warmup_steps"]]
    resumed = [r["at_step"] for r in run.record.get("resumed", [])]
    for a, b in itertools.pairwise(after):
        if b["lr"] > a["lr"] * LR_JUMP_FACTOR:
            at = [s for s in resumed if a["step"] <= s < b["step"]]
            why = f" (resumed at step {at[0]}: with another --max-steps?)" if at else ""
            evidence = f"lr rose {a['lr']:.3g} -> {b['lr']:.3g} from step {a['step']} to {b['step']}{why}"
            return [Finding("lr-jump", evidence, b["step"])]
    floor = cfg.get("min_lr", 0.0)
    at_floor = [r for r in train if r["step"] > cfg["warmup_steps"] and r["lr"] <= floor * (1 + 1e-6)]
    if at_floor and (last["step"] - at_floor[0]["step"]) > SCHEDULE_FLOOR_SHARE * last["step"]:
        evidence = (
            f"lr at its floor {floor:.3g} from step {at_floor[0]['step']} to {last['step']} "
            f"({(last['step'] - at_floor[0]['step']) / last['step']:.0%} of the run)"
        )
        return [Finding("schedule-ended-early", evidence, at_floor[0]["step"])]
    return []


def find_clip_pinned(run: Run) -> list[Finding]:
    clip = run.config.get("grad_clip")
    late = [r for r in run.train if r["step"] > run.config.get("warmup_steps", 0)]
    late = [r for r in late if math.isfinite(r["grad_norm"])]
    if clip is None or len(late) < MIN_TRAIN_RECORDS:
        return []
    over = [r for r in late if r["grad_norm"] > clip]
    median = statistics.median(r["grad_norm"] for r in late)
    if len(over) < CLIP_PINNED_SHARE * len(late) or median < CLIP_PINNED_FACTOR * clip:
        return []
    evidence = (
        f"grad_norm over the clip {clip} on {len(over)} of {len(late)} logged steps after warmup "
        f"(median {median:.3g}, from step {over[0]['step']})"
    )
    return [Finding("grad-norm-pinned", evidence, over[0]["step"])]


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
    """The output contract's `**Issues fixed:** <bug -> evidence -> fix>`, one a finding that went away."""
    still = {f.name for f in found_after}
    fix = config_change(before, after)
    return [
        f"**Issues fixed:** {f.name} in {before.dir} -> {f.evidence} -> {fix} (gone in {after.dir})"
        for f in found_before
        if f.name not in still
    ]


def run_diagnose(run_dirs: list[str], as_json: bool = False) -> int:
    """Prints each run's findings (and, for two or more, what changed); exit 1 if any run has one."""
    runs = [load_run(d) for d in run_dirs]
    found = [diagnose(run) for run in runs]
    lines, report = [], {"runs": [], "fixed": [], "new": []}
    for run, findings in zip(runs, found, strict=True):
        lines.append(f"{run.dir}: {len(findings)} finding{'s' * (len(findings) != 1)}")
        lines += [f"  {f.line()}" for f in findings]
        report["runs"].append({"run_dir": str(run.dir), "findings": [vars(f) for f in findings]})
    for i in range(1, len(runs)):
        (a, fa), (b, fb) = (runs[i - 1], found[i - 1]), (runs[i], found[i])
        names_a, names_b = {f.name for f in fa}, {f.name for f in fb}
        new = sorted(names_b - names_a)
        if new:
            lines.append(f"{b.dir} shows what {a.dir} does not: {', '.join(new)}")
        report["new"] += [{"run_dir": str(b.dir), "since": str(a.dir), "name": n} for n in new]
        fixed = issues_fixed(a, fa, b, fb)
        lines += fixed
        report["fixed"] += [
            {"run_dir": str(b.dir), "since": str(a.dir), "name": f.name, "line": line}
            for f, line in zip([f for f in fa if f.name not in names_b], fixed, strict=True)
        ]
    print(json.dumps(report, indent=2) if as_json else "\n".join(lines))
    return 1 if any(found) else 0
