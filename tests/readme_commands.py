"""The commands of a README, as a user pastes them: every line of its ```bash blocks (a line ending
in a backslash joined to the next), each to be run in order in the folder the README is about. A
generated project's manual is its README and the docs/*.md it points to, read README first.

Used by tests/test_readme_commands.py on the generated projects' READMEs and on scaffold's own."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from pathlib import Path

FENCED = re.compile(r"^ *```bash\n(.*?)^ *```", re.MULTILINE | re.DOTALL)


@dataclasses.dataclass
class Command:
    line: str  # as pasted, its comment included

    @property
    def may_exit_1(self) -> bool:
        """Whether the README says this command exits 1 on a finding (diagnose)."""
        return "exit 1 if any" in self.line


@dataclasses.dataclass
class Ran:
    command: Command
    status: int
    seconds: float
    output: str

    @property
    def as_said(self) -> bool:
        return self.status == 0 or (self.status == 1 and self.command.may_exit_1)


def fenced_commands(markdown: str) -> list[Command]:
    """Every command of the markdown's ```bash blocks, in order."""
    found = []
    for block in FENCED.findall(markdown):
        joined = re.sub(r"\\\n\s*", "", block)
        found += [Command(line.strip()) for line in joined.splitlines() if line.strip()]
    return found


def manual(project: Path) -> list[Path]:
    """A generated project's manual: its README.md, then each of its docs/*.md in name order."""
    return [project / "README.md", *sorted((project / "docs").glob("*.md"))]


def manual_commands(project: Path) -> list[Command]:
    """Every command of the project's manual (README.md, then docs/*.md), in that order."""
    texts = [path.read_text(encoding="utf-8") for path in manual(project)]
    return [command for text in texts for command in fenced_commands(text)]


def run(command: Command, cwd: Path, env: dict[str, str], timeout: float) -> Ran:
    """Runs the line with bash in `cwd`; past `timeout` its whole process group is killed and its
    status is -9, its output kept."""
    start = time.perf_counter()
    process = subprocess.Popen(
        ["bash", "-c", command.line],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n(killed after {timeout:.0f} s)"
    return Ran(command, process.returncode, time.perf_counter() - start, output)


def indented_commands(markdown: str, starts: tuple[str, ...]) -> list[Command]:
    """Every line of the markdown's indented code blocks (four spaces after a blank line) that
    starts with one of `starts`: the commands of a README written without fences."""
    found, in_block, previous = [], False, ""
    for line in markdown.splitlines():
        in_block = line.startswith("    ") and (in_block or not previous.strip())
        if in_block and line.strip().startswith(starts):
            found.append(Command(line.strip()))
        previous = line
    return found
