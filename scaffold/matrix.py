"""The combination matrix: every valid combination of answers, rendered, linted and checked.

The combinations come from templates/copier.yml alone: the product of every asked question's
values, less those copier's own validators refuse (choice validators such as "ddp is not for
mps"). Each combination is rendered, linted as rendered, and its project's `check all` is run,
in parallel; `scaffold matrix` is the command line over `run_matrix`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import itertools
import multiprocessing.util
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from scaffold.errors import ScaffoldError, UsageError
from scaffold.questions import Question, asked_questions, package_name, template_dir

# Integer questions have no choices to enumerate; DESIGN.md fixes the values the matrix takes.
INT_VALUES = {"grad_accum_steps": (1, 4)}

# copier.yml's longest project name: rendered lines must stay within the line length with it.
LONGEST_NAME = "a-long-project-name-to-fill-forty-chars1"

# Smaller sizes for the checks in the matrix, passed as the project's own config options (each
# group only where the project's Config has all its fields). The checks stay exactly as strict:
# the same overfit target, the same bit-for-bit resume, the same loader-versus-compute
# comparison, the same steps (the resume check's follow from the accumulation, not the batch).
# - Micro-batches of 8, the overfit check's batch: the compiled step is traced once for both,
#   and fp16, which the CPU runs slowly, took 90 ms a step at 256 x 4 (9 s of checks, now 1).
# - A validation split of 1%: each of the resume check's validations went over all of it (978
#   windows of text, most of that check's time).
# - The transformer's defaults take minutes on a CPU: one layer 64 wide over 16 characters. Its
#   overfit then takes ~70 steps, not ~30 (of at most 300), but each step a quarter of the time:
#   with fp16, which the CPU runs slowly, its checks took 15 s at width 128, 6 s at 64. The
#   MLPs keep their sizes (their overfit passes in 4 steps; a narrower MLP needs ~35).
CHECK_SIZES = (
    {"batch_size": 8, "val_fraction": 0.01},
    {"n_layer": 1, "block_size": 16, "n_embd": 64},
)

STEPS = ("render", "lint", "check")
_TAIL_LINES = 40


def _values(question: Question) -> tuple[Any, ...]:
    if question.choices:
        return question.values
    if question.type == "bool":
        return (False, True)
    if question.name in INT_VALUES:
        return INT_VALUES[question.name]
    raise ValueError(f"no matrix values for question {question.name!r} ({question.type})")


def _matrix_questions(template: Path | None) -> list[Question]:
    return [q for q in asked_questions(template) if q.name != "project_name"]


def all_combinations(template: Path | None = None) -> list[dict[str, Any]]:
    """Every combination of the asked questions' values (the project name aside), in file order,
    valid or not."""
    questions = _matrix_questions(template)
    names = [q.name for q in questions]
    return [
        dict(zip(names, values, strict=True))
        for values in itertools.product(*(_values(q) for q in questions))
    ]


def combinations(template: Path | None = None) -> list[dict[str, Any]]:
    """Every valid combination, in file order: those copier's validators accept."""
    validate = _copier_validator(template or template_dir())
    return [answers for answers in all_combinations(template) if validate(answers) is None]


def _copier_validator(template: Path) -> Callable[[dict[str, Any]], str | None]:
    """A function that answers None when copier accepts `answers`, else copier's message.

    It runs copier's own questionnaire (`Worker._ask`: choices, choice validators, validators)
    with `answers` as data and defaults for the rest, without rendering a file. One worker
    serves every call; its Jinja environment caches compiled expressions (they are pure).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from copier._main import Worker

    probe = Path(tempfile.gettempdir()) / "scaffold-matrix-probe" / "probe"
    worker = Worker(src_path=str(template), dst_path=probe, defaults=True, quiet=True)
    env = worker.jinja_env
    env.from_string = functools.lru_cache(maxsize=None)(env.from_string)  # type: ignore[method-assign]

    def validate(answers: dict[str, Any]) -> str | None:
        worker.data = dict(answers)
        try:
            worker._ask()
        except ValueError as err:
            return str(err)
        return None

    return validate


def combination_id(answers: dict[str, Any]) -> str:
    """A short readable name: classification-none-cpu-fp32-grad1-nocompile."""
    parts = []
    for name, value in answers.items():
        if isinstance(value, bool):
            parts.append(name if value else f"no{name}")
        elif isinstance(value, int):
            parts.append(f"{name.split('_')[0]}{value}")
        else:
            parts.append(str(value))
    return "-".join(parts)


def select(
    combos: Sequence[dict[str, Any]], only: Iterable[str], template: Path | None = None
) -> list[dict[str, Any]]:
    """The combinations matching every KEY=VALUE of `only` (keys and values from copier.yml)."""
    questions = {q.name: q for q in _matrix_questions(template)}
    wanted: dict[str, Any] = {}
    for item in only:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in questions:
            known = ", ".join(questions)
            raise UsageError(f"--only {item!r}: expected KEY=VALUE with KEY one of {known}")
        values = _values(questions[key])
        matches = [v for v in values if _spelled(v, text.strip())]
        if not matches:
            listed = ", ".join(_spelling(v) for v in values)
            raise UsageError(f"--only {item!r}: {key} takes {listed} in the matrix")
        wanted[key] = matches[0]
    return [c for c in combos if all(c[k] == v for k, v in wanted.items())]


def _spelling(value: Any) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _spelled(value: Any, text: str) -> bool:
    if isinstance(value, bool):
        return text.lower() in (("yes", "true", "1") if value else ("no", "false", "0"))
    return str(value) == text


def shard(combos: Sequence[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    """Slice I of N (1 <= I <= N), deterministic, the slices together exactly `combos`.

    Combinations are dealt round-robin in the order of a hash of their names, not in file
    order (where a stride can fall in step with the inner questions: every shard all compile
    or none), so each slice is a fair sample of the matrix and slices take similar times."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise UsageError(f"--shard {spec!r}: expected I/N with 1 <= I <= N, such as 2/8")
    index, count = int(match[1]), int(match[2])
    dealt = sorted(range(len(combos)), key=lambda i: _stable_hash(combination_id(combos[i])))
    return [combos[i] for i in sorted(dealt[index - 1 :: count])]


def _stable_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Lint: what a rendered project must and must not hold


RESIDUE = re.compile(r"\{%-?\s|\s-?%\}|\{\{\s|\s\}\}|\{#|#\}|\.jinja\b")
_TRACKER_MARKERS = {"tensorboard": "SummaryWriter", "wandb": "wandb", "mlflow": "mlflow"}
_DISTRIBUTED_MARKERS = ("torch.distributed", "DistributedDataParallel", "torchrun")


def lint_problems(project: Path, answers: dict[str, Any]) -> list[str]:
    """Why `project`, rendered with `answers`, is not clean as rendered ([] when it is): ruff
    with the project's own config, template residue, and code for options not chosen."""
    problems = []
    for command in (
        ["ruff", "check", "--no-cache", "--output-format", "concise", "."],
        ["ruff", "format", "--no-cache", "--check", "--diff", "."],
    ):
        try:
            result = subprocess.run(command, cwd=project, capture_output=True, text=True)
        except FileNotFoundError:
            raise ScaffoldError("ruff is not installed: pip install ruff") from None
        if result.returncode != 0:
            problems.append(f"`{' '.join(command[:2])}` failed:\n{result.stdout}{result.stderr}")

    files = [p for p in sorted(project.rglob("*")) if p.is_file() and ".git" not in p.parts]
    for path in files:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(project)
        if RESIDUE.search(text):
            problems.append(f"template residue in {where}")
        if "REPLACE ME" in text or "TODO" in text:
            problems.append(f"a REPLACE ME or TODO left in {where}")
    source = "\n".join(p.read_text(encoding="utf-8") for p in files if p.suffix == ".py")
    try:
        compile(source, "<project>", "exec")
    except SyntaxError as err:
        problems.append(f"the project's Python does not parse: {err}")

    precision, device = answers.get("precision"), answers.get("device")
    ddp = answers.get("distributed", "none") == "ddp"
    expect = [
        ("GradScaler", precision == "fp16", "fp16"),
        ("autocast", precision != "fp32", "bf16 or fp16"),
        ("torch.compile", bool(answers.get("compile")), "compile"),
        ("set_float32_matmul_precision", device == "cuda", "cuda"),
        ("torch.mps", device == "mps", "mps"),
        ("torch.cuda.get_rng_state", device == "cuda", "cuda"),
        ("def sample(", answers.get("task") == "generation", "generation"),
    ]
    expect += [(marker, ddp, "ddp") for marker in _DISTRIBUTED_MARKERS if marker != "torchrun"]
    expect += [
        (marker, answers.get("tracker") == tracker, tracker)
        for tracker, marker in _TRACKER_MARKERS.items()
    ]
    for marker, wanted, option in expect:
        if (marker in source) != wanted:
            state = "missing although" if wanted else "present although not"
            problems.append(f"{marker!r} {state} {option} was chosen")
    everything = "\n".join(p.read_text(encoding="utf-8") for p in files)
    if not ddp and "torchrun" in everything:
        problems.append("'torchrun' present although not ddp was chosen")
    pyproject = (project / "pyproject.toml").read_text(encoding="utf-8")
    for tracker in _TRACKER_MARKERS:
        chosen = answers.get("tracker") == tracker
        if (f'"{tracker}' in pyproject) != chosen:
            state = "missing from" if chosen else "in"
            problems.append(f"the {tracker} dependency is {state} pyproject.toml")
    return problems


# ---------------------------------------------------------------------------------------------
# Running the matrix


@dataclasses.dataclass
class Outcome:
    """What became of one combination."""

    answers: dict[str, Any]
    passed: bool
    step: str  # the step that failed, or "check" (the last) when all passed
    seconds: dict[str, float]  # per step run
    output: str  # the failing step's output (empty when passed)
    project: Path | None = None  # kept when it failed

    @property
    def name(self) -> str:
        return combination_id(self.answers)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def tail(self, lines: int = _TAIL_LINES) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class _Job:
    answers: dict[str, Any]
    folder: Path
    template: Path | None
    native_device: bool
    threads: int
    keep: bool
    timeout: float | None
    fork: bool  # run the check in a process forked from the worker, else a fresh interpreter


# What a project's `check all` imports, loaded once per matrix worker before any check is forked
# from it: each fresh interpreter paid 3-5 s of this, more than the checks of a small model take.
# A module missing here is simply not preloaded (the project then imports it, or fails, itself).
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",  # torch.optim imports it when an optimizer is built
    "torch._inductor.compile_fx",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    "torch.utils.tensorboard",
    "tqdm",
    "wandb",
    "mlflow.tracking",
)
# The rank processes of a ddp combination, as the project's own launcher (torchrun) starts them.
DDP_PROCESSES = 2


def forking_supported() -> bool:
    """Checks fork from a warm worker on Linux; macOS (where forking after loading the
    Objective-C runtime is unsafe) and Windows start a fresh interpreter for each check."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def run_matrix(
    combos: Sequence[dict[str, Any]],
    *,
    jobs: int | None = None,
    workdir: Path | None = None,
    native_device: bool = False,
    keep: bool = False,
    timeout: float | None = None,
    template: Path | None = None,
    fresh: bool = False,
    on_done: Callable[[Outcome, int, int], None] = lambda outcome, done, total: None,
) -> list[Outcome]:
    """Render, lint and check each combination, `jobs` at a time (default: the CPU count).

    Checks run on the CPU (`--device cpu`) unless `native_device`; a check that runs past
    `timeout` seconds is stopped and fails. Projects that pass are
    deleted unless `keep`; a failing one stays, under `workdir`. Outcomes keep `combos`' order.

    Each worker imports torch (and the rest of PRELOAD) once; each check then runs the project's
    `python -m <pkg> check all` in a process forked from that worker, ddp ones as two rank
    processes started the way torchrun starts them. With `fresh`, or where forking is not safe
    (macOS, Windows, a machine with a GPU), each check is a fresh interpreter running that
    command, ddp ones under the project's own torchrun.
    """
    jobs = max(1, jobs or os.cpu_count() or 1)
    own_workdir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="scaffold-matrix-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # One inductor cache for every compile combination: the same kernels compile once.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(workdir / "inductor-cache"))
    # Kernels compile in the checking process: with every core busy with a job, a pool of compile
    # workers (each a fresh interpreter importing torch) only adds its start-up.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    fork = not fresh and forking_supported()
    work = [
        _Job(dict(c), workdir / f"{i:04d}", template, native_device, threads, keep, timeout, fork)
        for i, c in enumerate(combos)
    ]
    outcomes: dict[int, Outcome] = {}
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs,
        initializer=_start_worker,
        initargs=(threads, fork, fork and any(c.get("compile") for c in combos)),
    ) as pool:
        futures = {pool.submit(_run_one, work[i]): i for i in schedule(combos)}
        try:
            for future in concurrent.futures.as_completed(futures):
                outcome = future.result()
                outcomes[futures[future]] = outcome
                on_done(outcome, len(outcomes), len(work))
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()
            raise
    if own_workdir and not keep and all(o.passed for o in outcomes.values()):
        shutil.rmtree(workdir, ignore_errors=True)
    return [outcomes[i] for i in range(len(work))]


# Compile combinations alike in these answers compile the same kernels (the tracker, the
# accumulation, ddp with the small models' single gradient bucket and, with the checks on the
# CPU, the device leave the compiled graphs alone): the first of each family fills the inductor
# cache (measured: the others then take 2-6 s, the first 8-32 s).
COMPILE_FAMILY = ("task", "precision")


def schedule(combos: Sequence[dict[str, Any]]) -> list[int]:
    """The order combinations start in: the first compile combination of each family first
    (each family's kernels compile once, while the other jobs compile other families), then
    the rest in order, finding their kernels in the cache."""
    seen: set[tuple[Any, ...]] = set()
    first, rest = [], []
    for i, answers in enumerate(combos):
        family = tuple(answers.get(k) for k in COMPILE_FAMILY)
        if answers.get("compile") and family not in seen:
            seen.add(family)
            first.append(i)
        else:
            rest.append(i)
    return first + rest


@dataclasses.dataclass
class _Fresh:
    """A worker's state as it started, before any rendering: what each forked check begins
    from, as a fresh interpreter would."""

    path: list[str]
    warning_filters: list[Any]
    environ: dict[str, str]


_FRESH: _Fresh | None = None


def _start_worker(threads: int, preload: bool, warm_compiler: bool = False) -> None:
    """A matrix worker's start: copier, and for forked checks torch and the rest of PRELOAD
    (and torch.compile's machinery, when a combination compiles)."""
    global _FRESH
    # Jobs in parallel share the cores: one intra-op pool each, not one each per core. Set before
    # torch loads: it sizes its pool from this.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    _FRESH = _Fresh(list(sys.path), list(warnings.filters), dict(os.environ))
    # A worker never runs exit handlers (it ends with os._exit); a check forked from it runs
    # those a fresh interpreter would have: multiprocessing's (it stops the loader workers) and
    # the ones the modules it imports register, not those of `scaffold matrix` itself.
    atexit._clear()
    getattr(threading, "_threading_atexits", []).clear()
    atexit.register(multiprocessing.util._exit_function)  # type: ignore[attr-defined]
    importlib.import_module("scaffold.render")
    if preload:
        for name in PRELOAD:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
    if warm_compiler:
        with contextlib.suppress(Exception):
            _warm_compiler()


def _warm_compiler() -> None:
    """Compile a one-line function forward and backward, then forget it: torch.compile's first
    use in a process initialises its machinery lazily (1-2 s, in every compile check)."""
    import torch

    forget = torch._dynamo.reset  # type: ignore[attr-defined]
    forget()
    twice = torch.compile(lambda x: (x * 2).sum())
    twice(torch.ones(3, requires_grad=True)).backward()
    forget()


def _run_one(job: _Job) -> Outcome:
    """Render, lint and check one combination (in a worker process)."""
    from scaffold.render import new_project  # copier and torch load once per worker

    seconds: dict[str, float] = {}
    project = job.folder / LONGEST_NAME
    shutil.rmtree(job.folder, ignore_errors=True)

    def fail(step: str, output: str) -> Outcome:
        return Outcome(job.answers, False, step, seconds, output, project)

    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            new_project(project, job.answers, git=False, template=job.template)
    except ScaffoldError as err:
        seconds["render"] = time.perf_counter() - start
        return fail("render", str(err))
    seconds["render"] = time.perf_counter() - start

    start = time.perf_counter()
    problems = lint_problems(project, job.answers)
    seconds["lint"] = time.perf_counter() - start
    if problems:
        return fail("lint", "\n".join(problems))

    start = time.perf_counter()
    fork = job.fork and not _gpu_present()
    returncode, output = _run_check_forked(project, job) if fork else _run_check(project, job)
    seconds["check"] = time.perf_counter() - start
    if returncode != 0:
        return fail("check", output)
    if not job.keep:
        shutil.rmtree(job.folder, ignore_errors=True)
    return Outcome(job.answers, True, "check", seconds, "", None)


def _gpu_present() -> bool:
    """Whether torch sees a GPU here: CUDA is not fork-safe once initialised (and rendering
    has asked torch about the machine), so such a machine's checks start fresh interpreters."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def _run_check(project: Path, job: _Job) -> tuple[int, str]:
    """Run the project's checks in a fresh interpreter in its own process group; on timeout,
    stop the whole group (torchrun and its ranks too)."""
    process = subprocess.Popen(
        check_command(project, native_device=job.native_device),
        cwd=project,
        env=_check_env(project, job.threads),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=job.timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -1, f"timed out after {job.timeout:.0f} s\n{output}"
    return process.returncode, f"exit status {process.returncode}\n{output}"


def _run_check_forked(project: Path, job: _Job) -> tuple[int, str]:
    """Run `python -m <pkg> check all` (check_command's) in a child of this warm worker, in its
    own session; on timeout, stop the whole session (its ranks and loader workers too).

    The child is the launcher: it runs the module itself, or for a ddp combination starts
    DDP_PROCESSES rank processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) and, as torchrun does, stops the others when one fails."""
    command = check_command(project, native_device=job.native_device)
    package, args = command[command.index("-m") + 1], command[command.index("-m") + 2 :]
    env = _check_env(project, job.threads)
    ranks = DDP_PROCESSES if job.answers.get("distributed") == "ddp" else 1
    log = job.folder / "check.log"
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the worker
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            # The standard streams of an interpreter started with these descriptors.
            sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = sys.__stderr__ = open(  # noqa: SIM115
                2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False
            )
            code = _launch(project, package, args, env, ranks)
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(output)
    deadline = None if job.timeout is None else time.monotonic() + job.timeout
    pause = 0.005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(status)
            return returncode, f"exit status {returncode}\n{_read(log)}"
        if deadline is not None and time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1, f"timed out after {job.timeout:.0f} s\n{_read(log)}"
        time.sleep(pause)
        pause = min(0.1, pause * 2)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _launch(project: Path, package: str, args: list[str], env: dict[str, str], ranks: int) -> int:
    """In the forked launcher: run the module, or start `ranks` rank processes running it."""
    if ranks == 1:
        return _run_module(project, package, args, env)
    with socket.socket() as probe:  # the project's own launcher picks its port the same way
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "GROUP_RANK": "0",
                    "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                code = _run_module(project, package, args, rank_env)
            finally:
                os._exit(code)
        pids.append(pid)
    failed = 0
    running = set(pids)
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 1
            print(f"rank {pids.index(pid)} exited with status {code}: stopping the others")
            sys.stdout.flush()
            for other in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
    return failed


def _run_module(project: Path, package: str, args: list[str], env: dict[str, str]) -> int:
    """`python -m <pkg> *args` in this (forked) process, from a fresh interpreter's state; its
    exit status."""
    fresh = _FRESH or _Fresh(list(sys.path), list(warnings.filters), dict(os.environ))
    os.chdir(project)
    os.environ.clear()
    os.environ.update(env)
    src = project / "src"
    # What `python -m` with PYTHONPATH=src starts with: the working folder, then PYTHONPATH.
    sys.path[:] = [str(project), str(src), *(p for p in fresh.path if p not in ("", str(src)))]
    sys.argv = [str(src / package / "__main__.py"), *args]
    warnings.filters[:] = fresh.warning_filters
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code: int = 0
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # As the interpreter exits: wait for non-daemon threads, then the atexit handlers.
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def check_command(project: Path, *, native_device: bool = False) -> list[str]:
    """`python -m <pkg> check all`, on the CPU unless `native_device`, with CHECK_SIZES."""
    command = [sys.executable, "-m", package_name(LONGEST_NAME), "check", "all"]
    if not native_device:
        command += ["--device", "cpu"]
    fields = _config_fields(project)
    for group in CHECK_SIZES:
        if fields >= group.keys():
            for name, value in group.items():
                command += ["--" + name.replace("_", "-"), str(value)]
    return command


def _config_fields(project: Path) -> set[str]:
    """The field names of the project's Config dataclass (each is a command-line option)."""
    config = next((project / "src").glob("*/config.py"))
    return set(re.findall(r"^    (\w+): [^=\n]+=", config.read_text(encoding="utf-8"), re.M))


def _check_env(project: Path, threads: int) -> dict[str, str]:
    env = dict(_FRESH.environ if _FRESH else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(project / "src"), env.get("PYTHONPATH")) if p
    )
    # Jobs in parallel share the cores: one intra-op pool each, not one each per core.
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("WANDB_SILENT", "true")
    return env


# ---------------------------------------------------------------------------------------------
# Reports


def summary(outcomes: Sequence[Outcome], wall: float, slowest: int = 5) -> str:
    """The table printed at the end: counts, times, the slowest combinations, each failure."""
    passed = [o for o in outcomes if o.passed]
    failed = [o for o in outcomes if not o.passed]
    rendered = sum("render" in o.seconds and o.step != "render" for o in outcomes)
    linted = sum("lint" in o.seconds and o.step != "lint" for o in outcomes)
    checked = sum("check" in o.seconds for o in outcomes)
    lines = [
        f"combinations {len(outcomes)}: passed {len(passed)}, failed {len(failed)} "
        f"(rendered {rendered}, lint-clean {linted}, checks run {checked})",
    ]
    if outcomes:
        totals = sorted(o.total for o in outcomes)
        lines.append(
            f"time per combination: median {_median(totals):.1f} s, slowest {totals[-1]:.1f} s; "
            + ", ".join(
                f"{step} median {_median(times):.1f} s"
                for step in STEPS
                if (times := [o.seconds[step] for o in outcomes if step in o.seconds])
            )
        )
        by_task: dict[str, list[float]] = {}
        for o in outcomes:
            key = f"{o.answers.get('task')}{'+compile' if o.answers.get('compile') else ''}"
            by_task.setdefault(key, []).append(o.total)
        lines.append(
            "median by task: "
            + ", ".join(f"{k} {_median(sorted(v)):.1f} s" for k, v in sorted(by_task.items()))
        )
        lines.append("slowest:")
        width = max(len(o.name) for o in outcomes)
        for o in sorted(outcomes, key=lambda o: -o.total)[:slowest]:
            steps = "  ".join(f"{s} {o.seconds[s]:5.1f}" for s in STEPS if s in o.seconds)
            lines.append(f"  {o.name:<{width}}  {o.total:6.1f} s  ({steps})")
    for o in failed:
        lines.append("")
        where = f" (kept in {o.project})" if o.project else ""
        lines.append(f"FAILED {o.name} at {o.step}{where}")
        lines.append(_indent(o.tail()))
    lines.append(f"matrix wall time: {_duration(wall)}")
    return "\n".join(lines)


def write_junit(outcomes: Sequence[Outcome], path: Path, wall: float) -> None:
    """A JUnit XML report: one test case a combination, its failing step as the failure."""
    suite = ElementTree.Element(
        "testsuite",
        name="scaffold matrix",
        tests=str(len(outcomes)),
        failures=str(sum(not o.passed for o in outcomes)),
        errors="0",
        time=f"{wall:.3f}",
    )
    for o in outcomes:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"matrix.{o.answers.get('task', 'project')}",
            name=o.name,
            time=f"{o.total:.3f}",
        )
        if not o.passed:
            failure = ElementTree.SubElement(case, "failure", message=f"{o.step} failed")
            failure.text = o.tail(200)
    path.parent.mkdir(parents=True, exist_ok=True)
    ElementTree.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def progress_line(outcome: Outcome, done: int, total: int, failed: int, elapsed: float) -> str:
    status = "ok" if outcome.passed else f"FAILED at {outcome.step}"
    return (
        f"[{done}/{total}] {failed} failed, {_duration(elapsed)}: "
        f"{outcome.name} {status} ({outcome.total:.1f} s)"
    )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
