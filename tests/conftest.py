"""Shared helpers: run `scaffold` in this process, snapshot folders to prove nothing changed,
and tally what the fault and bad-input suites tried."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from scaffold._cli import run
from scaffold.check import ci_passed, ci_verdict
from scaffold.combinations import combinations

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread for every process a test starts (projects, their ranks, matrix workers):
# xdist runs a test a core, so a process sized for every core shares them with the other's, and
# torch's OpenMP threads then spin waiting for each other. Measured under `-n 2` on 2 cores: the
# matrix test of one generation combination took 121 s with each process at 2 threads, 22 s at 1.
# Set before torch is imported anywhere in this session; a value given outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def checks_passed(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether a project's `check` run passed as CI counts it: exit status 0, or a loader check
    that failed on a close call and nothing else (scaffold.check.ci_verdict), printed here."""
    passed, notes = ci_passed(done.returncode, done.stdout)
    if notes:
        print(*notes, sep="\n")
    return passed


def check_passed_line(stdout: str, name: str) -> bool:
    """`name`'s line says PASS, or (the loader) FAIL on a close call that CI reports."""
    line = next((line for line in stdout.splitlines() if line.startswith(f"{name}: ")), "")
    passed, notes = ci_verdict(line)
    return line.startswith(f"{name}: PASS") or (passed and bool(notes))


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


@pytest.fixture
def scaffold(capfd, monkeypatch):
    """Run the command line in this process, through `run`, where errors become exit codes.

    Output is captured at the file-descriptor level, so a project's own checks (a child
    process) are captured too. stdout is not a terminal here, so `new` never prompts.
    """

    def invoke(*args: object, cwd: Path | None = None) -> Ran:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capfd.readouterr()
        exit_code = run([str(a) for a in args])
        out, err = capfd.readouterr()
        return Ran(exit_code, out, err)

    return invoke


def scaffold_process(*args: object, cwd: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run `python -m scaffold` as a real process, without a terminal."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "scaffold", *map(str, args)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder): equal snapshots, same tree."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


# suite -> {"inputs tried": n, "faults injected": n, ...}, printed at the end of the session.
_TALLY: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="session")
def tally() -> dict[str, collections.Counter[str]]:
    """Counts a suite adds to: what it tried, what it injected, what was recovered or lost."""
    return _TALLY


def pytest_configure(config) -> None:
    """Ask copier for the valid combinations once, before xdist starts its workers: each of them
    collects test_render.py and test_bad_input.py, which list them, and reads them back from the
    cache (scaffold.combinations) instead of asking copier again at the same time."""
    if not hasattr(config, "workerinput"):
        combinations()


_COLLECTED = threading.Event()


def pytest_collection(session) -> None:
    """pytest says nothing while it imports the test modules (with -q, or in a log: a minute and
    more under load): a line every 8 s says how long it has been, so a slow collection is not
    taken for a hung one. (Under xdist the workers collect, and say nothing.)"""
    start, capture = time.monotonic(), session.config.pluginmanager.getplugin("capturemanager")

    def speak() -> None:
        while not _COLLECTED.wait(8.0):
            with capture.global_and_fixture_disabled():  # collection's output is captured
                print(f"collecting: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    threading.Thread(target=speak, daemon=True).start()


def pytest_collection_finish(session) -> None:
    _COLLECTED.set()


def pytest_sessionfinish(session) -> None:
    """On a pytest-xdist worker, hands its counts to the controller, which alone prints."""
    _COLLECTED.set()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["tally"] = {suite: dict(counts) for suite, counts in _TALLY.items()}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller, as a worker ends
def pytest_testnodedown(node, error) -> None:
    for suite, counts in getattr(node, "workeroutput", {}).get("tally", {}).items():
        _TALLY[suite].update(counts)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TALLY:
        return
    terminalreporter.section("fault and bad-input summary")
    for suite, counts in _TALLY.items():
        line = ", ".join(f"{key} {value}" for key, value in counts.items())
        terminalreporter.write_line(f"{suite}: {line}")
