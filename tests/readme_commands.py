"""The commands of a README, as a user pastes them: every line of its ```bash blocks (a line ending
in a backslash joined to the next), each to be run in order in the folder the README is about. A
generated project's manual is its README and the docs/*.md it points to, read README first.

Used by tests/test_readme_commands.py on the generated projects' READMEs and on scaffold's own."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import warm_python

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
    status is -9, its output kept. A line that is a plain `python -m ...` (no shell syntax, and the
    `python` bash would find is this one) runs forked from the warm interpreter instead
    (tests/warm_python.py), as bash would have run it: about 2 s of CPU less (torch's import)."""
    start = time.perf_counter()
    argv = plain_python_module(command.line, env)
    if argv is not None and warm_python.can_run(argv, cwd, env):
        try:
            done = warm_python.run(argv, cwd=cwd, env=env, timeout=timeout, merged=True)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or "") + f"\n(killed after {timeout:.0f} s)"
            return Ran(command, -signal.SIGKILL, time.perf_counter() - start, output)
        return Ran(command, done.returncode, time.perf_counter() - start, done.stdout)
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


def plain_python_module(line: str, env: dict[str, str]) -> list[str] | None:
    """The line as an argv when bash would run it as this Python's `python -m ...` with nothing
    else of the shell (expansions, redirections, pipes, variables set before it); else None."""
    command = line.partition("  #")[0]
    if SHELL_SYNTAX.search(command):
        return None
    words = shlex.split(command)
    if len(words) < 3 or words[0] not in ("python", "python3") or words[1] != "-m":
        return None
    found = shutil.which(words[0], path=env.get("PATH"))
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        return None
    return [sys.executable, *words[1:]]


SHELL_SYNTAX = re.compile(r"[|&;<>()$`*?~{}\[\]=!\\]|#")


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
