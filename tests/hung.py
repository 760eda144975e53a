"""A process group that runs past its time: killed, and what each of its processes was doing kept
(its `ps` line and, with py-spy installed, its Python stack), so a hung training run fails with
where it hung, not with pytest-timeout's stack of the test reading its output."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator


def group_state(pgid: int) -> str:
    """Each process of group `pgid`: its ps line and its threads' Python stacks."""
    listed = subprocess.run(
        ["ps", "-ww", "-o", "pid,ppid,stat,etimes,args", "-g", str(pgid)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    state = listed.stdout.splitlines()
    spy = shutil.which("py-spy")
    for pid in [line.split()[0] for line in state[1:]] if spy else []:
        with contextlib.suppress(subprocess.TimeoutExpired):
            dump = subprocess.run(
                [spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60
            )
            state.append(f"--- py-spy dump --pid {pid}\n{dump.stdout}{dump.stderr}")
    return "\n".join(state)


@contextlib.contextmanager
def killed_after(pgid: int, seconds: float) -> Iterator[list[str]]:
    """Inside the block, process group `pgid` is SIGKILLed once `seconds` have passed; the list
    yielded then holds what the group was doing (empty while it kept to its time)."""
    found: list[str] = []

    def overrun() -> None:
        found.append(f"still running after {seconds:.0f} s:\n{group_state(pgid)}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    timer = threading.Timer(seconds, overrun)
    timer.daemon = True
    timer.start()
    try:
        yield found
    finally:
        timer.cancel()


def drained(stream) -> tuple[threading.Thread, list[str]]:
    """A thread reading `stream` to its end into the list returned: a pipe nobody reads fills up
    and blocks its writer."""
    text: list[str] = []
    reader = threading.Thread(target=lambda: text.append(stream.read()), daemon=True)
    reader.start()
    return reader, text
