"""Render a new project from the template: all of it, or nothing.

copier renders into a fresh folder beside DEST (same filesystem); only a complete render,
already committed to git, is renamed into place. An invalid answer, an error, Ctrl-C or SIGTERM
leaves DEST as it was.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import copier
from copier.errors import CopierError, InteractiveSessionError

from scaffold import __version__
from scaffold.errors import (
    DestinationError,
    Interrupted,
    InvalidAnswerError,
    ScaffoldError,
    UsageError,
)
from scaffold.questions import asked_questions, load_questions, machine_facts, template_dir

# The messages copier's ValueErrors carry when an answer is not acceptable.
_COPIER_ANSWER_ERROR = re.compile(
    r"^(Validation error for question '(?P<validated>\w+)': "
    r"|Invalid choice for '(?P<choice>\w+)': )"
)
_GIT_FALLBACK_IDENTITY = ("-c", "user.name=scaffold", "-c", "user.email=scaffold@localhost")
# The branch of a project's repository that holds its pristine renders, the base of every update.
PRISTINE_BRANCH = "scaffold/template"


@dataclass(frozen=True)
class NewProject:
    path: Path
    answers: dict[str, Any]  # as recorded in the project's .copier-answers.yml
    git: str  # "committed", "skipped" (--no-git) or "existing repository" (left alone)


def new_project(
    dest: Path | str,
    answers: Mapping[str, Any] | None = None,
    *,
    ask: bool = False,
    force: bool = False,
    git: bool = True,
    template: Path | None = None,
) -> NewProject:
    """Render a project into `dest` and return what was made.

    `answers` maps question names to values (strings are accepted for int questions); copier
    asks the unanswered questions when `ask` (it needs a terminal), else takes their defaults.
    `force` lets a non-empty `dest` take the project's files, as long as no file already there
    would change. Raises a `ScaffoldError`, having written nothing, for any invalid input.
    """
    dest = Path(os.path.realpath(dest))  # staging must share the real DEST's filesystem
    template = template or template_dir()
    data = parse_answers(answers or {}, template)
    data.update(machine_facts())
    existing = _check_destination(dest, force)

    ancestor = next(p for p in dest.parents if p.is_dir())
    staging: Path | None = None
    try:
        with _sigterm_raises_keyboard_interrupt():
            with _signals_deferred():  # an interrupt cannot fall between mkdtemp and `staging =`
                staging = _make_staging(ancestor, dest.name)
            # Rendered under DEST's own name, so copier's default project name is DEST's name.
            rendered = staging / dest.name
            try:
                worker = _run_copier(template, rendered, data, ask=ask)
                if git and not existing:
                    _git_commit(rendered, files=None)
            except KeyboardInterrupt:
                raise Interrupted("interrupted: nothing was written") from None
            with _signals_deferred():
                files = _move_into_place(rendered, dest, existing)
            status = "skipped"
            if git and not existing:
                status = "committed"
            elif git and (dest / ".git").exists():
                status = "existing repository"
            elif git:
                _git_commit(dest, files=files)
                status = "committed"
    finally:
        if staging is not None:
            with _signals_deferred():
                _remove_tree(staging)
    recorded = worker.answers.combined
    return NewProject(
        path=dest,
        answers={q.name: recorded.get(q.name) for q in asked_questions(template)},
        git=status,
    )


def _make_staging(ancestor: Path, name: str) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=f".{name}.scaffold-", dir=ancestor))
    except OSError as err:
        raise ScaffoldError(f"cannot write in {ancestor}: {err.strerror}") from None


def _remove_tree(path: Path, attempts: int = 50) -> None:
    """Remove `path`, retrying while a process that is dying still writes into it."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)


def parse_answers(answers: Mapping[str, Any], template: Path | None = None) -> dict[str, Any]:
    """Check that each answer names a question a person may answer, and turn whole-number text
    into an int for int questions; copier checks choices and validators."""
    questions = load_questions(template)
    parsed = {}
    for name, value in answers.items():
        question = questions.get(name)
        if question is None or question.hidden:
            raise InvalidAnswerError(f"no question named {name!r} in the template")
        if question.type == "int" and isinstance(value, str):
            if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
                raise InvalidAnswerError(f"{question.flag} must be a whole number, got {value!r}")
            value = int(value)
        parsed[name] = value
    return parsed


def _run_copier(template: Path, rendered: Path, data: dict[str, Any], *, ask: bool):
    try:
        return copier.run_copy(
            str(template),
            rendered,
            data=data,
            defaults=not ask,
            quiet=True,
            unsafe=False,
            cleanup_on_error=True,
        )
    except ValueError as err:
        match = _COPIER_ANSWER_ERROR.match(str(err))
        if match is None:
            raise ScaffoldError(f"the template failed to render: {err}") from None
        raise InvalidAnswerError(_answer_error_message(match, str(err), template, data)) from None
    except KeyboardInterrupt:  # copier's CopierAnswersInterrupt is a CopierError too
        raise
    except InteractiveSessionError:
        raise UsageError("no terminal to ask the questions on: pass --defaults") from None
    except CopierError as err:
        raise ScaffoldError(f"the template failed to render: {err}") from None


def _answer_error_message(
    match: re.Match[str], message: str, template: Path, data: Mapping[str, Any]
) -> str:
    """One line naming the flag, from copier's "Validation error for question 'x': ..."."""
    name = match["validated"] or match["choice"]
    detail = message[match.end() :].strip()
    question = load_questions(template).get(name)
    if question is None or question.hidden:
        return f"{name}: {detail}"
    if match["choice"]:
        return f"{question.flag}: {detail}"
    if name == "project_name":  # copier.yml's messages about the name stand on their own
        return detail
    return f"{question.flag} {detail}, got {data.get(name)!r}"


def _check_destination(dest: Path, force: bool) -> bool:
    """Whether `dest` already holds files; raises if it cannot take the project."""
    if dest == dest.parent:
        raise DestinationError(f"{dest} cannot be a project folder")
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"{dest} exists and is not a folder")
    existing = dest.is_dir() and any(dest.iterdir())
    if existing and not force:
        raise DestinationError(
            f"{dest} exists and is not empty: choose a new folder, or pass --force to add the "
            "project's files to it (no existing file is changed)"
        )
    return existing


def _move_into_place(rendered: Path, dest: Path, existing: bool) -> list[Path]:
    """Move the rendered project to `dest`; return its files, relative to `dest`.

    Into a folder that holds files, file by file, after making sure none of them would change.
    """
    files = sorted(p.relative_to(rendered) for p in rendered.rglob("*") if not p.is_dir())
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(rendered, dest)
        return files
    if not existing:  # an empty folder: keep it (it may be someone's working directory)
        for entry in rendered.iterdir():
            os.rename(entry, dest / entry.name)
        return files
    collisions = [f for f in files if _differs(rendered / f, dest / f)]
    if collisions:
        listed = ", ".join(str(f) for f in collisions[:5])
        more = f" and {len(collisions) - 5} more" if len(collisions) > 5 else ""
        raise DestinationError(
            f"{dest} already has files the project would overwrite: {listed}{more}; "
            "nothing was changed"
        )
    for f in files:
        if not (dest / f).exists():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            os.rename(rendered / f, dest / f)
    return files


def _differs(new: Path, old: Path) -> bool:
    """Whether moving `new` to `old` would change or replace anything there."""
    if not old.exists() and not old.is_symlink():
        # A file where the project needs a folder collides too.
        return any(parent.exists() and not parent.is_dir() for parent in old.parents)
    return old.is_symlink() or not old.is_file() or not filecmp.cmp(new, old, shallow=False)


def _git_commit(project: Path, files: list[Path] | None) -> None:
    """Make `project` a git repository with one commit of `files` (None: everything in it).

    That commit is the pristine render too: PRISTINE_BRANCH starts there (see scaffold.update).
    """
    _git(project, "init", "-q")
    identity = () if _git_identity_configured(project) else _GIT_FALLBACK_IDENTITY
    if files is None:
        _git(project, "add", "-A")
    else:
        _git(project, "add", "--", *map(str, files))
    message = f"Initial project from scaffold {__version__}"
    _git(project, *identity, "commit", "-q", "--no-verify", "--no-gpg-sign", "-m", message)
    _git(project, "branch", "--no-track", PRISTINE_BRANCH)


def _git_identity_configured(project: Path) -> bool:
    return all(
        _git(project, "config", "--get", key, check=False).returncode == 0
        for key in ("user.name", "user.email")
    )


def _git(
    project: Path, *args: str, check: bool = True, index: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run git in `project`; `index`: a separate index file, leaving the project's alone."""
    # A GIT_DIR or GIT_WORK_TREE of the calling shell (a git hook, say) must not redirect us.
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARIABLES}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    try:
        process = subprocess.Popen(
            ["git", *args],
            cwd=project,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except FileNotFoundError:
        raise ScaffoldError("git is not installed: install it, or pass --no-git") from None
    try:
        stdout, stderr = process.communicate()
    except BaseException:
        # Interrupted: git must be gone before its folder is removed, or it writes on into it.
        process.kill()
        with _signals_deferred():
            process.wait()
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise ScaffoldError(f"git {args[0]} failed in {project}: {reason}")
    return result


_GIT_LOCATION_VARIABLES = {"GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY"}


@contextlib.contextmanager
def _sigterm_raises_keyboard_interrupt() -> Iterator[None]:
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
def _signals_deferred() -> Iterator[None]:
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
