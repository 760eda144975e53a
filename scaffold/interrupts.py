"""Ctrl-C and SIGTERM while files move or git writes: never a half-done state."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def sigterm_raises_keyboard_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so that `finally` blocks clean up either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while files move, so a move is never left half-done."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM, in git too (an ignored signal stays ignored across exec): for
    work that, once begun, must end rather than stop half-way. One sent meanwhile is dropped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(signum, signal.SIG_IGN) for signum in held]
    try:
        yield
    finally:
        for signum, handler in zip(held, previous, strict=True):
            signal.signal(signum, handler)
