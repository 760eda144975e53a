"""Which checks each combination runs, planned from what each answer declares.

Each answer's folder under templates/ holds an `answer.yml`: its `primary` value, the one every
other answer's checks run with (none for a *base* answer: task, distributed, precision), what it
`reads` (the other answers the lines it adds to a render depend on) and what `proves` it (the
checks its own primaries run). tests/test_plan.py renders combinations to hold each declaration:
the lines an answer adds, against the same combination at its primary, are the same wherever the
answers it reads are (import lines aside: see the last rule).

- A *base primary*, every answer with a primary at it, runs `check all`: one for each
  combination of the base answers' values.
- An answer's *primaries* run what it proves: the combinations with it away from its primary, each
  answer it reads at any of its values, and every other answer at its primary (a base answer at
  its first value). So every line an answer adds, in any combination, is a line of one of them.
  By induction over the answers away from their primaries, each line of every combination is a
  line of a base primary's render or of an answer's primary's, and runs there.
- Every other combination runs its `--help` (each module imported, the options built) where a
  module of it renders a text no check loads, as few of them as load every such text (those with
  the most texts not yet loaded first); the rest are rendered and linted only: each of their
  modules' texts is loaded elsewhere, word for word.

With `native_device` each project checks on its own device: the device is then a base answer,
read by every answer (each answer's primaries run on each device).
A slice (`--only`, `--shard`) runs the plans its combinations have; their `--help` is decided among
its own combinations. Adding an answer adds its primaries: the values of what it reads, times its
own values away from the primary (python -m scaffold.matrix.plan prints each answer's count).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import heapq
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from scaffold.combinations import combinations, values, varied_questions
from scaffold.questions import template_dir

CROSS_CHECK = "import"  # not a project check: its `--help`
LINT_ONLY = "lint"  # no check: rendered and linted
SOURCE_TRAIN = "train"  # the project's `train` into SOURCE_RUN, SOURCE_STEPS steps (finetune)
SOURCE_RUN = "runs/matrix-source"
SOURCE_STEPS = 60  # 20 resume-check steps left a classification model's loss above a fresh one's
INIT_SOURCE = f"{SOURCE_RUN}/checkpoints"
# 60 steps at the check sizes teach the 8-wide ResNet nothing to load (validation loss 1.45 against
# ln 4 = 1.39): its finetune primaries skip the train and check init (the other tasks' load it).
UNTRAINED_AT_CHECK_SIZES = ("image",)


@dataclasses.dataclass(frozen=True)
class Answer:
    """An answer's declaration (templates/<folder>/answer.yml)."""

    name: str
    folder: str
    primary: Any  # None for a base answer
    reads: tuple[str, ...]
    proves: tuple[str, ...]

    @property
    def base(self) -> bool:
        return self.primary is None


@functools.cache
def declarations(template: Path | None = None) -> dict[str, Answer]:
    """{answer: its declaration}, from every templates/<folder>/answer.yml."""
    found = {}
    for path in sorted((template or template_dir()).glob("*/answer.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        found[data["answer"]] = Answer(
            name=data["answer"],
            folder=path.parent.name,
            primary=data.get("primary"),
            reads=tuple(data.get("reads", ())),
            proves=tuple(data["proves"]),
        )
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What a combination's check step runs."""

    which: str  # the project's `check` argument; CROSS_CHECK: --help; LINT_ONLY: nothing
    options: dict[str, Any]  # config options beyond the check sizes
    primary: str | None = None  # the answer whose primary this is ("base" for a base primary)
    then: tuple[str, ...] = ()  # checks (or SOURCE_TRAIN) run after `which` passed, in order
    then_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        """What it runs, for counts and tables: `which`, and the checks after it (resume+init)."""
        return "+".join((self.which, *self.then))

    @property
    def label(self) -> str:
        if self.which == CROSS_CHECK:
            return "--help"
        if self.which == LINT_ONLY:
            return "no check (lint only)"
        steps = ", ".join(
            w if w == SOURCE_TRAIN else f"check {w}" for w in (self.which, *self.then)
        )
        return steps + (f" ({self.primary}'s primary)" if self.primary else "")


@functools.cache
def primaries(native_device: bool = False, template: Path | None = None) -> dict[str, Any]:
    """{answer: its primary value}; a base answer's is its first value (the device is base with
    native_device). Worked out once a process (every combination's plan asks): read, not changed."""
    answers = declarations(template)
    first = {q.name: values(q)[0] for q in varied_questions(template)}
    result = {}
    for name, value in first.items():
        answer = answers.get(name)
        base = answer is None or answer.base or (native_device and name == "device")
        result[name] = value if base else answer.primary
    return result


def proving(
    answers: Mapping[str, Any], *, native_device: bool = False, template: Path | None = None
) -> list[str]:
    """The answers whose primary `answers` is ("base" for a base primary), in declaration order."""
    declared = declarations(template)
    primary = primaries(native_device, template)
    away = {k for k, v in answers.items() if k in primary and v != primary[k]}
    bases = {k for k in primary if k not in declared or declared[k].base}
    if native_device:
        bases.add("device")
    away_of_primary = away - bases
    if not away_of_primary:
        return ["base"]
    found = []
    for name in away_of_primary:
        reads = set(declared[name].reads) | ({"device"} if native_device else set())
        if away <= reads | {name}:
            found.append(name)
    return [name for name in declared if name in found]


def _proof_plan(answers: Mapping[str, Any], names: list[str], template: Path | None) -> Plan:
    declared = declarations(template)
    steps: list[str] = []
    for name in names:
        for step in ("all",) if name == "base" else declared[name].proves:
            if step in ("train", "init") and answers.get("task") in UNTRAINED_AT_CHECK_SIZES:
                continue
            if step not in steps:
                steps.append(step)
    if "all" in steps and "resume" in steps:  # check all resumes too
        steps.remove("resume")
    steps.sort(key=lambda s: s not in ("all", "resume"))  # a check first, then train and init
    which, then = steps[0], tuple(SOURCE_TRAIN if s == "train" else s for s in steps[1:])
    then_options = {}
    if "init" in then:
        best = "best" if answers.get("distributed") == "fsdp" else "best.pt"
        then_options = {"init_from": f"{INIT_SOURCE}/{best}"}
    return Plan(
        which=which,
        options={},
        primary=" and ".join(names),
        then=then,
        then_options=then_options,
    )


def plans(
    combos: Sequence[dict[str, Any]],
    *,
    native_device: bool = False,
    full: bool = False,
    modules: Sequence[frozenset[int]] | None = None,
    template: Path | None = None,
) -> list[Plan]:
    """Each combination's plan (see the module's note). `modules`: for each combination, the ids
    of its modules' rendered texts (scaffold.matrix.files); without them, every combination that
    is no primary runs its --help."""
    if full:
        return [_proof_plan(c, ["base"], template) for c in combos]
    result: list[Plan | None] = []
    loaded: set[int] = set()
    for i, answers in enumerate(combos):
        names = proving(answers, native_device=native_device, template=template)
        if names:
            result.append(_proof_plan(answers, names, template))
            loaded |= modules[i] if modules is not None else set()
        else:
            result.append(None)
    rest = [i for i, plan in enumerate(result) if plan is None]
    if modules is None:
        helps = set(rest)
    else:  # the fewest --helps that load every text: the most texts not yet loaded first
        helps = set()
        queue = [(-len(modules[i] - loaded), i) for i in rest]
        heapq.heapify(queue)
        while queue and queue[0][0] < 0:
            _, i = heapq.heappop(queue)
            gain = len(modules[i] - loaded)
            if queue and gain < -queue[0][0]:  # stale: back in with what it adds now
                heapq.heappush(queue, (-gain, i))
                continue
            if gain:
                helps.add(i)
                loaded |= modules[i]
    for i in rest:
        result[i] = Plan(which=CROSS_CHECK if i in helps else LINT_ONLY, options={})
    return [plan for plan in result if plan is not None]


def added_lines(renderer: Any, answers: dict[str, Any], name: str) -> Counter[tuple[str, str]]:
    """The lines (file, line) that `answers` renders and the same combination with `name` at its
    primary does not, import statements aside (every module's text is loaded by some plan)."""
    away = renderer.render(answers)
    home = renderer.render({**answers, name: primaries(template=renderer.template)[name]})
    found: Counter[tuple[str, str]] = Counter()
    for path, text in away.items():
        left = Counter(_lines(path, home.get(path, "")))
        for line in _lines(path, text):
            if left[line] > 0:
                left[line] -= 1
            else:
                found[(path, line)] += 1
    return found


def _lines(path: str, text: str) -> list[str]:
    lines = text.splitlines()
    if path.endswith(".py"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return lines
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for n in range(node.lineno - 1, node.end_lineno or node.lineno):
                    lines[n] = ""
    return [line for line in lines if line.strip()]


def counts(native_device: bool = False, template: Path | None = None) -> dict[str, int]:
    """{answer: how many primaries it has} over every valid combination."""
    found: Counter[str] = Counter()
    for answers in combinations(template):
        for name in proving(answers, native_device=native_device, template=template):
            found[name] += 1
    return dict(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaffold.matrix.plan", description=__doc__)
    parser.add_argument("--native-device", action="store_true")
    args = parser.parse_args(argv)
    declared = declarations()
    for name, n in counts(args.native_device).items():
        answer = declared.get(name)
        proves = "all" if answer is None else "+".join(answer.proves)
        reads = "" if answer is None else f", reads {', '.join(answer.reads) or 'nothing'}"
        print(f"{name}: {n} primaries ({proves}{reads})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
