"""Machinery: ending a run cleanly: a signal stops it at a step boundary, and one writer holds a run folder.

SIGTERM (from SLURM, Kubernetes, `kill`), SIGINT (Ctrl-C) and SIGUSR1 are noted; after the step it
is in, the loop writes that step's checkpoint and exits with 128 + the signal (143, 130, 138), as a
shell reports it. The same command resumes, losing no steps. A second signal aborts at once.

`train` holds an exclusive POSIX record lock on RUN_DIR/.lock (dropped by the kernel when it ends,
even by kill -9; not inherited by loader workers): a second `train` on the folder stops at once."""

import errno
import fcntl
import os
import signal
import socket
import threading
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder."""


class Aborted(KeyboardInterrupt):
    """A second signal: stop at once, without the checkpoint of the current step."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


class StopSignals:
    """Within `with StopSignals() as stop:`, stop.signum is the first stop signal received, or 0."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # only it may handle signals
            self._previous = {sig: signal.signal(sig, self._note) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame) -> None:
        if self.signum:
            raise Aborted(signum)
        self.signum = signum


_reasons: dict[int, str] = {}  # why the run asked itself to stop, by signal


def request_stop(reason: str, signum: int = signal.SIGUSR1) -> None:
    """Stops the run as a stop signal does, from any thread (the prefetch's); `reason` says why.
    Nothing where no run handles the signal (a check, inspect-data): its default would kill."""
    if callable(signal.getsignal(signum)):
        _reasons[signum] = reason
        os.kill(os.getpid(), signum)


def stop_reason(signum: signal.Signals) -> str:
    """What stopped the run: a request's reason, or the signal's name."""
    return _reasons.get(signum) or signum.name


def ignore_stop_signals() -> None:
    """For loader workers: a Ctrl-C reaches the process group; a worker it ended would crash the loader."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class RunLock:
    """An exclusive lock on RUN_DIR/.lock, naming its holder; released by release() or by the kernel."""

    def __init__(self, run_dir: Path, name: str = "") -> None:
        self.path = run_dir / ".lock"
        while True:
            self.file = self.path.open("a+", encoding="utf-8")
            try:
                fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    self.file.close()
                    raise
                self.file.seek(0)
                holder = self.file.read().strip() or "another process"
                self.file.close()
                raise RunFolderBusy(
                    f"{name or run_dir} is in use by {holder}:"
                    " wait for it to end, or train into another --run-dir"
                ) from None
            if self.path.exists() and os.path.samestat(os.fstat(self.file.fileno()), self.path.stat()):
                break
            self.file.close()  # a start that failed removed this file meanwhile: lock the one there now
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        self.file.close()  # the file stays: deleting it would race a process about to lock it
