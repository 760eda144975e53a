"""Tool: diagnose's rules on how the loop ran: waiting for data, the learning-rate schedule (a run
ended in warmup, a restarted schedule, one that ended early), gradient clipping that always acts, and
how the run ended (near chance, or stopped early with its loss still high). Each threshold below says why."""

import itertools
import math
import statistics

from ..runtime.records import check_summary_path
from .findings import MIN_TRAIN_RECORDS, Finding, Run

LOADER_BOUND_SHARE = 0.5  # time waiting for data: past half, loading is slower than the step itself
LR_JUMP_FACTOR = 1.5  # after warmup the lr only decays: a rise by half is a restarted schedule
SCHEDULE_FLOOR_SHARE = 0.10  # share of the run spent at the decay's floor: it ended before the run
CLIP_PINNED_SHARE = 0.9  # steps after warmup with the gradient norm over the clip: the clip always acts
# and their median norm 10x the clip: just over costs AdamW little, 10x over the clip is far too low
CLIP_PINNED_FACTOR = 10.0
CHANCE_SHARE = 0.2  # best val accuracy within a fifth of the way from chance (1/classes) to 1
START_SHARE = 0.9  # or best val loss above 90% of the loss before training: next to nothing learnt
EARLY_HIGH_SHARE = 0.5  # an early stop with val loss above half the starting loss stopped a run too soon


def find_loader_bound(run: Run) -> list[Finding]:
    finished = run.record.get("finished") or {}
    share = finished.get("data_wait_share")
    if share is not None and share > LOADER_BOUND_SHARE:
        evidence = (
            f"its training steps waited for data {share:.0%} of their time "
            f"({finished['examples_per_s']:,.0f} examples/s, num_workers={run.config.get('num_workers')})"
        )
        return [Finding("loader-bound", evidence)]
    if (run.summary or {}).get("checks", {}).get("loader") is False:
        evidence = f"check loader failed: {run.summary['loader_share']:.0%} of a step waiting for data"
        return [Finding("loader-bound", evidence + f" ({check_summary_path(run.dir)})")]
    return []


def find_schedule(run: Run) -> list[Finding]:
    train, cfg = run.train, run.config
    if len(train) < MIN_TRAIN_RECORDS or "warmup_steps" not in cfg:
        return []
    peak, last = max(r["lr"] for r in train), train[-1]
    if last["step"] < cfg["warmup_steps"]:
        evidence = (
            f"lr {last['lr']:.3g} at the last step {last['step']}, {last['lr'] / cfg.get('lr', peak):.0%} "
            f"of the way up a {cfg['warmup_steps']}-step warmup"
        )
        return [Finding("lr-in-warmup", evidence, last["step"])]
    resumed = [r["at_step"] for r in run.record.get("resumed", [])]
    for a, b in itertools.pairwise([r for r in train if r["step"] > cfg["warmup_steps"]]):
        if b["lr"] > a["lr"] * LR_JUMP_FACTOR:
            at = [s for s in resumed if a["step"] <= s < b["step"]]
            why = f" (resumed at step {at[0]}: the schedule changed there)" if at else ""
            evidence = f"lr rose {a['lr']:.3g} -> {b['lr']:.3g} from step {a['step']} to {b['step']}{why}"
            return [Finding("lr-jump", evidence, b["step"])]
    floor = cfg.get("min_lr", 0.0)
    at_floor = [r for r in train if r["step"] > cfg["warmup_steps"] and r["lr"] <= floor * (1 + 1e-6)]
    if at_floor and (last["step"] - at_floor[0]["step"]) > SCHEDULE_FLOOR_SHARE * last["step"]:
        evidence = (
            f"lr at its floor {floor:.3g} from step {at_floor[0]['step']} to {last['step']} "
            f"({(last['step'] - at_floor[0]['step']) / last['step']:.0%} of the run)"
        )
        if last["step"] > cfg.get("max_steps", last["step"]):  # run.json keeps the first plan
            evidence += (
                f"; it trained past the {cfg['max_steps']} steps it was planned for: a resume with a"
                " higher --max-steps keeps the decay's plan (a longer decay wants a new --run-dir)"
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


def find_near_chance(run: Run) -> list[Finding]:
    """A run that ended about where it started (val accuracy near chance, or its loss near the loss
    before training: ln C for C classes, else the first logged), or early-stopped with its loss high."""
    val, data = [r for r in run.val if math.isfinite(r["loss"])], run.record.get("data") or {}
    classes = data.get("n_classes") or len(data.get("classes") or ())
    if not val or not (classes > 1 or run.train):
        return []
    first = (run.train[0]["loss"], "the first logged") if run.train else None
    start, source = (math.log(classes), f"ln {classes}") if classes > 1 else first
    best, accuracy = min(val, key=lambda r: r["loss"]), max(r.get("accuracy", -1) for r in val)
    notes = [f"best val loss {best['loss']:.4g} at step {best['step']}, {best['loss'] / start:.0%} of the"]
    notes[0] += f" {start:.4g} before training ({source})"
    if at_chance := classes > 1 and 0 <= accuracy <= 1 / classes + CHANCE_SHARE * (1 - 1 / classes):
        notes.append(f"best val accuracy {accuracy:.3f} against chance {1 / classes:.3f} ({classes} classes)")
    finished, cfg = run.record.get("finished") or {}, run.config
    if early := not finished.get("stopped_by") and finished.get("step", math.inf) < cfg.get("max_steps", 0):
        notes.append(f"early stopping ended it at step {finished['step']} of {cfg['max_steps']}")
    if at_chance or best["loss"] >= START_SHARE * start:
        return [Finding("near-chance", "; ".join(notes), best["step"])]
    if early and best["loss"] >= EARLY_HIGH_SHARE * start:
        return [Finding("stopped-early", "; ".join(notes), finished["step"])]
    return []
