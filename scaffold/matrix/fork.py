"""A matrix check run as `python -m <pkg> check all` would run, in a process forked from a warm
worker (one that imported torch once), and ddp ones as the rank processes torchrun starts.

The forked process is put back into the state a fresh interpreter starts in (working folder,
sys.path, sys.argv, environment, warning filters, signal handlers, exit handlers) before the
project's module runs, and exits as an interpreter does: non-daemon threads joined, exit handlers
run, streams flushed.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaffold import _compat

# The rank processes of a ddp combination, as the project's own launcher (torchrun) starts them.
DDP_PROCESSES = 2


@dataclass(frozen=True, kw_only=True)
class FreshState:
    """A worker's state as it started, before any rendering: what each forked check begins
    from, as a fresh interpreter would."""

    path: list[str]
    warning_filters: list[Any]
    environ: dict[str, str]


_FRESH: FreshState | None = None


def remember_fresh_state() -> None:
    """Record this worker's state as the one every check forked from it starts in, and start
    its exit handlers afresh: a worker never runs them (it ends with os._exit); a check forked
    from it runs those a fresh interpreter would have (see _compat.forget_exit_handlers)."""
    global _FRESH
    _FRESH = fresh_state()
    _compat.forget_exit_handlers()


def fresh_state() -> FreshState:
    """The state recorded by remember_fresh_state, else this process's now."""
    return _FRESH or FreshState(
        path=list(sys.path), warning_filters=list(warnings.filters), environ=dict(os.environ)
    )


# What a project's `check all` imports, loaded once per matrix worker before any check is forked
# from it: each fresh interpreter paid 3-5 s of this, more than the checks of a small model take.
# A module missing here is simply not preloaded (the project then imports it, or fails, itself).
PRELOAD = (
    "numpy",
    "PIL.Image",  # image's data
    "pyarrow.compute",  # the tables' and the shards' readers
    "pyarrow.csv",
    "pyarrow.parquet",
    "safetensors.torch",  # finetune's weights
    "torch",
    "torch._dynamo",  # torch.optim imports it when an optimizer is built
    "torch._inductor.compile_fx",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch.utils.data",
    "torch.utils.tensorboard",
    "tqdm",
    "wandb",
    "mlflow.tracking",
)


def start_worker(threads: int, preload: bool, warm_compiler: bool = False) -> None:
    """A matrix worker's start: copier, and for forked checks torch and the rest of PRELOAD
    (and torch.compile's machinery, when a combination compiles)."""
    # Jobs in parallel share the cores: one intra-op pool each, not one each per core. Set before
    # torch loads: it sizes its pool from this.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # Checks forked from here start from this state, with the exit handlers of a fresh
    # interpreter: multiprocessing's (it stops the loader workers) and the ones the modules it
    # imports register, not those of `scaffold matrix` itself.
    remember_fresh_state()
    # A worker started by spawn has spawn set as its start method (multiprocessing's spawn sets it
    # in the child), and every check forked from it inherited that: the project's loader workers
    # and its check processes then each started a fresh interpreter importing torch. Measured: a
    # regression check took 6 s instead of 1 s, and CI's matrix ran past its 90 minutes. A check
    # starts with the default a fresh interpreter has.
    multiprocessing.set_start_method(None, force=True)
    importlib.import_module("scaffold.render")
    if preload:
        for name in PRELOAD:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
    if warm_compiler:
        with contextlib.suppress(Exception):
            _warm_compiler()


def _warm_compiler() -> None:
    """Compile a one-line function forward and backward, then forget it: torch.compile's first
    use in a process initialises its machinery lazily (1-2 s, in every compile check)."""
    import torch

    forget = torch.compiler.reset
    forget()
    twice = torch.compile(lambda x: (x * 2).sum())
    twice(torch.ones(3, requires_grad=True)).backward()
    forget()


def forking_supported() -> bool:
    """Checks fork from a warm worker on Linux; macOS (where forking after loading the
    Objective-C runtime is unsafe) and Windows start a fresh interpreter for each check."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def run_check_forked(
    project: Path,
    command: list[str],
    *,
    env: dict[str, str],
    ranks: int,
    log: Path,
    timeout: float | None,
) -> tuple[int, str]:
    """Run `command` (`python -m <pkg> ...`) in a child of this warm worker, in its own
    session, its output in `log`; on timeout, stop the whole session (its ranks and loader
    workers too). Returns the exit status and "exit status N" or "timed out", then the output.

    The child is the launcher: it runs the module itself, or with `ranks` > 1 starts that many
    rank processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) and, as torchrun does, stops the others when one fails."""
    package, args = command[command.index("-m") + 1], command[command.index("-m") + 2 :]
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    pid = start_child(output, output, lambda: _launch(project, package, args, env, ranks))
    os.close(output)
    returncode = wait_child(pid, timeout)
    if returncode is None:
        return -1, f"timed out after {timeout:.0f} s\n{_read(log)}"
    return returncode, f"exit status {returncode}\n{_read(log)}"


def start_child(stdout: int, stderr: int, main: Callable[[], int]) -> int:
    """Forks a child that runs `main` in its own session, with its output to these descriptors
    (stdin empty) and the standard streams of an interpreter started with them, then exits with
    `main`'s status (1 after printing a traceback); the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the worker
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = sys.__stderr__ = open(  # noqa: SIM115
                2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False
            )
            code = main()
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    return pid


def wait_child(pid: int, timeout: float | None) -> int | None:
    """A child from start_child: its exit status (negative for a signal), or None once it ran past
    `timeout` seconds and its whole session was killed."""
    status = _wait(pid, timeout)
    if status is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(status)


def _wait(pid: int, timeout: float | None) -> int | None:
    """The child's wait status once it exits, or None past `timeout` seconds. Woken by the exit
    itself (a pidfd): polling with a growing pause woke up to 100 ms late, and most of the
    matrix's checks (a cross's --help) take about 0.3 s."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux before 5.3
        return _poll(pid, timeout)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return os.waitpid(pid, 0)[1] if ready else None


def _poll(pid: int, timeout: float | None) -> int | None:
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(pause)
        pause = min(0.1, pause * 2)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _launch(project: Path, package: str, args: list[str], env: dict[str, str], ranks: int) -> int:
    """In the forked launcher: run the module, or start `ranks` rank processes running it."""
    if ranks == 1:
        return _run_module(project, package, args, env)
    with socket.socket() as probe:  # the project's own launcher picks its port the same way
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "GROUP_RANK": "0",
                    "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                code = _run_module(project, package, args, rank_env, forkserver=True)
            finally:
                os._exit(code)
        pids.append(pid)
    failed = 0
    running = set(pids)
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 1
            print(f"rank {pids.index(pid)} exited with status {code}: stopping the others")
            sys.stdout.flush()
            for other in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
    return failed


def _run_module(
    project: Path, package: str, args: list[str], env: dict[str, str], forkserver: bool = False
) -> int:
    """`python -m <pkg> *args` in this (forked) process, from a fresh interpreter's state; its
    exit status. With `forkserver`, multiprocessing's forkserver is started first (_forkserver)."""
    fresh = fresh_state()
    os.chdir(project)
    os.environ.clear()
    os.environ.update(env)
    # What `python -m` starts with: the working folder, then PYTHONPATH's folders (src/, and any
    # other given before it), then the interpreter's own.
    given = [str(project / p) for p in env.get("PYTHONPATH", "src").split(os.pathsep) if p]
    sys.path[:] = [str(project), *given, *(p for p in fresh.path if p not in ("", *given))]
    sys.argv = [str(project / "src" / package / "__main__.py"), *args]  # runpy then sets argv[0]
    warnings.filters[:] = fresh.warning_filters
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _import_sitecustomize(given)
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if forkserver:
        _forkserver()
    code: int = 0
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    _compat.run_exit_handlers()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _forkserver() -> None:
    """Starts this process's multiprocessing forkserver as a fork of it, not as the fresh
    interpreter multiprocessing starts, which imports torch again and the project's preload list:
    2-3 s of CPU for each rank of every ddp and fsdp check whose loader has workers (they start
    from a forkserver there). A rank is single-threaded here, its environment and sys.path the
    check's, its sitecustomize imported; the workers import what they unpickle, as a fresh
    forkserver's do for a module its preload list leaves out."""
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    resource_tracker.ensure_running()  # as ForkServer.ensure_running: the workers share this one
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when this process, its last client, does
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            try:
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def _import_sitecustomize(folders: list[str]) -> None:
    """What site does as an interpreter starts: imports `sitecustomize` where a PYTHONPATH folder
    holds one (the tests' fault injection does), printing its error, as site does, if it fails."""
    if not any((Path(folder) / "sitecustomize.py").is_file() for folder in folders):
        return
    sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except Exception as error:
        said = f"{type(error).__name__}: {error}"
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{said}", file=sys.stderr)
