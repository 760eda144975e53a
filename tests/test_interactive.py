"""On a terminal, `scaffold new` asks every question that no flag answered (copier's prompts)."""

from __future__ import annotations

import io
import os
import re
import sys

import pexpect
import yaml
from conftest import REPO

from scaffold.questions import asked_questions, load_questions, machine_facts

ENTER = "\r"
DOWN = "\x1b[B"
CLEAR_LINE = "\x15"  # Ctrl-U: a text prompt starts filled with its default


def spawn(*args: str, cwd) -> pexpect.spawn:
    """`python -m scaffold ARGS` on a pseudo-terminal; all it shows collects in `.logfile_read`."""
    env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "scaffold", *args],
        cwd=str(cwd),
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 160),
    )
    child.logfile_read = io.StringIO()
    return child


def test_terminal_prompts_for_what_no_flag_answered(tmp_path):
    device = load_questions()["device"]
    typed = {
        "project_name": CLEAR_LINE + "my-run" + ENTER,
        "device": DOWN * device.values.index("cuda") + ENTER,
        "grad_accum_steps": CLEAR_LINE + "3" + ENTER,
    }
    child = spawn("new", "demo", "--compile", "--no-git", cwd=tmp_path)

    for question in asked_questions():
        if question.name != "compile":  # answered by the flag
            child.expect(re.escape(question.help))
            child.send(typed.get(question.name, ENTER))  # Enter takes the default
    child.expect("Created my-run in ")
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 0
    assert load_questions()["compile"].help not in child.logfile_read.getvalue()  # never asked
    answers = yaml.safe_load((tmp_path / "demo" / ".copier-answers.yml").read_text())
    assert answers["project_name"] == "my-run"
    assert answers["task"] == load_questions()["task"].default
    assert answers["device"] == "cuda"
    assert answers["precision"] == machine_facts()["machine_cuda_precision"]
    assert answers["grad_accum_steps"] == 3
    assert answers["compile"] is True


def test_defaults_flag_asks_nothing_on_a_terminal(tmp_path):
    child = spawn("new", "demo", "--defaults", "--no-git", cwd=tmp_path)

    child.expect("Created demo in ")
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 0
    assert "Project name" not in child.logfile_read.getvalue()


def test_ctrl_c_at_a_prompt_writes_nothing(tmp_path):
    child = spawn("new", "demo", cwd=tmp_path)

    child.expect("Project name")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 130
    assert list(tmp_path.iterdir()) == []
