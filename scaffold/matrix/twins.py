"""Which checks each combination gets: every check, or, for a twin, the checks of what differs.

Two answers change code that the matrix's checks cannot tell apart from their primary's:

- `device`: on a machine without the device (CI's CPU runners), a cuda or mps project is checked
  with `--device cpu`, and then runs the cpu project's code line for line, but for a few lines
  about the device (TF32 and cuBLAS settings, the GPU's RNG and name in the run record);
- `tracker`: the tracker only reads the run's records; it never touches the model, the batches,
  the optimizer or the random streams (the resume check's bit-for-bit comparison proves that).

A combination that differs from another only in these is its *twin*; the other, with tracker none
and the checking device, is its *primary* and gets `check all`. The twin is rendered and linted
like any combination, then runs `check resume` only: a run, a crash after a checkpoint and a
resume, bit for bit, with its tracker logging and its device lines executing. What `check all`
adds (overfit, batch, init, loader) tests the model, the loss, the optimizer step and the loader,
whose code the twin shares with its primary; the compiled graphs are the primary's too, so a
compile twin's resume runs without torch.compile.

A twin that differs from its primary in both (a tracker, on another device) is covered twice
over: its tracker's lines run in the resume check of its twin on the checking device, its device's
lines in the resume check of its twin with no tracker, and each rendered line of it is in one of
those two (the tracker's templates do not depend on the device; where train.py and the run record
do, the two conditions are separate blocks). Such a *cross* runs no check of its own after the
lint that every combination gets: its project's `python -m <pkg> --help` only, which imports every
module the command line loads (the tracker's library too) and builds the config's arguments, so a
render whose modules do not load together fails. It had run `check init` (its data and model built,
their first losses taken): 1,230 of them took 21 of the matrix's 92 job-minutes in CI, for lines
its halves run. Counted on the 1,680 finetune-false combinations: crosses are 720 of the 1,500
twins, 180 of them ddp, whose resume check is the dearest twin's; with the fsdp twins below, 960.

An fsdp twin is a cross too when its ddp *sibling* (the same answers with ddp) is in the run.
fsdp and ddp renders share their tracker and device lines (rank 0's run log and tracker, the
GPU's backend and RNG in distributed.py and checkpoint.py), which the sibling's resume check
runs; what fsdp renders apart from ddp (the sharding, its checkpoint folders) does not depend on
the tracker or the device the checks run on, and its primary's `check all` resumes it.

A compile twin is a cross too when the same twin without compile is in the run. A twin's resume
check runs without torch.compile (the primary proved the compiled graphs), so the two would run
the same lines: the compile twin's own rendering adds only what `--compile` switches on, which
its primary's `check all` runs. Counted on the 1,680 finetune-false combinations: this halves the
resume checks, 540 to 270.

A twin whose primary is not in the same run (a `--only` slice without it) gets every check; a
cross whose two halves are not both in it, or an fsdp twin without its sibling, gets the resume
check.

The `finetune` answer doubles the matrix (1,680 to 3,360), but a finetune combination renders its
finetune-false twin's lines and the finetune blocks (`--init-from` loading, freezing, EMA), and
those read task, distributed, precision and compile, never the tracker, the device or the
accumulation (tests/test_twins.py reads every template's finetune blocks for it). The twin's plan
runs its lines; a *finetune primary* (tracker none, the checking device, and accumulation 1: the
cheapest steps) runs the finetune blocks of its family, every other finetune combination the same
ones. It runs `check resume`, which in a finetune render trains with EMA on and a freeze lifted
across the interruption, bit for bit, compiled where the answer is (a primary, not a twin), then
`train` 60 steps at the check sizes and `check init --init-from` the best checkpoint that run
kept: the weights loaded, and their validation loss against a fresh model's (weights that do not
start below it fail; the resume check's own 20 steps do not, see SOURCE_TRAIN; the image
task's primaries skip both, see UNTRAINED_AT_CHECK_SIZES). Overfit, batch
and loader, which test the model, the loss and the loader the two share, run in the twin's family
already.
Of the other finetune combinations, one that differs from its finetune primary in one of tracker,
device and accumulation runs its `--help`: its modules, where a tracker's (or the device's, or
the accumulation's) blocks meet the finetune blocks, load together and build the config's
options (a clash there is not a lint finding: a dataclass field twice, an option twice). One that
differs in two or three only renders and lints: each pair of its blocks meets in one of those or
in its finetune-false twin's plan. Counted on the 3,360 streaming-false combinations (the
streaming ones: below): 90 finetune primaries, 480 `--help`,
1,110 lint only; the finetune-false half's plans are the 1,680's, but for the finetune-false
primaries below. A family (what a shard keeps together) therefore spans the accumulation and
finetune too: 90 families of 32 or 48.

The finetune primary takes its finetune-false twin's `check all` too (then runs the train and
`check init` as above), and that twin, the *finetune-false primary* (the same answers with
finetune false), runs its `--help` only, where (a) its task's model is the same code in both
renders (classification, regression, custom), and (b) a twin of it that differs in the tracker
only runs `check resume` in the run, or, for a compile primary, such a twin of the same primary
without compile (its own tracker twins are then crosses: a twin's resume check runs without
torch.compile, so the uncompiled twin's resume runs their lines; tests/test_twins.py reads every
template's finetune-false branches and finds they read no answer, compile neither).

A finetune render is not literally the finetune-false render plus the finetune blocks: the
`{% else %}` of finetune, and `... if finetune else ...`, leave the false render lines of its own.
Rendered both ways and diffed (every task and distributed, compile on), they are, with what runs
them under this plan:
- optim.py's `build_optimizer`: weight matrices decayed, biases and gains not. The finetune one
  splits the same two groups into the head's and the body's, at the same learning rate unless
  `--init-from` is given, so `check all`'s overfit steps the finetune render's optimizer exactly as
  the false one's (AdamW is per parameter); the false function itself trains in (b)'s resume check.
- train.py's validation call (the finetune one validates the `--ema` average, off by default) and
  tools/resume_check.py's comparison of the model and optimizer (the finetune one adds the
  average): (b)'s resume check runs both, a train, a crash and a resume, compared bit for bit.
- under fsdp, checkpoint.py's sharded keys and distributed.py's `set_state_dict` call (the
  finetune ones carry the average): (b)'s resume check, an fsdp render's. But an fsdp family's
  tracker twins are crosses where the ddp sibling is in the run, so there (b) fails and the false
  primary keeps its `check all` (a shard without the sibling resumes them, and hands it over).
- image's and generation's model.py (a model of their own; the finetune one takes a published
  layout, torchvision's ResNet-18 or GPT-2), generation's prepare.py and tokenizer option, their
  config's construction: overfit, batch and init test the model, and only the false primary's
  `check all` runs them on the false one, so (a) keeps it for those two tasks.
- checkpoint.py's export, predict.py's and sample.py's load, tools/tune.py's sweep: no check runs
  them under either plan, so this one loses nothing there.

What `check all` adds to the resume check, overfit, batch, init and loader, is tools/checks.py
(no false-only line: the same file in both renders but for finetune blocks) on the model, the
loss, the optimizer step and the loader, which in (a)'s tasks the two renders share line for line;
(b)'s resume check runs the rest of the false render, its tracker's lines too; with compile, the
finetune primary's `check all` runs the compiled graphs of the model both renders share. So each
such family runs one resume check fewer (the false primary's; the finetune primary's check all
includes its own). Counted on the 3,360 streaming-false combinations: 36 families
(classification, regression and custom; none and ddp; the 3 precisions; compile or not): 144
`check all` in the false half (of 180), and 36 finetune primaries run `check all` then the train
and init, 54 `check resume` then them.

Where a finetune combination's primary or its finetune-false twin is not in the run, the finetune
half follows the rules above by itself, each `check all` followed by the train and `check init`.

The `streaming` answer doubles the matrix again (3,360 to 6,720). A streaming render is its
streaming-false twin's lines and the streaming blocks (`prepare` writing shards, `train --data`
streaming them through a bounded cache, their order, the fetch and its retries), which read the
task and the distributed answer, never the tracker, the device, the precision, compile, finetune
or the accumulation (tests/test_twins.py reads every template's streaming blocks for it). So one
*streaming primary* a task and distributed answer (STREAMING_PRIMARY: tracker none, the checking
device, fp32, no compile, no finetune, accumulation 1, the cheapest steps) runs them: its
`prepare` writes the task's data (the synthetic data; generation's the runner's corpus) as small
shards to a local folder, then `check all --data` that folder streams them (scaffold.matrix.runner:
SHARDS). A streaming combination one answer away from it runs its `--help`: that answer's blocks
and the streaming blocks, where they meet in one module, load together and build the config's
options. The rest are rendered and linted only: each pair of their blocks meets in one of those
or in their streaming-false twin, whose plan is the one above, unchanged by the streaming half.
Counted on the 3,360 streaming combinations: 15 streaming primaries, 140 `--help`, 3,205 lint
only. A streaming family is a task and a distributed answer (192 or 288 combinations), so a shard
holds each of its streaming combinations' primary. Where the streaming primary is not in the run
(a `--only` slice without it), the streaming half follows the rules above within itself, each
check on shards the combination prepared. A run of the streaming half alone (`--only
streaming=yes`) runs its primaries and `--help`s but lints the rest only: their other lines are
their streaming-false twins', not in that run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from scaffold.combinations import combination_id

# The answers a twin differs in from its primary, and the primary's value of each (the device's
# is the device the checks run on).
TWIN_ANSWERS = ("tracker", "device")
PRIMARY_TRACKER = "none"
TWIN_CHECK = "resume"
CROSS_CHECK = "import"  # not a project check: its `--help` (see above)
LINT_ONLY = "lint"  # no check at all: rendered and linted (a finetune combination, see above)

# A finetune combination's primary: tracker none, the checking device, and no accumulation; the
# checks its finetune lines need (`check resume` runs EMA and a freeze lifted mid-run there), then
# `check init` from the best checkpoint of a short `train` (SOURCE_TRAIN, not a check). The resume
# check's own checkpoints do not do: its 20 steps, in their warmup, left a classification model's
# validation loss at 1.304 against a fresh model's 1.298, which check init rightly fails; 60 steps
# of `train` at the check sizes took it to 0.996 (6 s).
FINETUNE_ANSWERS = (*TWIN_ANSWERS, "grad_accum_steps")
FINETUNE_PRIMARY_ACCUMULATION = 1
SOURCE_TRAIN = "train"  # the project's `train` into SOURCE_RUN, SOURCE_STEPS steps
SOURCE_RUN = "runs/matrix-source"
SOURCE_STEPS = 60
FINETUNE_CHECKS = ("resume", SOURCE_TRAIN, "init")
# Tasks whose 60 steps at the check sizes teach the model nothing to load: the image ResNet, 8
# wide over 16-pixel synthetic images, was at validation loss 1.45 (4 classes, ln 4 = 1.39) after
# them, so check init rightly failed its weights (measured, image fsdp). Their finetune primary
# runs the resume check alone; --init-from's load is the other tasks' (the same weights.py and
# distributed.py lines: only model.py differs) and tests/test_finetune_layouts.py's.
UNTRAINED_AT_CHECK_SIZES = ("image",)


def _source_checks(answers: dict[str, Any]) -> tuple[str, ...]:
    """What a finetune primary runs after its first check: a source's train and check init."""
    return () if answers.get("task") in UNTRAINED_AT_CHECK_SIZES else FINETUNE_CHECKS[1:]


# The tasks whose finetune-false render has a model of its own: model.py's `{% else %}` of
# finetune (the finetune render's model takes a published layout, torchvision's ResNet-18 or
# Hugging Face's GPT-2), so overfit, batch and init on the finetune model do not test it.
OWN_FALSE_MODEL = ("image", "generation")
INIT_SOURCE = f"{SOURCE_RUN}/checkpoints"  # under the project, after SOURCE_TRAIN


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What a combination's check step runs."""

    which: str  # the project's `check` argument: "all", TWIN_CHECK for a twin; CROSS_CHECK: --help
    options: dict[str, Any]  # config options beyond the check sizes (a twin's --no-compile)
    primary: str | None = None  # the combination whose `check all` covers the rest, for a twin
    then: tuple[str, ...] = ()  # checks (or SOURCE_TRAIN) run after `which` passed, in order
    then_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # those checks', beyond

    @property
    def kind(self) -> str:
        """What it runs, for counts and tables: `which`, and the checks after it (resume+init)."""
        return "+".join((self.which, *self.then))

    @property
    def label(self) -> str:
        if self.which == CROSS_CHECK:
            step = "--help"
        elif self.which == LINT_ONLY:
            step = "no check (lint only)"
        else:
            step = ", ".join(
                which if which == SOURCE_TRAIN else f"check {which}"
                for which in (self.which, *self.then)
            )
        return step + (f" (twin of {self.primary})" if self.primary else "")


def primary_of(answers: dict[str, Any], *, native_device: bool) -> dict[str, Any]:
    """The combination whose full checks cover `answers`': tracker none, and the device the checks
    run on (the project's own with native_device, else the CPU)."""
    primary = dict(answers)
    if "tracker" in primary:
        primary["tracker"] = PRIMARY_TRACKER
    if "device" in primary and not native_device:
        primary["device"] = "cpu"
    return primary


def finetune_primary_of(answers: dict[str, Any], *, native_device: bool) -> dict[str, Any]:
    """The finetune combination whose checks run the finetune lines of `answers`': its primary
    (see primary_of), without accumulation."""
    primary = primary_of(answers, native_device=native_device)
    if "grad_accum_steps" in primary:
        primary["grad_accum_steps"] = FINETUNE_PRIMARY_ACCUMULATION
    return primary


# The answers a family leaves out: a finetune combination's primary differs from it in these (the
# accumulation too), and its finetune-false twin in finetune.
FAMILY_LEAVES_OUT = (*FINETUNE_ANSWERS, "finetune")


def family(answers: dict[str, Any]) -> str:
    """The answers twins share with their primary: one family is checked together (a shard holds
    whole families, so each twin's primary runs beside it, and each finetune combination its
    finetune primary and its finetune-false twin; each streaming combination its streaming
    primary: a streaming family is a task and a distributed answer)."""
    if answers.get("streaming"):
        return combination_id({k: v for k, v in answers.items() if k in STREAMING_FAMILY})
    return combination_id({k: v for k, v in answers.items() if k not in FAMILY_LEAVES_OUT})


def plans(
    combos: Sequence[dict[str, Any]], *, native_device: bool = False, full: bool = False
) -> list[Plan]:
    """Each combination's plan: `check all` for primaries, for twins whose primary is not among
    `combos`, and for everything with `full`; `check resume` for the other twins; for finetune
    combinations, see the module's note (`check init` from trained weights after check all)."""
    present = {combination_id(c) for c in combos}
    resumed = set() if full else _resumed(combos, present, native_device=native_device)
    result = []
    for answers in combos:
        plan = None
        if not full:
            plan = _streaming_plan(answers, present, native_device=native_device)
            plan = plan or _finetune_plan(answers, present, resumed, native_device=native_device)
        result.append(plan or _plan(answers, present, native_device=native_device, full=full))
    return result


def _resumed(
    combos: Sequence[dict[str, Any]], present: set[str], *, native_device: bool
) -> set[str]:
    """The primaries with a twin in the run that differs from them in the tracker only and runs
    `check resume` (a twin that is no cross): every line of the primary's render trains there; and
    the same primaries with compile (whose compile twins resume without it, the same lines)."""
    resumed = set()
    for answers in combos:
        primary_answers = primary_of(answers, native_device=native_device)
        differs = [k for k in TWIN_ANSWERS if answers.get(k) != primary_answers.get(k)]
        if differs != ["tracker"]:
            continue
        if _plan(answers, present, native_device=native_device, full=False).which == TWIN_CHECK:
            resumed.add(combination_id(primary_answers))
            if answers.get("compile") is False:  # a compile twin would resume the same lines
                resumed.add(combination_id({**primary_answers, "compile": True}))
    return resumed


def _hands_over(answers: dict[str, Any], present: set[str], resumed: set[str]) -> bool:
    """Whether a finetune-false primary leaves its `check all` to its finetune twin, the finetune
    primary, and runs its `--help` (see the module's note)."""
    return (
        "finetune" in answers
        and not answers["finetune"]
        and answers.get("task") not in OWN_FALSE_MODEL
        and answers.get("grad_accum_steps", 1) == FINETUNE_PRIMARY_ACCUMULATION
        and combination_id(answers) in resumed
        and combination_id({**answers, "finetune": True}) in present
    )


def _plan(answers: dict[str, Any], present: set[str], *, native_device: bool, full: bool) -> Plan:
    """A primary's, a twin's or a cross's plan (a finetune combination's too, where its finetune
    primary or its finetune-false twin is not in the run: then the train and check init follow)."""
    primary_answers = primary_of(answers, native_device=native_device)
    primary = combination_id(primary_answers)
    if full or primary == combination_id(answers) or primary not in present:
        if answers.get("finetune"):
            then = _source_checks(answers)
            return Plan(
                which="all", options={}, then=then, then_options=_init_from(answers) if then else {}
            )
        return Plan(which="all", options={})
    options = {"no_compile": None} if answers.get("compile") else {}
    halves = _halves(answers, primary_answers)
    cross = len(halves) == 2 and all(combination_id(h) in present for h in halves)
    sibling = combination_id({**answers, "distributed": "ddp"})  # see the module's note on fsdp
    cross = cross or (answers.get("distributed") == "fsdp" and sibling in present)
    cross = cross or (bool(answers.get("compile")) and _uncompiled(answers) in present)
    which = CROSS_CHECK if cross else TWIN_CHECK
    return Plan(which=which, options=options, primary=primary)


def _finetune_plan(
    answers: dict[str, Any], present: set[str], resumed: set[str], *, native_device: bool
) -> Plan | None:
    """A finetune combination's plan where both its finetune primary and its finetune-false twin
    are in the run (else None): the primary's resume (or all, see _hands_over) and init checks;
    --help for a combination that differs from it in one of tracker, device and accumulation;
    lint only for the rest. And --help for a finetune-false primary that hands over check all."""
    if not answers.get("finetune"):
        if _hands_over(answers, present, resumed):
            finetune = combination_id({**answers, "finetune": True})
            return Plan(which=CROSS_CHECK, options={}, primary=finetune)
        return None
    primary_answers = finetune_primary_of(answers, native_device=native_device)
    primary = combination_id(primary_answers)
    twin = combination_id({**answers, "finetune": False})
    if primary not in present or twin not in present:
        return None
    if primary == combination_id(answers):
        first, then = FINETUNE_CHECKS[0], _source_checks(answers)
        if _hands_over({**answers, "finetune": False}, present, resumed):
            first = "all"  # its finetune-false twin's check all, which then runs --help
        return Plan(
            which=first,
            options={},
            then=tuple(then),
            then_options=_init_from(answers) if then else {},
        )
    differs = [k for k in FINETUNE_ANSWERS if answers.get(k) != primary_answers.get(k)]
    which = CROSS_CHECK if len(differs) == 1 else LINT_ONLY
    return Plan(which=which, options={}, primary=primary)


# A streaming combination's primary: one a task and distributed answer, with the cheapest of the
# other answers (tracker none, the checking device, fp32, no compile, no finetune, no
# accumulation). It writes its data as shards (`prepare --out`, scaffold.matrix.runner) and runs
# `check all` streaming them; see the module's note.
STREAMING_PRIMARY = {
    "tracker": PRIMARY_TRACKER,
    "precision": "fp32",
    "compile": False,
    "finetune": False,
    "grad_accum_steps": 1,
}
STREAMING_FAMILY = ("task", "distributed", "streaming")


def streaming_primary_of(answers: dict[str, Any], *, native_device: bool) -> dict[str, Any]:
    """The streaming combination whose checks stream the data of `answers`' task and distributed
    answer (see STREAMING_PRIMARY; the device as in primary_of)."""
    primary = primary_of(answers, native_device=native_device)
    primary.update({k: v for k, v in STREAMING_PRIMARY.items() if k in primary})
    return primary


def _streaming_plan(
    answers: dict[str, Any], present: set[str], *, native_device: bool
) -> Plan | None:
    """A streaming combination's plan where its streaming primary is in the run (else None: the
    other rules, within the streaming half): the primary's `check all` on shards it prepared;
    --help one answer away from it; lint only for the rest."""
    if not answers.get("streaming"):
        return None
    primary_answers = streaming_primary_of(answers, native_device=native_device)
    primary = combination_id(primary_answers)
    if primary not in present:
        return None
    if primary == combination_id(answers):
        return Plan(which="all", options={})
    differs = [k for k in answers if answers[k] != primary_answers[k]]
    which = CROSS_CHECK if len(differs) == 1 else LINT_ONLY
    return Plan(which=which, options={}, primary=primary)


def _init_from(answers: dict[str, Any]) -> dict[str, Any]:
    """`check init`'s --init-from: the best checkpoint SOURCE_TRAIN kept (a folder of shards under
    fsdp); none where no source is trained."""
    if not _source_checks(answers):
        return {}
    best = "best" if answers.get("distributed") == "fsdp" else "best.pt"
    return {"init_from": f"{INIT_SOURCE}/{best}"}


def _uncompiled(answers: dict[str, Any]) -> str:
    """The name of the same combination without compile (see the module's note on compile)."""
    return combination_id({**answers, "compile": False})


def _halves(answers: dict[str, Any], primary: dict[str, Any]) -> list[dict[str, Any]]:
    """The twins between `answers` and its `primary` that differ from the primary in one answer
    each (none when `answers` differs in one only)."""
    differs = [k for k in TWIN_ANSWERS if answers.get(k) != primary.get(k)]
    if len(differs) < 2:
        return []
    return [{**primary, k: answers[k]} for k in differs]
