"""Render a new project from the template: all of it, or nothing.

copier renders into a fresh folder beside DEST (same filesystem); only a complete render,
already committed to git, is renamed into place. An invalid answer, an error, Ctrl-C or SIGTERM
leaves DEST as it was.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from copier.errors import CopierError, InteractiveSessionError

from scaffold import __version__, _compat
from scaffold.errors import (
    DestinationError,
    Interrupted,
    InvalidAnswerError,
    ScaffoldError,
    UsageError,
)
from scaffold.git import commit_first_render
from scaffold.interrupts import signals_deferred, sigterm_raises_keyboard_interrupt
from scaffold.questions import asked_questions, load_questions, machine_facts, template_dir

# The longest path the system takes, counting the closing NUL byte.
_PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 260


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

    ancestor = _nearest_folder(dest)
    staging: Path | None = None
    try:
        with sigterm_raises_keyboard_interrupt():
            with signals_deferred():  # an interrupt cannot fall between mkdtemp and `staging =`
                staging = _make_staging(ancestor, dest.name)
            # Rendered under DEST's own name, so copier's default project name is DEST's name.
            rendered = staging / dest.name
            try:
                worker = run_copier(template, rendered, data, ask=ask)
                if git and not existing:
                    commit_first_render(rendered, files=None, message=_first_message())
            except KeyboardInterrupt:
                raise Interrupted("interrupted: nothing was written") from None
            except OSError as err:  # a full or read-only disk while rendering into the staging
                where = f"{err.filename}: " if err.filename else ""
                raise ScaffoldError(
                    f"cannot write the project: {where}{err.strerror}; nothing was written"
                ) from None
            with signals_deferred():
                files = _move_into_place(rendered, dest, existing)
            status = "skipped"
            if git and not existing:
                status = "committed"
            elif git and (dest / ".git").exists():
                status = "existing repository"
            elif git:
                commit_first_render(dest, files=files, message=_first_message())
                status = "committed"
    finally:
        if staging is not None:
            with signals_deferred():
                _remove_tree(staging)
    recorded = worker.answers.combined
    return NewProject(
        path=dest,
        answers={q.name: recorded.get(q.name) for q in asked_questions(template)},
        git=status,
    )


def _make_staging(ancestor: Path, name: str) -> Path:
    try:
        # Shortened: the staging folder's name must fit where DEST's own (up to the limit) fits.
        return Path(tempfile.mkdtemp(prefix=f".{name[:32]}.scaffold-", dir=ancestor))
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


def run_copier(template: Path, rendered: Path, data: dict[str, Any], *, ask: bool) -> Any:
    """Render `template` into the new folder `rendered` with copier; returns copier's worker
    (its `answers.combined` are the answers recorded). Errors become `ScaffoldError`s."""
    try:
        return _compat.run_copy(
            str(template),
            rendered,
            data=data,
            defaults=not ask,
            quiet=True,
            unsafe=False,
            cleanup_on_error=True,
        )
    except KeyboardInterrupt:  # copier's CopierAnswersInterrupt is a CopierError too
        raise
    except InteractiveSessionError:
        raise UsageError("no terminal to ask the questions on: pass --defaults") from None
    except CopierError as err:  # the template is broken: ConfigFileError and the like
        raise ScaffoldError(f"the template failed to render: {err}") from None
    except ValueError as err:  # copier's questionnaire refused an answer
        refused = _compat.answer_error(err)
        if refused is None:
            raise ScaffoldError(f"the template failed to render: {err}") from None
        message = _answer_error_message(refused, template, data)
        raise InvalidAnswerError(message, refused.question, refused.detail) from None


def _answer_error_message(
    refused: _compat.AnswerError, template: Path, data: Mapping[str, Any]
) -> str:
    """One line naming the flag, from copier's "Validation error for question 'x': ..."."""
    question = load_questions(template).get(refused.question)
    if question is None or question.hidden:
        return f"{refused.question}: {refused.detail}"
    if refused.kind == "choice":
        return f"{question.flag}: {refused.detail}"
    if question.name == "project_name":  # copier.yml's messages about the name stand on their own
        return refused.detail
    return f"{question.flag} {refused.detail}, got {data.get(question.name)!r}"


def _check_destination(dest: Path, force: bool) -> bool:
    """Whether `dest` already holds files; raises if it cannot take the project."""
    if dest == dest.parent:
        raise DestinationError(f"{dest} cannot be a project folder")
    ancestor = _nearest_folder(dest)
    longest = os.pathconf(ancestor, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    parts = dest.relative_to(ancestor).parts
    for part in parts:
        if len(os.fsencode(part)) > longest:
            raise DestinationError(
                f"the folder name {part[:20]}... is {len(os.fsencode(part))} bytes, longer than"
                f" this file system allows ({longest}): choose a shorter DEST"
            )
    size = len(os.fsencode(dest))
    if size >= _PATH_MAX:  # every later look at DEST would fail with "File name too long"
        raise DestinationError(
            f"DEST is {size} bytes long as a full path, longer than this system allows"
            f" ({_PATH_MAX - 1}): choose a shorter DEST"
        )
    if len(parts) > 1 and os.path.lexists(ancestor / parts[0]):
        raise DestinationError(f"{ancestor / parts[0]} is not a folder: DEST cannot be inside it")
    # The render is staged in `ancestor`, then moved from there into DEST.
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot write in {ancestor}: choose a DEST you can write in")
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"{dest} exists and is not a folder")
    if dest.is_dir() and not os.access(dest, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot write in {dest}: choose a DEST you can write in")
    existing = dest.is_dir() and any(dest.iterdir())
    if existing and not force:
        raise DestinationError(
            f"{dest} exists and is not empty: choose a new folder, or pass --force to add the "
            "project's files to it (no existing file is changed)"
        )
    return existing


def _nearest_folder(dest: Path) -> Path:
    """The deepest existing folder above `dest`, where its missing folders are made."""
    return next(parent for parent in dest.parents if _is_folder(parent))


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the file system, a folder we may not look in
        return False


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


def _first_message() -> str:
    return f"Initial project from scaffold {__version__}"
