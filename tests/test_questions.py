"""The questionnaire as read from copier.yml, and the machine facts scaffold supplies."""

from __future__ import annotations

import sys

from scaffold import questions


def test_every_form_of_copier_question_is_read(tmp_path):
    (tmp_path / "copier.yml").write_text(
        """\
_subdirectory: project
machine_fact:
  type: str
  default: cpu
  when: false
name:
  type: str
  help: The name
  default: "{{ _copier_conf.dst_path | basename }}"
colour:
  type: str
  choices: [red, green]
  default: red
size:
  type: str
  choices:
    small (fast): s
    large:
      value: l
      validator: "{% if colour == 'red' %}no large red ones{% endif %}"
  default: s
steps: 3
fast: true
"""
    )

    read = questions.load_questions(tmp_path)

    assert list(read) == ["machine_fact", "name", "colour", "size", "steps", "fast"]
    assert read["machine_fact"].hidden
    assert [q.name for q in questions.asked_questions(tmp_path)] == list(read)[1:]
    assert read["name"].help == "The name" and read["name"].flag == "--name"
    assert read["colour"].values == ("red", "green")
    assert read["size"].values == ("s", "l")
    assert read["size"].choices[0].label == "small (fast)"
    assert (read["steps"].type, read["steps"].default) == ("int", 3)
    assert (read["fast"].type, read["fast"].flag) == ("bool", "--fast")


def test_flags_are_the_question_names_with_dashes():
    read = questions.load_questions()

    assert read["project_name"].flag == "--name"
    assert read["grad_accum_steps"].flag == "--grad-accum-steps"


def test_machine_questions_are_hidden_in_copier_yml():
    read = questions.load_questions()

    for name in questions.machine_facts():
        assert read[name].hidden


def test_machine_facts_describe_this_machine():
    import torch

    facts = questions.machine_facts()

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        expected = "mps"
    assert facts["machine_device"] == expected
    assert facts["machine_cuda_precision"] in {"bf16", "fp16"}
    names = facts["unavailable_packages"]
    assert names == sorted(names)
    assert {"os", "json", "torch", "numpy", "copier", "yaml"} <= set(names)
    assert set(sys.stdlib_module_names) <= set(names)
    assert "surely_not_a_module_name" not in names


def test_the_working_directory_does_not_make_names_unavailable(tmp_path, monkeypatch):
    (tmp_path / "my_local_pkg").mkdir()
    (tmp_path / "my_local_pkg" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    questions.machine_facts.cache_clear()
    try:
        assert "my_local_pkg" not in questions.machine_facts()["unavailable_packages"]
    finally:
        questions.machine_facts.cache_clear()


def test_package_name_follows_copier_yml():
    assert questions.package_name("My-Run.v2") == "my_run_v2"


def test_template_is_found_beside_the_package():
    assert (questions.template_dir() / "copier.yml").is_file()
