"""A generated project's `python -m <pkg> ARGS`, run in a process forked from a warm interpreter.

Most tests run a project's commands one after another (train, kill, resume, report), each a
fresh `python -m <pkg>` importing torch: measured, 1.0-1.4 s of CPU a start on this machine, most
of what a short command costs, and the suite is CPU-bound on its two cores. Each pytest worker
starts one server here (the first time a test needs it), which imports what a project's commands
import once (scaffold.matrix.fork.PRELOAD) and forks a child per command: the child starts from
the server's fresh state as `scaffold matrix` forks its checks (scaffold/matrix/fork.py: the
environment, sys.path, warnings, signal and exit handlers of a new interpreter), runs the module
and exits with its status. Nothing else changes: the tests see a CompletedProcess, stdout and
stderr apart, the exit status (negative for a signal), and a TimeoutExpired past the timeout.

    python tests/warm_python.py   # the server: a JSON request a line on stdin, a reply a line

Only plain `python -m <pkg>` commands run from the project's folder with src/ last on PYTHONPATH
come here (`run` says whether a command can). A folder before it that holds a sitecustomize (the
fault injection's) is imported from in the child as site would at start-up; a test that limits
memory or passes interpreter options starts a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SERVER: subprocess.Popen[str] | None = None
_LOCK = threading.Lock()  # one request at a time per server


def can_run(command: list[str], cwd: Path, env: dict[str, str]) -> bool:
    """Whether `command` is one the warm server runs exactly as a fresh interpreter would."""
    return (
        len(command) >= 3
        and command[0] == sys.executable
        and command[1] == "-m"
        and env.get("PYTHONPATH", "").split(os.pathsep)[-1] == str(Path(cwd) / "src")
        and os.environ.get("SCAFFOLD_TESTS_FRESH") != "1"  # to compare, or to rule it out
        and hasattr(os, "fork")
        and sys.platform.startswith("linux")
    )


def run(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float, merged: bool = False
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout),
    forked from the warm server when can_run allows, else a fresh process. With `merged`, stderr
    goes where stdout does (stderr=subprocess.STDOUT): stdout holds both, in the order written."""
    if not can_run(command, cwd, env):
        return subprocess.run(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
    with _LOCK, tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out = Path(tmp) / "stdout"
        err = out if merged else Path(tmp) / "stderr"
        request = {
            "project": str(cwd),
            "package": command[2],
            "args": [os.fspath(arg) for arg in command[3:]],
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
            "timeout": timeout,
        }
        reply = _ask(request)
        stdout = out.read_text(encoding="utf-8", errors="replace")
        stderr = None if merged else err.read_text(encoding="utf-8", errors="replace")
    if reply["returncode"] is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)


def _ask(request: dict) -> dict:
    global _SERVER
    if _SERVER is None or _SERVER.poll() is not None:
        _SERVER = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        atexit.register(_SERVER.kill)
    assert _SERVER.stdin is not None and _SERVER.stdout is not None
    _SERVER.stdin.write(json.dumps(request) + "\n")
    _SERVER.stdin.flush()
    line = _SERVER.stdout.readline()
    if not line:
        raise RuntimeError(f"the warm python server ended (exit {_SERVER.wait()})")
    return json.loads(line)


# --- the server -------------------------------------------------------------------------------


def _serve() -> None:
    here = Path(__file__).resolve().parent  # a fresh `python -m` has no tests/ on its path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from scaffold.matrix import fork

    replies = sys.stdout
    sys.stdout = sys.stderr  # what the imports print stays off the replies
    fork.start_worker(threads=os.cpu_count() or 1, preload=True)
    for line in sys.stdin:
        request = json.loads(line)
        returncode = fork.wait_child(_start(request), request["timeout"])
        replies.write(json.dumps({"returncode": returncode}) + "\n")
        replies.flush()


def _start(request: dict) -> int:
    """Forks the child that runs the request's module; its pid."""
    from scaffold.matrix import fork

    paths = {request["stdout"], request["stderr"]}  # one, opened once, where they are merged
    opened = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for path in paths}
    outputs = [opened[request[name]] for name in ("stdout", "stderr")]
    project = Path(request["project"])
    run = (project, request["package"], request["args"], request["env"])
    pid = fork.start_child(*outputs, lambda: fork._run_module(*run))
    for fd in opened.values():
        os.close(fd)
    return pid


if __name__ == "__main__":
    _serve()
