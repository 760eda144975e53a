"""On a terminal, `scaffold new` asks every question that no flag answered (copier's prompts)."""

from __future__ import annotations

import io
import os
import sys

import pexpect
import yaml
from conftest import REPO

from scaffold.questions import machine_facts

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
    child = spawn("new", "demo", "--compile", "--no-git", cwd=tmp_path)

    child.expect("Project name")
    child.send(CLEAR_LINE + "my-run" + ENTER)
    child.expect("What the model learns")
    child.send(ENTER)  # the default task
    child.expect("Where training runs")
    child.send(DOWN + ENTER)  # the second device: cuda
    child.expect("Numeric precision")
    child.send(ENTER)  # the default for cuda on this machine
    child.expect("Gradient accumulation steps")
    child.send(CLEAR_LINE + "3" + ENTER)
    child.expect("Created my-run in ")
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 0
    assert (
        "torch.compile" not in child.logfile_read.getvalue()
    )  # answered by --compile, so never asked
    answers = yaml.safe_load((tmp_path / "demo" / ".copier-answers.yml").read_text())
    assert answers["project_name"] == "my-run"
    assert answers["task"] == "classification"
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
