"""The render budget and the answers' spread (scaffold/budget.py), held on the golden renders,
which tests/test_golden.py keeps equal to a fresh render."""

from pathlib import Path

import pytest

from scaffold import budget
from scaffold.combinations import varied_questions
from scaffold.questions import template_dir

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"  # this checkout's, installed or not


def test_the_default_render_stays_within_its_budget():
    lines = budget.measure_render("default", GOLDEN_DIR / "default").src_lines
    assert lines <= budget.BUDGET_LINES, f"default src/ is {lines} lines"


@pytest.mark.parametrize("name", ["default", "everything"])
def test_the_loop_file_holds_the_step_and_stays_short(name):
    render = budget.measure_render(name, GOLDEN_DIR / name)
    assert render.train_py <= budget.TRAIN_PY_LINES
    assert {"train_step", "evaluate", "run_steps", "train"} <= set(render.train_py_defs)


def test_spread_counts_a_tag_in_text_or_path_and_a_conditional_folder_once(tmp_path):
    (tmp_path / "project" / "{% if device == 'cuda' %}gpu{% endif %}").mkdir(parents=True)
    (tmp_path / "project" / "{% if device == 'cuda' %}gpu{% endif %}" / "a.sh.jinja").write_text("")
    (tmp_path / "project" / "{% if device == 'cuda' %}gpu{% endif %}" / "b.sh.jinja").write_text("")
    (tmp_path / "project" / "tagged.py.jinja").write_text('x = 1\n{% if device != "cpu" %}\n')
    (tmp_path / "project" / "inline.py.jinja").write_text(
        '{{ "a" if device in ["cuda"] else "b" }}\n'
    )
    (tmp_path / "project" / "plain.py.jinja").write_text("device = 'cpu'  # not a tag\n")
    (tmp_path / "device").mkdir()  # an answer's own folder: testing it is its job
    (tmp_path / "device" / "cuda.py.jinja").write_text('{% if device == "cuda" %}{% endif %}\n')

    found = budget.spread(tmp_path, "device")

    assert found == [
        "project/inline.py.jinja",
        "project/tagged.py.jinja",
        "project/{% if device == 'cuda' %}gpu{% endif %}/",
    ]
    assert budget.spread(tmp_path, "precision") == []


def test_spread_counts_an_answer_joined_to_a_condition(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "a.py.jinja").write_text('{% if streaming and task != "x" %}\n')
    (tmp_path / "tasks" / "b.py.jinja").write_text("{{ 'a' if finetune else 'b' }}\n")
    (tmp_path / "tasks" / "c.py.jinja").write_text('{% include finetune_dir ~ "c.py.jinja" %}\n')
    (tmp_path / "tasks" / "d.md.jinja").write_text(
        '{{ {"fp16": " a scaler,"}.get(precision, "") }}\n'
    )

    assert budget.spread(tmp_path, "streaming") == ["tasks/a.py.jinja"]
    assert budget.spread(tmp_path, "finetune") == ["tasks/b.py.jinja"]  # a seam tests nothing
    assert budget.spread(tmp_path, "precision") == ["tasks/d.md.jinja"]  # a lookup does


def test_every_answer_declares_its_aim():
    assert {q.name for q in varied_questions()} == set(budget.SPREAD_AIMS)


@pytest.mark.parametrize("answer", sorted(budget.SPREAD_AIMS))
def test_each_answer_stays_in_its_folder(answer):
    files = budget.spread(template_dir(), answer)
    assert len(files) <= budget.SPREAD_AIMS[answer], files


def test_the_step_tests_precision_at_most_twice():
    train = next(template_dir().glob("project/src/*/train.py.jinja"))
    assert budget.tests_in(train, "precision") <= budget.TRAIN_PRECISION_TESTS


def test_no_inline_expression_carries_a_statement_or_a_comment(tmp_path):
    (tmp_path / "a.py.jinja").write_text('{{ "return x  # done" if a else "pass" }}\n')
    (tmp_path / "b.py.jinja").write_text('{{ "x" if a else "y" }}\n')
    assert budget.inline_statements(tmp_path) == ["a.py.jinja:1"]
    assert budget.inline_statements(template_dir()) == []


def test_the_template_holds_at_most_its_tags():
    assert budget.total_tags(template_dir()) <= budget.TAGS_TOTAL


def test_no_template_holds_more_than_a_few_dozen_tags():
    count, path = budget.most_tags(template_dir())
    assert count <= budget.TAGS_AIM, path
