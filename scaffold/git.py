"""git, as scaffold runs it: a project's first commit, and the plumbing `scaffold update` uses.

Every call goes through `run`: git's own location variables of the calling shell are ignored,
an interrupted git is waited for before its folder can be removed, and a failure becomes a
`ScaffoldError` naming the git command.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from scaffold.errors import ScaffoldError
from scaffold.interrupts import signals_deferred

# The branch of a project's repository that holds its pristine renders, the base of every update.
PRISTINE_BRANCH = "scaffold/template"
# Who commits where git has no user.name and user.email configured (a fresh container, CI).
_FALLBACK_IDENTITY = ("-c", "user.name=scaffold", "-c", "user.email=scaffold@localhost")
# A GIT_DIR or GIT_WORK_TREE of the calling shell (a git hook, say) must not redirect us.
_LOCATION_VARIABLES = {"GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY"}


def run(
    project: Path,
    *args: str,
    check: bool = True,
    index: Path | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run git in `project`; `index`: a separate index file, leaving the project's alone;
    `input`: what git reads on its standard input (none by default)."""
    env = {k: v for k, v in os.environ.items() if k not in _LOCATION_VARIABLES}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    try:
        process = subprocess.Popen(
            ["git", *args],
            cwd=project,
            env=env,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except FileNotFoundError:
        raise ScaffoldError("git is not installed: install it, or pass --no-git") from None
    try:
        stdout, stderr = process.communicate(input)
    except BaseException:
        # Interrupted: git must be gone before its folder is removed, or it writes on into it.
        process.kill()
        with signals_deferred():
            process.wait()
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise ScaffoldError(f"git {args[0]} failed in {project}: {reason}")
    return result


def identity(project: Path) -> tuple[str, ...]:
    """Options for a git command that commits in `project`: none when git knows who commits,
    else scaffold's own name and address."""
    configured = run(project, "config", "--get-regexp", r"^user\.(name|email)$", check=False)
    keys = {line.split(" ", 1)[0].lower() for line in configured.stdout.splitlines()}
    return () if keys >= {"user.name", "user.email"} else _FALLBACK_IDENTITY


def commit_first_render(project: Path, *, files: list[Path] | None, message: str) -> None:
    """Make `project` a git repository with one commit of `files` (None: everything in it).

    That commit is the pristine render too: PRISTINE_BRANCH starts there (see scaffold.update).
    """
    run(project, "init", "-q")
    if files is None:
        run(project, "add", "-A")
    else:
        run(project, "add", "--", *map(str, files))
    commit = ("commit", "-q", "--no-verify", "--no-gpg-sign", "-m", message)
    run(project, *identity(project), *commit)
    run(project, "branch", "--no-track", PRISTINE_BRANCH)


def enclosing_repository(path: Path) -> Path | None:
    """The git work tree that `path` lies inside (the nearest folder above it holding .git), if
    any: a project rendered there is a repository nested in another one's checkout."""
    return next((folder for folder in path.parents if (folder / ".git").exists()), None)


def current_branch(project: Path) -> str:
    """The checked-out branch, or the commit when HEAD is detached."""
    result = run(project, "symbolic-ref", "-q", "--short", "HEAD", check=False)
    if result.returncode == 0:
        return result.stdout.strip()
    return run(project, "rev-parse", "--short", "HEAD").stdout.strip()


def is_ancestor(project: Path, ancestor: str, descendant: str) -> bool:
    result = run(project, "merge-base", "--is-ancestor", ancestor, descendant, check=False)
    return result.returncode == 0


def store_tree(project: Path, files: Path, *, index: Path) -> str:
    """Store the files under `files` in `project`'s repository; return their tree's id.

    A separate index and work tree: the project's own index and files are not touched.
    """
    git_dir = run(project, "rev-parse", "--absolute-git-dir").stdout.strip()
    elsewhere = ("--git-dir", git_dir, "--work-tree", str(files))
    run(files, *elsewhere, "add", "-A", index=index)
    return run(files, *elsewhere, "write-tree", index=index).stdout.strip()
