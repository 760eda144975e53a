"""Every use of a private API of copier or of the standard library, in this one module.

Checked against copier 9.19.1 and CPython 3.11; tests/test_compat.py fails when any of them
changes shape. Each has no public equivalent (as of those versions):

- `copier._main.Worker`: `run_copy` builds one and keeps it to itself, but scaffold needs its
  Jinja environment (to cache compiled templates across runs: half of a render's time) and its
  questionnaire alone (`Worker._ask`: the matrix asks copier which of ~3,360 combinations its
  validators accept, without rendering each). Without a usable Worker, renders go through the
  public `copier.run_copy`, only slower.
- `Worker.template` (a cached_property): the matrix's workers give each render's Worker the
  Template an earlier render of the same folder built (share_templates).
- `Worker._sync_git_index_executable_bit`: copier asks git, once a rendered file, whether the
  destination's repository ignores file modes; scaffold asks once a render (see run_copy).
- the messages of copier's answer errors: copier raises a plain ValueError for an invalid choice
  or a failed validator, whose text alone names the question.
- `atexit._clear`, `atexit._run_exitfuncs`, `threading._shutdown`,
  `multiprocessing.util._exit_function`: a matrix check forked from a warm worker must run the
  exit handlers a fresh interpreter would run, and not those of the worker.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import marshal
import multiprocessing.util
import os
import re
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COPIER_CHECKED = "9.19.1"
PYTHON_CHECKED = (3, 11)


def copier_worker_class() -> type | None:
    """copier's Worker, or None when this copier has none usable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from copier._main import Worker
    except ImportError:
        return None
    needed = ("jinja_env", "run_copy", "_ask", "_sync_git_index_executable_bit")
    if not all(hasattr(Worker, name) for name in needed):
        return None
    return Worker


def run_copy(src_path: str, dst_path: Path, *, data: dict[str, Any], **options: Any) -> Any:
    """copier's `run_copy`, with the Jinja templates' compiled code cached between runs."""
    worker_class = copier_worker_class()
    if worker_class is None:
        import copier

        return copier.run_copy(src_path, dst_path, data, **options)
    with worker_class(src_path=src_path, dst_path=Path(dst_path), data=data, **options) as worker:
        _share_template(worker, src_path, options)
        cache_compiled_templates(worker.jinja_env)
        if not git_ignores_file_modes(Path(dst_path)):
            # copier's per-file sync of executable bits into the git index acts only where git
            # ignores file modes (core.fileMode false), and otherwise returns after asking git:
            # ~40 git processes a render, a third of its time. Asked once here instead.
            worker._sync_git_index_executable_bit = lambda *args: None
        worker.run_copy()
    return worker


def share_templates() -> None:
    """Make this process's renders of a plain template folder share copier's `Template` (see
    _share_template): the matrix's workers, which render one template thousands of times."""
    global _SHARED_TEMPLATES
    if _SHARED_TEMPLATES is None:
        _SHARED_TEMPLATES = {}


_SHARED_TEMPLATES: dict[tuple[str, int, int], Any] | None = None


def _share_template(worker: Any, src_path: str, options: dict[str, Any]) -> None:
    """Give `worker` the `Template` an earlier render of the same folder built (after
    share_templates), not a new one: copier's Template parses copier.yml and asks git, in three
    processes, whether the folder is a repository or a bundle, the same each render. Only a
    plain folder's (a git template is cloned for each render, the clone removed with its worker),
    named by copier.yml's size and change time, so that an edited copier.yml is read again."""
    if _SHARED_TEMPLATES is None or options.get("vcs_ref") or "template" in vars(worker):
        return
    try:
        stat = (Path(src_path) / "copier.yml").stat()
    except OSError:
        return
    key = (os.path.realpath(src_path), stat.st_mtime_ns, stat.st_size)
    if key in _SHARED_TEMPLATES:
        vars(worker)["template"] = _SHARED_TEMPLATES[key]  # Worker.template: a cached_property
    elif worker.template.vcs is None:
        _SHARED_TEMPLATES[key] = worker.template


def git_ignores_file_modes(path: Path) -> bool:
    """Whether `path` (or the folder it will be made in) lies in a git repository whose
    core.fileMode is false; False outside a repository or without git."""
    folder = path.absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "config", "--type=bool", "--get", "core.fileMode"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.strip() == "false"


def answer_validator(template: Path) -> Callable[[dict[str, Any]], str | None]:
    """A function that answers None when copier accepts `answers`, else copier's message.

    It runs copier's own questionnaire (choices, choice validators, validators) with `answers`
    as data and defaults for the rest, without rendering a file. One worker serves every call.
    """
    worker_class = copier_worker_class()
    if worker_class is None:
        raise RuntimeError(f"this copier has no Worker._ask (checked with {COPIER_CHECKED})")
    probe = Path(tempfile.gettempdir()) / "scaffold-matrix-probe" / "probe"
    worker = worker_class(src_path=str(template), dst_path=probe, defaults=True, quiet=True)
    env = worker.jinja_env
    cache_compiled_templates(env)
    # Thousands of calls render the same few hundred expressions: keep each compiled Template
    # (they are immutable), not only its code, as copier asks for it again by its text.
    from_string = env.from_string
    templates: dict[str, Any] = {}

    def cached_from_string(source: Any, globals: Any = None, template_class: Any = None) -> Any:
        if globals is not None or template_class is not None or not isinstance(source, str):
            return from_string(source, globals, template_class)
        if source not in templates:
            templates[source] = from_string(source)
        return templates[source]

    env.from_string = cached_from_string

    def validate(answers: dict[str, Any]) -> str | None:
        worker.data = dict(answers)
        try:
            worker._ask()
        except ValueError as err:
            return str(err)
        return None

    return validate


@dataclass(frozen=True, kw_only=True)
class AnswerError:
    question: str
    kind: str  # "choice": not one of the choices; "validator": its validator refused it
    detail: str  # copier's explanation, without the question's name


# The messages of the ValueErrors copier raises when an answer is not acceptable.
_ANSWER_ERROR = re.compile(
    r"^(Validation error for question '(?P<validator>\w+)': "
    r"|Invalid choice for '(?P<choice>\w+)': )"
)


def answer_error(err: ValueError) -> AnswerError | None:
    """What `err`, raised by copier's questionnaire, says about an answer (None: not that)."""
    match = _ANSWER_ERROR.match(str(err))
    if match is None:
        return None
    kind = "choice" if match["choice"] else "validator"
    return AnswerError(question=match[kind], kind=kind, detail=str(err)[match.end() :].strip())


def cache_compiled_templates(env: Any, folder: Path | None = None) -> None:
    """Make `env` (a Jinja environment) keep the code it compiles: in memory, and on disk under
    `folder` (default: the user's cache folder) for the next process. Jinja's own bytecode cache
    covers templates read from files only; copier compiles every path, default and validator
    from a string too. An entry is named by everything that shapes the code: Python's bytecode
    version, Jinja's, the environment's syntax options and extensions, and the source."""
    folder = folder or cache_folder("jinja")
    compile_ = env.compile
    # Shared by every environment of this process with this cache folder: a render makes a new
    # one, and found each of its ~390 entries on disk again (open and unmarshal: 0.02 s a render).
    memory = _COMPILED.setdefault(str(folder), {})
    settings = repr(
        (
            importlib.util.MAGIC_NUMBER,
            distribution_version("jinja2"),
            type(env).__qualname__,
            sorted(env.extensions),
            *(getattr(env, name, None) for name in _SYNTAX_OPTIONS),
        )
    )

    def cached(source: Any, name: Any = None, filename: Any = None, raw: bool = False,
               defer_init: bool = False) -> Any:  # fmt: skip
        if raw or not isinstance(source, str):
            return compile_(source, name, filename, raw, defer_init)
        seen = (settings, source, name, filename, defer_init)
        if seen in memory:
            return memory[seen]
        key = hashlib.sha256(repr(seen).encode()).hexdigest()
        code = _load(folder, key)
        if code is None:
            code = compile_(source, name, filename, raw, defer_init)
            _store(folder, key, code)
        memory[seen] = code
        return code

    env.compile = cached


_COMPILED: dict[str, dict[tuple[Any, ...], Any]] = {}  # by cache folder, then what shapes the code

_SYNTAX_OPTIONS = (
    "block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
    "comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix",
    "trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "optimized",
    "autoescape",
)  # fmt: skip


def cache_folder(kind: str) -> Path | None:
    """Where scaffold keeps what it computed for the next process: the user's cache folder
    (None with SCAFFOLD_NO_CACHE set)."""
    if os.environ.get("SCAFFOLD_NO_CACHE"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scaffold" / kind


def _load(folder: Path | None, key: str) -> Any:
    if folder is None:
        return None
    try:
        with open(folder / key, "rb") as file:
            return marshal.load(file)
    except (OSError, EOFError, ValueError, TypeError):
        return None


def _store(folder: Path | None, key: str, code: Any) -> None:
    if folder is not None:
        with contextlib.suppress(ValueError):
            write_atomically(folder / key, marshal.dumps(code))


def write_atomically(path: Path, data: bytes) -> None:
    """Write a cache entry through a temporary file renamed into place, so that a reader never
    sees half an entry; a cache that cannot be written is no error."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def distribution_version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def forget_exit_handlers() -> None:
    """Start this process's exit handlers afresh, as a new interpreter has them: none of the
    registered ones, non-daemon threads joined as usual, and multiprocessing's own handler (it
    stops the loader workers), which a fresh interpreter registers on importing it."""
    atexit._clear()  # type: ignore[attr-defined]
    getattr(threading, "_threading_atexits", []).clear()
    atexit.register(multiprocessing.util._exit_function)  # type: ignore[attr-defined]


def run_exit_handlers() -> None:
    """What the interpreter does as it exits: wait for non-daemon threads, then run the atexit
    handlers."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # type: ignore[attr-defined]
