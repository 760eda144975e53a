"""Tool: diagnose's rules on the loss curves: NaN or Inf, a flat loss, overfitting, validation far
better than train (and the split leak it may come from), spikes. Each threshold below says why."""

import hashlib
import math
import statistics

from .findings import MIN_TRAIN_RECORDS, Finding, Run

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
SKIPPED_MAX_SHARE = 0.05  # fp16 steps the gradient scaler skipped: a few at the start find the scale


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
    if leak is None:
        why = "leak test not run (the data is not where run.json says)"
    elif leak[0] > LEAK_MIN_SHARE * leak[1]:
        why = "leakage: see split-leak"
    elif run.config.get("dropout", 0):
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
    from ..data import DataError
    from ..data_shards import load_splits

    try:
        splits = load_splits(Config(**run.config))
    except (ConfigError, DataError, OSError, TypeError):
        return None

    def hashes(dataset) -> list[bytes]:
        n = min(len(dataset), LEAK_MAX_EXAMPLES)
        return [hashlib.blake2b(dataset[i][0].numpy().tobytes(), digest_size=16).digest() for i in range(n)]

    train, val = set(hashes(splits.train)), hashes(splits.val)
    return sum(h in train for h in val), len(val)


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
