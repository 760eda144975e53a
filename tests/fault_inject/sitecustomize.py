"""Test-only fault injection for generated projects; never shipped in a project.

tests/test_faults.py puts this folder on PYTHONPATH, so Python imports it at start-up, and
describes one fault in the SCAFFOLD_FAULT environment variable (JSON):

    {"at": "fsync"|"replace"|"replaced"|"unlink"|"dirfsync"|"write"|"binwrite",  # where
     "match": "step-",      # only paths containing this (the file being written or renamed)
     "nth": 2,              # the nth matching call in this process
     "do": "kill"|"torn"|"ENOSPC"|"EROFS"|"EIO"|"SIGINT"|"SIGINT2"}
     # SIGKILL; SIGKILL after tearing; raise errno; one or two SIGINTs to itself, as Ctrl-C
     "rank": 1,             # only in this torchrun rank (RANK), where given
    {"readonly": "/some/dir"}   # every write under it fails with EROFS, as on a read-only mount
    {"scaler_init_scale": 1e30} # fp16 GradScaler overflows and skips steps at first

"fsync" is the fsync of a checkpoint's temporary file (its bytes written, not yet renamed);
"torn" cuts that file to half its size before the kill, as a crash in the middle of the write
would. "replace" fires before the rename, "replaced" just after it. "binwrite" is one write() of the
bytes of a file opened in binary (torch's zip writer calls it, chunk by chunk, in the middle of
torch.save). Nothing here runs unless
SCAFFOLD_FAULT is set.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal

_SPEC = json.loads(os.environ.get("SCAFFOLD_FAULT") or "null")


def _fault(spec: dict) -> None:
    seen = {"n": 0}

    def fire(path: str) -> bool:
        if spec.get("match", "") not in os.path.basename(path):
            return False
        seen["n"] += 1
        return seen["n"] == spec.get("nth", 1)

    def act(path: str) -> None:
        what = spec["do"]
        if what == "torn":
            with open(path, "r+b") as f:
                f.truncate(os.fstat(f.fileno()).st_size // 2)
            what = "kill"
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if what.startswith("SIGINT"):
            for _ in range(2 if what == "SIGINT2" else 1):
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs before kill() returns
            return
        code = getattr(errno, what)
        raise OSError(code, os.strerror(code), path)

    at = spec["at"]
    if at in ("fsync", "dirfsync"):
        real_fsync = os.fsync

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isdir(path) == (at == "dirfsync") and fire(path):
                act(path)
            return real_fsync(fd)

        os.fsync = fsync
    elif at in ("replace", "replaced"):
        real_replace = os.replace

        def replace(src, dst, **kwargs):
            hit = fire(os.fspath(dst))
            if hit and at == "replace":
                act(os.fspath(src))
            real_replace(src, dst, **kwargs)
            if hit:
                act(os.fspath(dst))

        os.replace = replace
    elif at == "unlink":
        real_unlink = os.unlink

        def unlink(path, **kwargs):
            if fire(os.fspath(path)):
                act(os.fspath(path))
            return real_unlink(path, **kwargs)

        os.unlink = unlink
    elif at == "write":  # a file opened for writing whose writes fail (the disk fills up)
        real_open = io.open

        class Full(io.TextIOWrapper):
            def write(self, text):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            text_write = set(mode) & set("wax") and "b" not in mode
            if isinstance(file, str | os.PathLike) and text_write and fire(os.fspath(file)):
                return Full(f.detach(), encoding=f.encoding, line_buffering=True)
            return f

        io.open = builtins.open = open_
    elif at == "binwrite":
        real_open = io.open

        class Writes:  # a binary file whose nth write (chunk of bytes) acts first
            def __init__(self, f):
                self._f = f

            def write(self, data):
                if fire(self._f.name):
                    act(self._f.name)
                return self._f.write(data)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if isinstance(file, str | os.PathLike) and "b" in mode and set(mode) & set("wax"):
                return Writes(f)
            return f

        io.open = builtins.open = open_


def _readonly(root: str) -> None:
    root = os.path.realpath(root)

    def under(path) -> bool:
        real = os.path.realpath(os.fspath(path))
        return real == root or real.startswith(root + os.sep)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def guard(real, *, writes=lambda *a, **k: True):
        def wrapper(path, *args, **kwargs):
            named = isinstance(path, str | bytes | os.PathLike)
            if named and under(path) and writes(*args, **kwargs):
                refuse(path)
            return real(path, *args, **kwargs)

        return wrapper

    def writing_mode(mode="r", *args, **kwargs):
        return bool(set(mode) & set("wax+"))

    def writing_flags(flags, *args, **kwargs):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    io.open = builtins.open = guard(io.open, writes=writing_mode)
    os.open = guard(os.open, writes=writing_flags)
    for name in ("mkdir", "unlink", "rmdir", "replace", "rename"):
        setattr(os, name, guard(getattr(os, name)))


def _scaler(init_scale: float) -> None:
    import torch

    real_init = torch.amp.GradScaler.__init__

    def init(self, *args, **kwargs):
        kwargs["init_scale"] = init_scale
        real_init(self, *args, **kwargs)

    torch.amp.GradScaler.__init__ = init


if _SPEC is not None:
    if "readonly" in _SPEC:
        _readonly(_SPEC["readonly"])
    elif "scaler_init_scale" in _SPEC:
        _scaler(_SPEC["scaler_init_scale"])
    elif os.environ.get("RANK", "0") == str(_SPEC.get("rank", os.environ.get("RANK", "0"))):
        _fault(_SPEC)
