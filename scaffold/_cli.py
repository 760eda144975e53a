"""The `scaffold` command line: flags mapped to library calls, errors mapped to exit codes.

The answer flags of `new` (--name, --task, --device, ...) are made from templates/copier.yml
when this module is imported: one option a question, its choices as an enum.
"""

import enum
import functools
import importlib
import inspect
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

# Only what building the command line needs is imported here; each command imports what it runs
# (copier, the matrix's runner), so that `scaffold new` loads no more than a render needs.
from scaffold import __version__, questions
from scaffold.errors import Interrupted, ScaffoldError

# The click that typer runs on: the `click` package, or the copy newer typers carry inside.
_click_errors = importlib.import_module(typer.BadParameter.__module__)

app = typer.Typer(
    name="scaffold",
    help="Generate a standalone PyTorch training project that carries its own checks.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _choice_enum(question: questions.Question) -> type[enum.Enum]:
    """The values of a choice question, as the enum typer turns into a choice of flag values."""
    values = [str(value) for value in question.values]
    return enum.Enum(question.name.title().replace("_", ""), {v: v for v in values}, type=str)


def _answer_parameters() -> Iterator[inspect.Parameter]:
    """One keyword-only option a question that a person answers, in copier.yml's order."""
    for question in questions.asked_questions():
        if question.choices:
            kind: Any = _choice_enum(question)
            declaration = question.flag
        elif question.type == "bool":
            kind = bool
            declaration = f"{question.flag}/--no-{question.flag.removeprefix('--')}"
        else:  # text, and whole numbers checked by render.parse_answers for a clearer message
            kind = str
            declaration = question.flag
        metavar = {"int": "N", "str": "TEXT"}.get(question.type) if not question.choices else None
        option = typer.Option(declaration, help=question.help, show_default=False, metavar=metavar)
        yield inspect.Parameter(
            question.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[kind | None, option],
        )


def _with_answer_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` the answer options; it receives the given ones as `answers`."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "answers"]
    extra = list(_answer_parameters())
    names = [p.name for p in extra]
    clash = set(names) & {p.name for p in own}
    assert not clash, f"copier.yml questions clash with options of {command.__name__}: {clash}"

    @functools.wraps(command)
    def with_answers(**kwargs: Any) -> Any:
        answers = {}
        for name in names:
            value = kwargs.pop(name)
            if value is not None:
                answers[name] = value.value if isinstance(value, enum.Enum) else value
        return command(answers=answers, **kwargs)

    with_answers.__signature__ = signature.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return with_answers


def _print_version(wanted: bool) -> None:
    if wanted:
        print(f"scaffold {__version__}")
        raise typer.Exit()


@app.callback()
def _scaffold(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print scaffold's version and exit", callback=_print_version
        ),
    ] = False,
) -> None:
    pass


_Device = _choice_enum(questions.load_questions()["device"])


@app.command()
@_with_answer_options
def new(
    dest: Annotated[
        Path,
        typer.Argument(metavar="DEST", help="Folder to create the project in", show_default=False),
    ],
    defaults: Annotated[
        bool, typer.Option("--defaults", help="Ask nothing: unanswered questions take defaults")
    ] = False,
    run_check: Annotated[
        bool, typer.Option("--check", help="Then run the project's checks, exit with their status")
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Add to a non-empty DEST (never changes a file there)"),
    ] = False,
    git: Annotated[
        bool, typer.Option("--git/--no-git", help="Make the project a git repository")
    ] = True,
    *,
    answers: dict[str, Any],
) -> int:
    """Create a project in DEST. On a terminal, asks every question no flag answers."""
    from scaffold import check, render
    from scaffold.git import enclosing_repository

    ask = not defaults and sys.stdin.isatty() and sys.stdout.isatty()
    project = render.new_project(dest, answers, ask=ask, force=force, git=git)
    name = project.answers.get("project_name", project.path.name)
    print(f"Created {name} in {project.path}" + _GIT_NOTES.get(project.git, ""))
    outer = enclosing_repository(project.path)
    if outer is not None:  # a nested repository: the checkout's `git status` lists it
        _note(f"note: rendered into {project.path}, inside the git repository {outer}")
    if run_check:
        return check.run_checks(project.path, say=_note)
    return 0


_GIT_NOTES = {
    "committed": ", a git repository with its first commit",
    "existing repository": " (its git repository was left as it was: commit when you like)",
}


@app.command("check")
def check_(
    directory: Annotated[
        Path,
        typer.Argument(metavar="DIR", help="A project made by scaffold new", show_default=False),
    ],
    device: Annotated[
        _Device | None,  # type: ignore[valid-type]
        typer.Option(help="Run on this device (default: the project's, else cpu)"),
    ] = None,
) -> int:
    """Run a project's checks (`python -m <pkg> check all`) and exit with their status."""
    from scaffold import check

    return check.run_checks(directory, device.value if device else None, say=_note)


@app.command("update")
@_with_answer_options
def update_(
    directory: Annotated[
        Path,
        typer.Argument(metavar="DIR", help="A project made by scaffold new", show_default=False),
    ],
    *,
    answers: dict[str, Any],
) -> int:
    """Merge the template's changes, and answers changed by flags, into the project in DIR.

    A git three-way merge: your edits stay. Commit your changes first.
    """
    from scaffold.interrupts import signals_deferred, sigterm_raises_keyboard_interrupt

    try:
        with sigterm_raises_keyboard_interrupt():
            with signals_deferred():  # a Ctrl-C inside an import can surface as a RuntimeError
                from scaffold import update
            result = update.update_project(directory, answers)
    except KeyboardInterrupt:  # typer would exit 130 without a word
        raise Interrupted("interrupted before the merge began: nothing was changed") from None
    for name, (saved, now) in result.changed_answers.items():
        print(f"{name}: {saved} -> {now}" if saved is not None else f"{name}: {now} (new)")
    if result.status == "up to date":
        print(f"Nothing to update: {result.path} already has this template and these answers")
        return 0
    if result.status == "merged":
        count = len(result.files)
        print(
            f"Updated {result.path}: merged the new render into {result.branch} "
            f"({count} file{'s' if count != 1 else ''} changed: git show --stat)"
        )
        _print_moves(result.moved)
        return 0
    _print_moves(result.moved)
    _note(f"error: the update conflicts with edits in {result.path}; git left conflict markers in:")
    for name in result.files:
        _note(f"    {name}")
    kept = " (the commit of the moves before it stays)" if result.moved else ""
    _note(
        "Resolve each conflict, then `git add` those files and `git commit` to finish the "
        f"update; or undo it with `git merge --abort`{kept}."
    )
    return 1


def _print_moves(moved: list[str]) -> None:
    """The template's moves that `update` made in a commit of its own before the merge."""
    for line in moved:
        print(f"  moved {line} as the template did, in a commit before the merge")


@app.command("matrix")
def matrix_(
    jobs: Annotated[
        int | None,
        typer.Option("--jobs", "-j", min=1, help="Combinations run at once (default: CPU count)"),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only", metavar="KEY=VALUE", help="Only combinations with this answer (repeatable)"
        ),
    ] = None,
    list_: Annotated[
        bool, typer.Option("--list", help="Print the combinations, one a line, and run nothing")
    ] = False,
    shard: Annotated[
        str | None,
        typer.Option("--shard", metavar="I/N", help="Run slice I of N (1 <= I <= N)"),
    ] = None,
    junit: Annotated[
        Path | None, typer.Option("--junit", metavar="FILE", help="Write a JUnit XML report")
    ] = None,
    native_device: Annotated[
        bool,
        typer.Option(
            "--native-device",
            help="Run the checks on each project's own device (default: --device cpu)",
        ),
    ] = False,
    workdir: Annotated[
        Path | None,
        typer.Option("--workdir", metavar="DIR", help="Render here (default: a temporary folder)"),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep every rendered project, not only failing ones")
    ] = False,
    timeout: Annotated[
        float,
        typer.Option("--timeout", metavar="SECONDS", help="Fail a check running longer than this"),
    ] = 900,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Run each check as a fresh `python -m <pkg> check all` (ddp ones under the "
            "project's torchrun), not forked from a worker that loaded torch once",
        ),
    ] = False,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="Run check all on every combination (default: the plan of "
            "scaffold/matrix/plan.py, from each answer's declaration)",
        ),
    ] = False,
) -> int:
    """Render, lint and check every valid combination of answers (or those --only selects)."""
    from scaffold import matrix

    combos = matrix.select(matrix.combinations(), only or [])
    if shard:
        combos = matrix.shard(combos, shard)
    if list_:
        for answers in combos:
            print(" ".join(f"{k}={matrix.spelling(v)}" for k, v in answers.items()))
        return 0
    if not combos:
        _note("no combination matches")
        return 0
    live = sys.stderr.isatty()
    started = time.perf_counter()
    failed = 0

    def on_done(outcome: matrix.Outcome, done: int, total: int) -> None:
        nonlocal failed
        failed += not outcome.passed
        line = matrix.progress_line(outcome, done, total, failed, time.perf_counter() - started)
        if live:
            width = shutil.get_terminal_size().columns - 1
            sys.stderr.write("\r\033[K" + line[:width])
            sys.stderr.flush()
        else:
            _note(line)

    _note(f"matrix: {len(combos)} combinations, {jobs or os.cpu_count()} at a time")
    outcomes = matrix.run_matrix(
        combos,
        jobs=jobs,
        workdir=workdir,
        native_device=native_device,
        keep=keep,
        timeout=timeout,
        fresh=fresh,
        full=full,
        on_done=on_done,
    )
    wall = time.perf_counter() - started
    if live:
        sys.stderr.write("\n")
    print(matrix.summary(outcomes, wall))
    if junit:
        matrix.write_junit(outcomes, junit, wall)
    return 1 if any(not o.passed for o in outcomes) else 0


@app.command()
def options() -> int:
    """List every question `scaffold new` asks, with its choices and default."""
    defaults = questions.resolved_defaults()
    for question in questions.asked_questions():
        print(questions.describe(question, defaults.get(question.name)))
    return 0


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_NoArgsIsHelp = getattr(_click_errors, "NoArgsIsHelpError", ())  # click >= 8.2


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line; every error becomes one `error: ...` line and an exit code."""
    try:
        result = app(args=argv, prog_name="scaffold", standalone_mode=False)
    except ScaffoldError as err:
        return _error(str(err), err.exit_code)
    except _NoArgsIsHelp as err:
        print(err.format_message())
        return 0
    except _click_errors.ClickException as err:  # unknown flag, bad choice, missing DEST
        return _error(err.format_message(), err.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        return _error("interrupted", 130)
    if result == 130:  # typer's return for a Ctrl-C it caught (or a project's interrupted checks)
        return _error("interrupted", 130)
    return result if isinstance(result, int) else 0


def _error(message: str, exit_code: int) -> int:
    print("error: " + " ".join(message.split()), file=sys.stderr, flush=True)
    return exit_code


def main() -> None:
    """For a `scaffold` script installed before the entry point became scaffold.__main__:main."""
    from scaffold import __main__

    __main__.main()
