"""The committed golden renders (tests/golden/) match a fresh render byte for byte.

When the template changes on purpose: `python -m scaffold.golden --refresh`, then commit
tests/golden/ with the change, so that reviewers read the rendered difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scaffold.golden import differences, golden_answers, render_goldens

# This checkout's goldens, also when scaffold is installed from it (not editable) as CI does.
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def test_goldens_are_the_default_and_everything_on_combinations():
    goldens = golden_answers()
    assert goldens["default"]["task"] == "classification"
    assert goldens["default"]["compile"] is False
    everything = goldens["everything"]
    assert everything["compile"] is True and everything["grad_accum_steps"] > 1
    assert everything["precision"] == "fp16" and everything["tracker"] != "none"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return render_goldens(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", sorted(golden_answers()))
def test_golden_render_matches_a_fresh_render(name, fresh):
    assert (GOLDEN_DIR / name).is_dir(), "run `python -m scaffold.golden --refresh`"
    assert differences(GOLDEN_DIR / name, fresh[name]) == [], (
        "the template changed: run `python -m scaffold.golden --refresh` and commit tests/golden/"
    )


def test_differences_names_each_changed_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "same.py").write_text("x = 1\n")
    (tmp_path / "b" / "same.py").write_text("x = 1\n")
    (tmp_path / "a" / "changed.py").write_text("x = 1\n")
    (tmp_path / "b" / "changed.py").write_text("x = 2\n")
    (tmp_path / "a" / "gone.py").write_text("")
    (tmp_path / "b" / "new.py").write_text("")

    assert differences(tmp_path / "a", tmp_path / "b") == [
        "missing gone.py",
        "extra new.py",
        "differs changed.py",
    ]
