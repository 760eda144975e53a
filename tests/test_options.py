"""`scaffold options` lists what copier.yml asks."""

from __future__ import annotations

from scaffold.machine import accelerator
from scaffold.questions import asked_questions, machine_facts


def blocks(listing: str) -> dict[str, str]:
    """Each question's block of `scaffold options` output: a heading line, then indented ones."""
    found: dict[str, str] = {}
    for line in listing.splitlines():
        if not line.startswith(" "):
            name = line.split(" ", 1)[0]
            found[name] = ""
        found[name] += line + "\n"
    return found


def test_options_lists_every_question_with_its_flag_choices_and_default(scaffold):
    ran = scaffold("options")

    assert ran.exit_code == 0, ran.stderr
    listed = blocks(ran.stdout)
    assert list(listed) == [q.name for q in asked_questions()]
    for question in asked_questions():
        assert question.flag in listed[question.name]
        assert "default: " in listed[question.name]
        for choice in question.choices:
            assert choice.label in listed[question.name]
    assert "default: the name of DEST's folder" in listed["project_name"]
    assert "default: 1\n" in listed["grad_accum_steps"]
    assert "default: --no-compile\n" in listed["compile"]


def test_options_shows_the_defaults_of_this_machine(scaffold):
    ran = scaffold("options")

    device = machine_facts()["machine_device"]
    evidence = accelerator().evidence
    assert f"default: {device} (on this machine: {evidence})" in blocks(ran.stdout)["device"]
