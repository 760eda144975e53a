"""The matrix's runner: each combination rendered, linted and checked, `jobs` at a time.

Every combination is first rendered file by file in memory (scaffold.matrix.files) and linted,
each distinct text once (scaffold.matrix.lint.lint_renders); its plan (scaffold.matrix.plan) then
says whether copier renders it into a folder to run a check or its --help. Each worker process
imports torch (and the rest of fork.PRELOAD) once; each check then runs the project's
`python -m <pkg> check all` in a process forked from that worker (scaffold.matrix.fork), or, with
`fresh` or where forking is not safe, as a fresh interpreter.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scaffold import _compat
from scaffold.check import check_command, ci_passed, project_package
from scaffold.combinations import combination_id
from scaffold.errors import ScaffoldError
from scaffold.matrix import fork
from scaffold.matrix.files import Renders, digest_text, render_many
from scaffold.matrix.lint import lint_renders
from scaffold.matrix.plan import (
    CROSS_CHECK,
    LINT_ONLY,
    SOURCE_RUN,
    SOURCE_STEPS,
    SOURCE_TRAIN,
    Plan,
    plans,
)

# copier.yml's longest project name: rendered lines must stay within the line length with it.
LONGEST_NAME = "a-long-project-name-to-fill-forty-chars1"

# Smaller sizes for the checks in the matrix, passed as the project's own config options: each
# task's Config has these fields (config.py is rendered from the task answer). The checks stay
# exactly as strict: the same overfit target, the same bit-for-bit resume, the same
# loader-versus-compute comparison, the same steps (the resume check's follow from the
# accumulation, not the batch).
# - Micro-batches of 8, the overfit check's batch: the compiled step is traced once for both,
#   and fp16, which the CPU runs slowly, took 90 ms a step at 256 x 4 (9 s of checks, now 1).
# - A validation split of 1%: each of the resume check's validations went over all of it (978
#   windows of text, most of that check's time).
# - The transformer's defaults take minutes on a CPU: one layer 64 wide over 16 characters. Its
#   overfit then takes ~70 steps, not ~30 (of at most 300), but each step a quarter of the time:
#   with fp16, which the CPU runs slowly, its checks took 15 s at width 128, 6 s at 64. The
#   MLPs keep their sizes (their overfit passes in 4 steps; a narrower MLP needs ~35).
CHECK_SIZES = {"batch_size": 8, "val_fraction": 0.01}
CHECK_SIZES_BY_TASK = {
    "generation": {"n_layer": 1, "block_size": 16, "n_embd": 64},
    # 16-pixel images decode faster in the main process than through workers on the 2 CPUs two
    # matrix jobs share: measured in CI, loader alone 7,766 samples/s with 0 workers, 3,155 with
    # 1, 2,517 with 2 (the default there), slower than a compiled step of the 8-wide ResNet, so
    # check loader failed. The resume check still loads through a worker (max(1, num_workers)).
    "image": {"width": 8, "image_size": 16, "num_workers": 0},
}

_TAIL_LINES = 40

# Generation combinations check on a folder their own `prepare` wrote, not on the synthetic
# text, so the matrix covers the path real corpora take (token files memory-mapped, the
# tokenizer saved and reloaded, the folder's digest checked on resume). The tokenizer follows the
# precision and `--documents` the accumulation: answers a twin shares with its primary, so each
# family checks one of the six, and the six are all checked. The corpus is 1,500 documents of 3 to
# 40 words (150 KB): measured, `prepare` took 1.4 s with BPE, and `check all` 3.7 s.
PREPARED = "data/matrix"
TOKENIZER_BY_PRECISION = {"fp32": "char", "bf16": "bpe", "fp16": "byte"}
CORPUS_WORDS = ("the", "a", "cat", "dog", "sees", "an", "old", "man", "my", "sister", "by", "sea")


# Streaming combinations check on shards their own `prepare` wrote to a local folder (the
# synthetic data, generation's corpus above), streamed as a URL's would be; small shards, so that
# a check reads several of them and its shuffle spans windows of them.
SHARDS = "data/matrix-shards"
SHARD_MB = "0.05"


def check_sizes(answers: dict[str, Any]) -> dict[str, Any]:
    """The config options a combination's check runs with."""
    sizes = {**CHECK_SIZES, **CHECK_SIZES_BY_TASK.get(str(answers.get("task")), {})}
    if answers.get("task") == "generation":
        sizes["data"] = PREPARED
        if int(answers.get("grad_accum_steps", 1)) > 1:
            sizes["documents"] = None  # the flag alone
    if answers.get("streaming"):
        sizes["data"] = SHARDS
    return sizes


def prepare_arguments(answers: dict[str, Any]) -> list[str] | None:
    """`prepare`'s arguments for a generation or a streaming combination (None for the others):
    generation's tokenizes the corpus, a streaming one's writes shards."""
    streaming = ["--out", SHARDS, "--shard-mb", SHARD_MB] if answers.get("streaming") else []
    if answers.get("task") != "generation":
        if not streaming:
            return None
        # the data the check reads (the image size, the validation split) as the check's sizes
        sizes = {k: v for k, v in check_sizes(answers).items() if k != "data"}
        options = [
            f"--{k.replace('_', '-')}" + ("" if v is None else f"={v}") for k, v in sizes.items()
        ]
        return ["prepare", *streaming, *options]
    tokenizer = TOKENIZER_BY_PRECISION.get(str(answers.get("precision")), "byte")
    vocabulary = ["--vocab-size", "512"] if tokenizer == "bpe" else []
    where = ["--data", "corpus.jsonl", *(streaming or ["--out", PREPARED])]
    return ["prepare", *where, "--tokenizer", tokenizer, *vocabulary]


def write_corpus(path: Path, documents: int = 1500) -> None:
    """A .jsonl of short documents of random words, the same every time."""
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(documents):
            words = " ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(3, 40)))
            f.write(json.dumps({"text": words + "."}) + "\n")


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """What became of one combination."""

    answers: dict[str, Any]
    passed: bool
    step: str  # the step that failed, or "check" (the last) when all passed
    seconds: dict[str, float]  # per step run
    output: str  # the failing step's output (empty when passed)
    plan: Plan  # the checks it ran (scaffold.matrix.plan)
    project: Path | None = None  # kept when it failed
    notes: list[str] = dataclasses.field(default_factory=list)  # close calls reported (ci_verdict)

    @property
    def name(self) -> str:
        return combination_id(self.answers)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def tail(self, lines: int = _TAIL_LINES) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One combination to render, lint and check, as a worker receives it."""

    answers: dict[str, Any]
    plan: Plan  # which checks, with which options beyond the check sizes
    folder: Path  # rendered into folder/LONGEST_NAME; check.log beside it
    template: Path | None
    native_device: bool  # check on the project's own device, not --device cpu
    threads: int  # OMP_NUM_THREADS of the check
    keep: bool  # keep the project when it passes
    timeout: float | None
    fork: bool  # run the check in a process forked from the worker, else a fresh interpreter
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # path: digest, as linted


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
    full: bool = False,
    on_done: Callable[[Outcome, int, int], None] = lambda outcome, done, total: None,
) -> list[Outcome]:
    """Render, lint and check each combination, `jobs` at a time (default: the CPU count).

    Every combination is rendered and linted; each then runs its plan (scaffold.matrix.plan):
    `check all`, an answer's proving checks, its --help, or nothing more; with `full`, `check all`
    everywhere. Checks run on the CPU (`--device cpu`) unless `native_device`; a check that runs
    past `timeout` seconds is stopped and fails. Projects that pass are deleted unless `keep`; a
    failing one stays, under `workdir`. Outcomes keep `combos`' order.

    Each worker imports torch (and the rest of fork.PRELOAD) once; each check then runs the
    project's `python -m <pkg> check all` in a process forked from that worker, ddp ones as two
    rank processes started the way torchrun starts them. With `fresh`, or where forking is not safe
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
    forked = not fresh and fork.forking_supported()
    named = [{**c, "project_name": LONGEST_NAME} for c in combos]
    started = time.perf_counter()
    renders = render_many(named, jobs=jobs, template=template)
    rendered = time.perf_counter()
    problems = lint_renders(renders, named)
    linted = time.perf_counter()
    share = {  # job-seconds a combination, the phases' wall time shared out
        "render": (rendered - started) * jobs / max(1, len(combos)),
        "lint": (linted - rendered) / max(1, len(combos)),
    }
    checks = plans(combos, native_device=native_device, full=full, modules=renders.modules())
    outcomes: dict[int, Outcome] = {}
    work: dict[int, Job] = {}
    for i, (answers, plan) in enumerate(zip(combos, checks, strict=True)):
        job = Job(
            answers=dict(answers),
            plan=plan,
            folder=workdir / f"{i:04d}",
            template=template,
            native_device=native_device,
            threads=threads,
            keep=keep,
            timeout=timeout,
            fork=forked,
            files=renders.files[i],
        )
        if problems[i]:
            outcomes[i] = _failed(job, dict(share), "lint", "\n".join(problems[i]))
            _write(renders, i, _project(job))
        elif plan.which == LINT_ONLY:
            outcomes[i] = Outcome(
                answers=job.answers,
                passed=True,
                step="check",
                seconds=dict(share),
                output="",
                plan=plan,
            )
        else:
            work[i] = job
    done = 0
    for i in sorted(outcomes):
        done += 1
        on_done(outcomes[i], done, len(combos))
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=WORKER_START,
        initializer=_start_worker,
        initargs=(threads, forked, forked and any(w.answers.get("compile") for w in work.values())),
    ) as pool:
        indexes = sorted(work)
        order = [
            indexes[k] for k in schedule([combos[i] for i in indexes], [checks[i] for i in indexes])
        ]
        futures = {
            pool.submit(_run_batch, [work[i] for i in batch]): batch
            for batch in batches(order, checks)
        }
        try:
            for future in concurrent.futures.as_completed(futures):
                for i, outcome in zip(futures[future], future.result(), strict=True):
                    outcome.seconds = {**share, **outcome.seconds}
                    outcomes[i] = outcome
                    done += 1
                    on_done(outcome, done, len(combos))
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()
            raise
    if own_workdir and not keep and all(o.passed for o in outcomes.values()):
        shutil.rmtree(workdir, ignore_errors=True)
    return [outcomes[i] for i in range(len(combos))]


def _write(renders: Renders, i: int, project: Path) -> None:
    """Lay combination i's render out in `project`, to look at where its lint failed."""
    for path, text in renders.of(i).items():
        target = project / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


def _start_worker(threads: int, preload: bool, warm_compiler: bool) -> None:
    """A matrix worker's start (fork.start_worker), its renders sharing copier's parsed template:
    the template folder does not change during a run."""
    _compat.share_templates()
    fork.start_worker(threads, preload, warm_compiler)


# Workers start as fresh interpreters, not forked from the caller: a process with threads (pytest
# under xdist has its channel's; a tracker's client leaves some) can hold a lock at the moment of
# a fork, and the child then waits on it forever. Measured: one such worker hung, its jobs done by
# the other, and the pool's shutdown waited on it until the 900 s test timeout. The checks are
# still forked from each worker, which is single-threaded when it forks them.
WORKER_START = multiprocessing.get_context("spawn")


# Compile combinations alike in these answers compile the same kernels (the tracker, the
# accumulation and, with the checks on the CPU, the device leave the compiled graphs alone): the
# first of each family fills the inductor cache (measured: the others then take 2-6 s, the first
# 8-32 s). fsdp compiles each shard unit's forward, other graphs than a whole model's; ddp with the
# small models' single gradient bucket compiles none's, so its family starts on a warm cache.
COMPILE_FAMILY = ("task", "precision", "distributed")


def schedule(combos: Sequence[dict[str, Any]], checks: Sequence[Plan] | None = None) -> list[int]:
    """The order combinations start in, the slow first so that the last to finish are short: the
    first compiling check of each family (each family's kernels compile once, while the other jobs
    compile other families), then the other `check all`s, then the other checks, the --help last."""
    checks = checks or [Plan(which="all", options={})] * len(combos)
    seen: set[tuple[Any, ...]] = set()
    first, rest = [], []
    for i, (answers, plan) in enumerate(zip(combos, checks, strict=True)):
        family = tuple(answers.get(k) for k in COMPILE_FAMILY)
        if plan.which != CROSS_CHECK and answers.get("compile") and family not in seen:
            seen.add(family)
            first.append(i)
        else:
            rest.append(i)
    rest.sort(key=lambda i: (checks[i].which == CROSS_CHECK, checks[i].which != "all"))
    return first + rest


# The --help combinations go to a worker BATCH at a time; the checks, seconds to minutes each, go
# one at a time, so that the jobs finish together.
BATCH = 32
BATCHED = (CROSS_CHECK,)


def batches(order: Sequence[int], checks: Sequence[Plan]) -> list[list[int]]:
    """`order` (indexes into `checks`) cut into what each worker task runs: a combination that
    runs a check alone, the --help ones BATCH at a time, in order."""
    result: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        if checks[i].which not in BATCHED:
            result.append([i])
            continue
        batch.append(i)
        if len(batch) == BATCH:
            result.append(batch)
            batch = []
    return result + ([batch] if batch else [])


def _run_one(job: Job) -> Outcome:
    """Render and check one combination (in a worker process)."""
    return _run_batch([job])[0]


def _run_batch(jobs: Sequence[Job]) -> list[Outcome]:
    """Render each of `jobs` with copier (in a worker process), hold it to the texts the matrix
    linted (job.files), and run its plan."""
    from scaffold.render import new_project  # copier and torch load once per worker

    outcomes = []
    for job in jobs:
        shutil.rmtree(job.folder, ignore_errors=True)
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                new_project(_project(job), job.answers, git=False, template=job.template)
        except ScaffoldError as err:
            outcomes.append(_failed(job, seconds, "render", str(err)))
            continue
        seconds["render"] = time.perf_counter() - start
        if job.files and (differ := _differs(_project(job), job.files)):
            said = "copier rendered other texts than the matrix linted: " + ", ".join(differ)
            outcomes.append(_failed(job, seconds, "render", said))
            continue
        outcomes.append(_check(job, seconds))
    return outcomes


def _differs(project: Path, files: dict[str, str]) -> list[str]:
    """The paths whose text in `project` is not the one `files` has the digest of."""
    found = {
        p.relative_to(project).as_posix(): digest_text(p.read_text(encoding="utf-8"))
        for p in project.rglob("*")
        if p.is_file()
    }
    return sorted(
        path for path in found.keys() | files.keys() if found.get(path) != files.get(path)
    )


def _project(job: Job) -> Path:
    return job.folder / LONGEST_NAME


def _failed(job: Job, seconds: dict[str, float], step: str, output: str) -> Outcome:
    """A combination that failed at `step`: its project is kept."""
    return Outcome(
        answers=job.answers,
        passed=False,
        step=step,
        seconds=seconds,
        output=output,
        plan=job.plan,
        project=_project(job),
    )


def _check(job: Job, seconds: dict[str, float]) -> Outcome:
    """Run a rendered, lint-clean combination's plan: its prepare and checks, or none."""
    project = _project(job)

    def passed(notes: list[str]) -> Outcome:
        if not job.keep:
            shutil.rmtree(job.folder, ignore_errors=True)
        return Outcome(
            answers=job.answers,
            passed=True,
            step="check",
            seconds=seconds,
            output="",
            plan=job.plan,
            notes=notes,
        )

    if job.plan.which == LINT_ONLY:  # every line of it runs elsewhere (scaffold.matrix.plan)
        return passed(notes=[])

    forked = job.fork and not _gpu_present()
    run = _run_forked if forked else _run_fresh
    cross = job.plan.which == CROSS_CHECK  # its --help needs no data, and one process
    prepare = None if cross else prepare_arguments(job.answers)
    if prepare:
        start = time.perf_counter()
        if job.answers.get("task") == "generation":
            write_corpus(project / "corpus.jsonl")
        command = [sys.executable, "-m", project_package(project), *prepare]
        returncode, output = run(project, job, command, "prepare.log", ranks=1)
        seconds["prepare"] = time.perf_counter() - start
        if returncode != 0:
            return _failed(job, seconds, "prepare", output)

    start = time.perf_counter()
    distributed = job.answers.get("distributed", "none") != "none"
    ranks = fork.DDP_PROCESSES if distributed and not cross else 1
    notes: list[str] = []
    for which in (job.plan.which, *job.plan.then):  # the next only where the one before passed
        log = "check.log" if which == job.plan.which else f"check-{which}.log"
        command = _check_command(project, job, which)
        returncode, output = run(project, job, command, log, ranks=ranks)
        seconds["check"] = time.perf_counter() - start
        ok, said = ci_passed(returncode, output)  # a loader close call passes, reported
        if not ok:
            return _failed(job, seconds, "check", output)
        notes += said
    return passed(notes)


def _gpu_present() -> bool:
    """Whether torch sees a GPU here: CUDA is not fork-safe once initialised (and rendering
    has asked torch about the machine), so such a machine's checks start fresh interpreters."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def _check_command(project: Path, job: Job, which: str | None = None) -> list[str]:
    """`python -m <pkg> check all` (a twin's `check resume`; `which`, one of the plan's checks),
    on the CPU unless native_device, with the check sizes; a cross's `python -m <pkg> --help`."""
    which = which or job.plan.which
    if which == CROSS_CHECK:
        return [sys.executable, "-m", project_package(project), "--help"]
    device = None if job.native_device else "cpu"
    options = {**check_sizes(job.answers), **job.plan.options}
    if which == SOURCE_TRAIN:  # weights for check init to load: a short run at the check sizes
        command = check_command(project, device=device, options=options)  # python -m pkg check all
        steps = ["--run-dir", SOURCE_RUN, "--max-steps", str(SOURCE_STEPS)]
        return [*command[:3], "train", *steps, *command[5:]]
    if which != job.plan.which:
        options.update(job.plan.then_options)
    return check_command(project, which=which, device=device, options=options)


def _run_fresh(
    project: Path, job: Job, command: list[str], log: str, *, ranks: int
) -> tuple[int, str]:
    """Run `command` in a fresh interpreter in its own process group; on timeout, stop the whole
    group (torchrun and its ranks too). A ddp check's command starts its own ranks (the
    project's torchrun). Its output is kept in `log` beside the project, as a forked check's."""
    process = subprocess.Popen(
        command,
        cwd=project,
        env=_check_env(project, job.threads, ranks),
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
        (job.folder / log).write_text(output, encoding="utf-8")
        return -1, f"timed out after {job.timeout:.0f} s\n{output}"
    (job.folder / log).write_text(output, encoding="utf-8")
    return process.returncode, f"exit status {process.returncode}\n{output}"


def _run_forked(
    project: Path, job: Job, command: list[str], log: str, *, ranks: int
) -> tuple[int, str]:
    """`command` in a process forked from this warm worker (see scaffold.matrix.fork), as
    `ranks` rank processes, its output in `log` beside the project."""
    return fork.run_check_forked(
        project,
        command,
        env=_check_env(project, job.threads, ranks),
        ranks=ranks,
        log=job.folder / log,
        timeout=job.timeout,
    )


def _check_env(project: Path, threads: int, ranks: int) -> dict[str, str]:
    env = dict(fork.fresh_state().environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(project / "src"), env.get("PYTHONPATH")) if p
    )
    # Jobs in parallel share the cores: one intra-op pool each, not one each per core, and a
    # job's ranks share its share. More threads than cores and OpenMP's threads spin waiting for
    # each other: measured, an image fsdp check with 2 ranks of 2 threads on 2 cores took 200 s,
    # 43 s with 1 thread a rank.
    env.setdefault("OMP_NUM_THREADS", str(max(1, threads // ranks)))
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("WANDB_SILENT", "true")
    return env
