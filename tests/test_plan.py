"""The matrix's plan (scaffold/matrix/plan.py): each answer's declaration held against the
template's renders, and the plan that follows from the declarations."""

import random
from collections import Counter

import pytest

from scaffold.combinations import combination_id, combinations, values, varied_questions
from scaffold.matrix import plan
from scaffold.matrix.files import FileRenderer

DECLARED = plan.declarations()
NOT_BASE = [name for name, answer in DECLARED.items() if not answer.base]


class _Remembering(FileRenderer):
    """A FileRenderer that renders each combination once: the flips share their primaries."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def render(self, answers):
        key = combination_id(answers)
        if key not in self.seen:
            self.seen[key] = super().render(answers)
        return self.seen[key]


@pytest.fixture(scope="module")
def renderer():
    return _Remembering()


def test_every_asked_answer_has_a_declaration():
    assert {q.name for q in varied_questions()} == set(DECLARED)
    for answer in DECLARED.values():
        assert set(answer.reads) <= set(DECLARED) - {answer.name}, answer
        assert answer.proves and set(answer.proves) <= {"all", "resume", "train", "init"}


@pytest.mark.parametrize("name", NOT_BASE)
def test_the_lines_an_answer_adds_depend_only_on_what_it_reads(renderer, name):
    """Flip each answer it does not read, in a few random combinations with it away from its
    primary: the lines it adds stay the same."""
    valid = {combination_id(c): c for c in combinations()}
    primary = plan.primaries()
    choices = {q.name: values(q) for q in varied_questions()}
    others = [k for k in choices if k != name and k not in DECLARED[name].reads]
    rng = random.Random(name)
    away = [c for c in valid.values() if c[name] != primary[name]]
    checked = 0
    for answers in rng.sample(away, 3):
        added = plan.added_lines(renderer, answers, name)
        for other in others:
            value = rng.choice([v for v in choices[other] if v != answers[other]])
            flipped = {**answers, other: value}
            home = {**flipped, name: primary[name]}
            if combination_id(flipped) not in valid or combination_id(home) not in valid:
                continue
            again = plan.added_lines(renderer, flipped, name)
            differ = sorted((added - again) + (again - added))[:4]
            assert not differ, f"{name}'s lines change with {other}={value}: {differ}"
            checked += 1
    assert checked >= len(others)


def test_added_lines_sees_a_line_and_leaves_out_imports(renderer):
    answers = {**combinations()[0], "tracker": "wandb"}
    added = plan.added_lines(renderer, answers, "tracker")
    assert any("wandb" in line for _, line in added)
    assert not any(line.lstrip().startswith(("import ", "from ")) for _, line in added)


def test_each_answer_adds_its_own_primaries():
    counts = plan.counts()
    assert counts["base"] == 5 * 3 * 3  # task x distributed x precision, the base answers
    assert counts["tracker"] == 3 * 3  # each tracker away from none, for each distributed
    assert counts["compile"] == 5 * 3
    # the whole matrix is thousands; its checks are a few hundred
    assert sum(counts.values()) < len(combinations()) / 10


def test_a_combination_two_answers_away_runs_its_help_only_for_a_text_not_loaded_before():
    first = combinations()[0]
    combos = [
        first,
        {**first, "tracker": "wandb"},
        {**first, "device": "cuda"},
        {**first, "tracker": "wandb", "device": "cuda"},
        {**first, "tracker": "mlflow", "device": "cuda"},
    ]
    modules = [frozenset({1}), frozenset({2}), frozenset({3}), frozenset({2, 3}), frozenset({4})]
    kinds = [p.kind for p in plan.plans(combos, modules=modules)]
    assert kinds == ["all", "resume", "resume", "lint", "import"]


def test_a_finetune_primary_trains_and_loads_its_best_checkpoint_but_on_images():
    first = combinations()[0]
    tuned = plan.plans([{**first, "finetune": True}, {**first, "finetune": True, "task": "image"}])
    assert [p.kind for p in tuned] == ["resume+train+init", "resume"]
    assert tuned[0].then_options == {"init_from": f"{plan.INIT_SOURCE}/best.pt"}


def test_full_runs_every_check_everywhere():
    combos = combinations()[:7]
    assert Counter(p.kind for p in plan.plans(combos, full=True)) == {"all": 7}
