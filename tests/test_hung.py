import shutil
import subprocess
import sys
import time

import pytest
from hung import drained, killed_after


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy (the dev extra) not installed")
def test_a_group_past_its_time_is_killed_with_its_processes_and_stacks_kept():
    """A child that sleeps forever in a session of its own, with a grandchild holding its pipe."""
    code = (
        "import subprocess, sys, time;"
        " subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    )
    started = time.monotonic()
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc, killed_after(proc.pid, 3) as hung:  # fmt: skip
        reader, errors = drained(proc.stderr)
        assert proc.stdout.read() == ""  # its end: the grandchild's copy of the pipe closed too
        proc.wait()
        reader.join()
    assert time.monotonic() - started < 60
    assert proc.returncode == -9 and errors == [""]
    assert len(hung) == 1 and "still running after 3 s" in hung[0], hung
    lines = hung[0].splitlines()
    ps_lines = [line for line in lines if line[:6].strip().isdigit() and "sleep(600)" in line]
    assert len(ps_lines) == 2, hung[0]  # both processes
    # each one's py-spy dump, a stack in it (py-spy leaves out a thread name it cannot read yet)
    assert hung[0].count("--- py-spy dump") == 2, hung[0]
    assert "<module> (<string>:1)" in hung[0], hung[0]


def test_a_group_within_its_time_is_left_alone():
    with subprocess.Popen(
        [sys.executable, "-c", "print('done')"], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc, killed_after(proc.pid, 60) as hung:  # fmt: skip
        assert proc.stdout.read() == "done\n"
        proc.wait()
    assert proc.returncode == 0 and hung == []
