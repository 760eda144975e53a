"""The valid combinations are asked of copier once, kept in the cache folder by the content of
copier.yml, and are what copier's own questionnaire accepts."""

from __future__ import annotations

import shutil

import pytest

from scaffold import _compat
from scaffold import combinations as combos_module
from scaffold.combinations import all_combinations, combinations
from scaffold.questions import template_dir


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder and no combinations kept in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SCAFFOLD_NO_CACHE", raising=False)
    monkeypatch.setattr(combos_module, "_COMBINATIONS", {})
    return tmp_path / "cache" / "scaffold" / "combinations"


def test_the_combinations_are_stored_and_read_back_without_asking_copier(fresh_cache, monkeypatch):
    first = combinations()
    (stored,) = fresh_cache.glob("*.json")

    monkeypatch.setattr(combos_module, "_COMBINATIONS", {})
    monkeypatch.setattr(_compat, "answer_validator", _never_called)
    assert combinations() == first
    assert stored.stat().st_size > 0


def test_a_damaged_cache_entry_is_asked_again(fresh_cache, monkeypatch):
    first = combinations()
    (stored,) = fresh_cache.glob("*.json")
    stored.write_text('[{"task": "classif')  # cut off mid-write by something else
    monkeypatch.setattr(combos_module, "_COMBINATIONS", {})

    assert combinations() == first
    assert stored.read_text().startswith('[{"task": "classification"')


def test_a_changed_copier_yml_is_asked_again(fresh_cache, tmp_path):
    """The entry is named by copier.yml's bytes: a new validator changes the answer at once."""
    template = tmp_path / "template"
    shutil.copytree(template_dir(), template)
    before = combinations(template)
    copier_yml = template / "copier.yml"
    text = copier_yml.read_text()
    question = "compile:\n  type: bool\n"
    assert question in text
    rule = (
        '  validator: "{% if compile and grad_accum_steps > 1 %}not with accumulation{% endif %}"\n'
    )
    copier_yml.write_text(text.replace(question, question + rule))

    after = combinations(template)

    assert len(list(fresh_cache.glob("*.json"))) == 2
    assert after == [c for c in before if not (c["compile"] and c["grad_accum_steps"] > 1)]
    assert len(after) < len(before)


def test_the_kept_answer_is_what_copiers_questionnaire_says(monkeypatch):
    """The hidden questions' defaults, given as answers to save time, change no verdict: every
    20th combination and the refused ones at every 4th place (a quarter of the 1,920, all refused by
    one rule: mps runs no ddp or fsdp), asked of the questionnaire with nothing added."""
    validate = _compat.answer_validator(template_dir())
    valid = {tuple(c.items()) for c in combinations()}
    every = all_combinations()
    sample = [
        c
        for i, c in enumerate(every)
        if i % 20 == 0 or (i % 4 == 1 and tuple(c.items()) not in valid)
    ]
    assert len(sample) > 100 and any(tuple(c.items()) not in valid for c in sample)

    for answers in sample:
        assert (validate(answers) is None) == (tuple(answers.items()) in valid), answers


def _never_called(template):
    raise AssertionError("copier's questionnaire was asked although the cache held the answer")
