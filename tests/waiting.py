"""Waiting for what another process or thread does, polled against a deadline: a fixed sleep
fails on a machine slower than the one it was tuned on, and wastes its time on a faster one."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(done: Callable[[], object], timeout: float, every: float = 0.02) -> bool:
    """Whether `done()` came true within `timeout` seconds, asking every `every` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
