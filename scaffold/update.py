"""Bring template changes and changed answers into a project whose owner has edited it.

A project's git repository keeps its pristine renders, untouched by anyone, on the branch
`git.PRISTINE_BRANCH`; `scaffold new` starts it at the project's first commit. An update
renders the installed template with the project's saved answers (changed by any given), commits
that tree onto the branch with the previous pristine render as its parent, and `git merge`s the
branch into the current one. Git's three-way merge then takes the previous pristine render as its
base: the owner's edits stay, a file the owner added is not on the branch so is never touched,
and an edit on the same lines as a template change becomes a conflict with git's usual markers.
The base lives in the project's own history, so updates work offline, on a fresh clone and after
scaffold itself was upgraded. Definitions the template moved from one Python file to another are
moved first, on the pristine branch and the owner's (scaffold.moves), so that the merge carries
the owner's edits of them along.

copier's own `run_update` cannot do this: it re-renders the old version from the template's
git history (`_commit` in the answers file), and scaffold's template is installed as package
data, without git history; nor would an old version be there after an upgrade or on another
machine.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scaffold import __version__, git, moves
from scaffold.errors import InvalidAnswerError, ScaffoldError, UsageError
from scaffold.git import PRISTINE_BRANCH
from scaffold.interrupts import signals_ignored
from scaffold.questions import (
    Question,
    answers_file,
    asked_questions,
    load_questions,
    machine_facts,
    package_name,
    project_answers,
    template_dir,
)
from scaffold.render import parse_answers, run_copier

_PRISTINE_REF = f"refs/heads/{PRISTINE_BRANCH}"
# How to mend a damaged answers file: the pristine branch holds the one the last render wrote.
_RESTORE = f"restore it from git ({PRISTINE_BRANCH} holds the last render's copy)"


@dataclass(frozen=True)
class Update:
    path: Path
    status: str  # "up to date", "merged" or "conflicts"
    branch: str  # what was merged into: the current branch, or a commit when HEAD is detached
    # answer: (saved, now), for each answer changed by a flag and each new question's default
    changed_answers: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # "merged": the files the update changed; "conflicts": the files left with conflicts
    files: list[str] = field(default_factory=list)
    # the moves committed on `branch` before the merge: 'train_step from A to B'
    moved: list[str] = field(default_factory=list)


def update_project(
    project: Path | str,
    answers: Mapping[str, Any] | None = None,
    *,
    template: Path | None = None,
) -> Update:
    """Merge a fresh render of `template` (default: the installed one) into `project`.

    The render takes the project's saved answers, changed by `answers`; questions the project
    was never asked take their defaults. Raises a `ScaffoldError`, having changed nothing, when
    the project cannot be updated (not a scaffold project in git, uncommitted changes, a merge
    in progress, a damaged answers file, an invalid answer). Conflicts are not an error: the
    returned status says so. Ctrl-C or SIGTERM stops it only before the merge begins (a
    KeyboardInterrupt, nothing changed); from there on they are ignored until the merge ends.
    """
    project = Path(os.path.realpath(project))
    template = template or template_dir()
    changes = parse_answers(answers or {}, template)
    _check_repository(project, template)
    previous = _pristine_tip(project)
    saved = _saved_answers(project, template, previous, changes)
    data = {**saved, **changes}

    with tempfile.TemporaryDirectory(prefix="scaffold-update-") as scratch:
        rendered = Path(scratch) / project.name
        try:
            worker = run_copier(template, rendered, {**data, **_machine_facts(data)}, ask=False)
        except InvalidAnswerError as err:
            if changes or err.question not in saved:  # a flag may have made the mix invalid
                raise
            question = load_questions(template)[err.question]
            raise _damaged(project, template, question, saved[question.name], err.reason) from None
        tree = git.store_tree(project, rendered, index=Path(scratch) / "index")
    now = worker.answers.combined
    changed = {
        q.name: (saved.get(q.name), now.get(q.name))
        for q in asked_questions(template)
        if q.name not in saved or saved[q.name] != now.get(q.name)
    }
    branch = git.current_branch(project)

    head = git.run(project, "rev-parse", "HEAD").stdout.strip()
    if tree == git.run(project, "rev-parse", f"{previous}^{{tree}}").stdout.strip():
        if git.is_ancestor(project, previous, head):
            return Update(project, "up to date", branch, changed)
        with signals_ignored():  # a merge cut short leaves a half-written tree: once begun, it ends
            return _merge(project, previous, head, branch, changed)
    moved = moves.follow(project, previous, tree, head)
    pristine = _commit_render(project, tree, moved.base if moved else previous, now, template)
    with signals_ignored():
        if moved is None:
            return _merge(project, pristine, head, branch, changed)
        kept = _local_pristine(project)
        _fast_forward(project, moved)
        try:
            return _merge(project, pristine, head, branch, changed, moved.lines())
        except BaseException:
            _put_back(project, head, kept)
            raise


def _check_repository(project: Path, template: Path) -> None:
    if not (project / answers_file(template)).is_file():
        raise UsageError(f"{project} is not a scaffold project: it has no {answers_file(template)}")
    top = git.run(project, "rev-parse", "--show-toplevel", check=False)
    if top.returncode != 0 or Path(os.path.realpath(top.stdout.strip())) != project:
        raise UsageError(
            f"{project} is not a git repository, so it has no pristine render to merge from: "
            "scaffold update needs a project made by `scaffold new` without --no-git"
        )
    if git.run(project, "rev-parse", "-q", "--verify", "MERGE_HEAD", check=False).returncode == 0:
        raise UsageError(
            f"a merge is in progress in {project}: finish it (git commit) or abort it "
            "(git merge --abort), then run scaffold update again"
        )
    # --no-optional-locks: a refused project is left byte for byte as it was, its index too.
    status = ("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    dirty = git.run(project, *status).stdout.splitlines()
    if dirty:
        raise UsageError(
            f"{project} has uncommitted changes ({len(dirty)} files, such as "
            f"{dirty[0][3:]}): commit or stash them, then run scaffold update again; "
            "nothing was changed"
        )


def _pristine_tip(project: Path) -> str:
    """The newest pristine render: the local branch, or a remote's copy of it (a fresh clone
    has only `origin/<branch>`; a remote's may also be ahead, pushed from another machine)."""
    refs = git.run(project, "for-each-ref", "--format=%(refname) %(objectname)", "refs/").stdout
    tips = {}
    for line in refs.splitlines():
        name, sha = line.split()
        if name == _PRISTINE_REF or (
            name.startswith("refs/remotes/") and name.split("/", 3)[-1] == PRISTINE_BRANCH
        ):
            tips[name] = sha
    if not tips:
        raise UsageError(
            f"{project} has no {PRISTINE_BRANCH} branch, which holds the pristine renders that "
            f"updates merge from: in a clone, fetch it (git fetch origin {PRISTINE_BRANCH})"
        )
    tip = tips.get(_PRISTINE_REF) or tips.get(f"refs/remotes/origin/{PRISTINE_BRANCH}")
    tip = tip or next(iter(tips.values()))
    for other in tips.values():  # fast-forward to a remote copy that is strictly ahead
        if other != tip and git.is_ancestor(project, tip, other):
            tip = other
    return tip


def _saved_answers(
    project: Path, template: Path, previous: str, changes: Mapping[str, Any]
) -> dict[str, Any]:
    """The project's recorded answers to the questions `template` still asks, checked.

    The rule: each answer the last pristine render (`previous`) recorded must still be in the
    answers file, and each saved answer that no flag replaces must be a value its question
    takes (copier then runs the validators). A missing answer would quietly take its default:
    a regression project read as classification has its data and model rewritten and its
    tracker dropped. Only questions the template added since that render take their defaults.
    That render's record is the reference because nobody edits the pristine branch; when it
    cannot be read, every question the template asks needs an answer.
    """
    path = project / answers_file(template)
    recorded = project_answers(project, template)
    asked = {q.name: q for q in asked_questions(template)}
    answered = _answered_by(project, previous, template)
    needed = [name for name in asked if name in answered]
    missing = [name for name in needed if name not in recorded]
    if missing:
        what = "no answers" if missing == needed else f"no answer for {', '.join(missing)}"
        raise UsageError(f"{path} has {what}: {_RESTORE}, then run again")
    saved = {name: recorded[name] for name in asked if name in recorded}
    for name, value in saved.items():
        reason = None if name in changes else _not_taken(asked[name], value)
        if reason:
            raise _damaged(project, template, asked[name], value, reason)
    return saved


def _damaged(
    project: Path, template: Path, question: Question, value: Any, reason: str
) -> UsageError:
    """The refusal of a saved answer that `question` does not take."""
    flag = question.flag
    if question.type == "bool":
        flag += f"/--no-{flag.removeprefix('--')}"
    return UsageError(
        f"{project / answers_file(template)} has {question.name}: {value!r} ({reason}): "
        f"{_RESTORE} or pass {flag}, then run again"
    )


def _answered_by(project: Path, render: str, template: Path) -> set[str]:
    """The questions the answers file of the pristine `render` answers (all: unreadable)."""
    shown = git.run(project, "show", f"{render}:{answers_file(template)}", check=False)
    try:
        answers = yaml.safe_load(shown.stdout) if shown.returncode == 0 else None
    except yaml.YAMLError:
        answers = None
    asked = {q.name for q in asked_questions(template)}
    return set(answers) & asked if isinstance(answers, dict) else asked


def _not_taken(question: Question, value: Any) -> str | None:
    """Why `question` does not take `value` (its validator aside), or None."""
    if value is None:
        return "no value"
    if question.choices:
        if value in question.values:
            return None
        return f"not one of {', '.join(map(str, question.values))}"
    if question.type == "bool" and not isinstance(value, bool):
        return "not true or false"
    if question.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return "not a whole number"
    if question.type == "str" and not isinstance(value, str):
        return "not text"
    return None


def _machine_facts(data: Mapping[str, Any]) -> dict[str, Any]:
    """This machine's facts, except that the project's own package may be installed here."""
    facts = dict(machine_facts())
    if "project_name" in data:
        own = package_name(str(data["project_name"]))
        facts["unavailable_packages"] = [n for n in facts["unavailable_packages"] if n != own]
    return facts


def _commit_render(
    project: Path, tree: str, parent: str, answers: Mapping[str, Any], template: Path
) -> str:
    listed = "\n".join(f"{q.name}: {answers.get(q.name)}" for q in asked_questions(template))
    message = f"Render the template of scaffold {__version__}\n\nAnswers:\n{listed}\n"
    result = git.run(
        project, *git.identity(project), "commit-tree", "--no-gpg-sign", tree, "-p", parent,
        "-m", message,
    )  # fmt: skip
    return result.stdout.strip()


def _fast_forward(project: Path, moved: moves.Moved) -> None:
    """Move the current branch, index and files to the commit of the template's moves."""
    done = git.run(project, "merge", "-q", "--ff-only", "--no-autostash", moved.ours, check=False)
    if done.returncode != 0:
        raise ScaffoldError(
            f"git refused to move {'; '.join(moved.lines())} in {project} before the merge, "
            f"and nothing was changed: {_git_says(done)}"
        )


def _git_says(result: subprocess.CompletedProcess[str]) -> str:
    """What git printed on refusing, in one line."""
    lines = (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()
    return " ".join(line.strip() for line in lines)


def _put_back(project: Path, head: str, kept: str) -> None:
    """After a failure past `_fast_forward`: the branch, index and files back at `head`, no
    merge in progress (the tree was clean: `_check_repository`), the pristine branch at `kept`."""
    git.run(project, "reset", "-q", "--merge", head)
    if kept:
        git.run(project, "update-ref", "-m", "scaffold update: put back", _PRISTINE_REF, kept)
    else:
        git.run(project, "update-ref", "-d", _PRISTINE_REF)


def _local_pristine(project: Path) -> str:
    """The local pristine branch's commit; empty when it exists only as a remote's copy."""
    found = git.run(project, "rev-parse", "-q", "--verify", _PRISTINE_REF, check=False)
    return found.stdout.strip()


def _merge(
    project: Path,
    pristine: str,
    before: str,
    branch: str,
    changed: dict[str, tuple[Any, Any]],
    moved: list[str] | None = None,
) -> Update:
    """Merge `pristine` into HEAD; move the pristine branch there once the merge has begun.
    `before`: the commit HEAD was at before the update."""
    message = f"Update from the template of scaffold {__version__}"
    merged = git.run(
        project, *git.identity(project), "merge", "--no-ff", "--no-edit", "--no-verify",
        "--no-gpg-sign", "--no-autostash", "-m", message, pristine, check=False,
    )  # fmt: skip
    in_progress = git.run(project, "rev-parse", "-q", "--verify", "MERGE_HEAD", check=False)
    if merged.returncode != 0 and in_progress.returncode != 0:
        raise ScaffoldError(
            f"git merge refused to update {project}, and nothing was changed: {_git_says(merged)}"
        )
    old = _local_pristine(project)
    git.run(project, "update-ref", "-m", "scaffold update", _PRISTINE_REF, pristine, old)
    if merged.returncode != 0:
        conflicts = git.run(project, "diff", "--name-only", "--diff-filter=U").stdout.splitlines()
        return Update(project, "conflicts", branch, changed, conflicts, moved or [])
    files = git.run(project, "diff", "--name-only", before, "HEAD").stdout.splitlines()
    return Update(project, "merged", branch, changed, files, moved or [])
