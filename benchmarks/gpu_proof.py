"""The GPU proof: every CUDA path of scaffold run on a GPU, in one command, one results table.

    python benchmarks/gpu_proof.py --out "$OUT"          # a machine with an NVIDIA GPU
    python benchmarks/gpu_proof.py --list                # the plan, on any machine

Without CUDA it says so in one line and exits with status 0 (CI runs it that way). With CUDA it
runs these parts one after another, each in its own processes with a time limit, all of them
within --budget seconds (450 by default: 8 minutes on one H200 with the start-up around it),
and records a part that fails or runs out of time without stopping the others:

  mfu              benchmarks/gpu_throughput.py: GPT-2-small size, bf16, torch.compile, the
                   generated loop's shape against PyTorch's documented loop; tokens/s and MFU
  find-batch-size  a generation project's own `find-batch-size`: the memory search on the GPU
  ddp, fsdp        a generation project's `scripts/train_single_node.sh` with NPROC=2: two ranks
                   on the one GPU (they share it over gloo: NCCL refuses two ranks on one GPU);
                   fsdp's with every block recomputed (--activation-checkpointing 1)
  matrix           every cuda primary of the matrix (device cuda, tracker none: 180, the 90
                   finetune primaries, without accumulation, which run `check resume` and
                   `check init`, and the 15 streaming primaries, which check on shards)
                   rendered, linted and checked on the GPU (the matrix's runner
                   with native_device and fresh interpreters), --jobs at a time, each at most
                   --combination-timeout seconds, in whatever the budget leaves; one of
                   each (task, distributed, precision) family first, then the second of each

The MFU runs first, alone, so that its figures are the GPU's; the matrix runs last, so that a
matrix slower than its share costs only its own unfinished combinations (listed as such).

It writes under --out: gpu_proof.md (the results table, also printed), gpu_proof.json (the same
figures), matrix.md (one row a combination) and logs/ (each part's output, its last lines, and
every failing combination's check output).

It exits with status 1 when a part failed or did not finish, else 0.

`--device cpu` runs the same parts on a CPU at toy sizes, the matrix on one combination: a smoke
test of this script, whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaffold import _compat  # noqa: E402
from scaffold.combinations import all_combinations, combination_id  # noqa: E402
from scaffold.matrix.plan import proving  # noqa: E402
from scaffold.questions import package_name, template_dir  # noqa: E402

BUDGET = 450.0  # seconds for every part together: 8 minutes less the start-up around them
LOG_LINES = 400  # lines of each part's output kept under logs/
NOT_RUN = 10.0  # seconds: a part left less than this is not started
M = re.MULTILINE
VERDICT = {True: "PASS", False: "FAIL", None: "not run"}

# The project the single-project parts render: the generation task's transformer (the model FSDP
# shards block by block), bf16, without compile (the matrix's primaries compile).
PROJECT = {
    "task": "generation",
    "tracker": "none",
    "device": "cuda",
    "distributed": "none",
    "precision": "bf16",
    "grad_accum_steps": 1,
    "compile": False,
}
TRAIN_STEPS = 200  # of the ddp and fsdp runs; each validates at its end, on 1% held out

# The MFU benchmark's toy sizes for --device cpu (its own docstring's).
MFU_CPU = ["--device", "cpu", "--layers", "2", "--width", "64", "--heads", "2", "--context", "64"]
MFU_CPU += ["--vocab", "256", "--batch-size", "2", "--no-compile", "--warmup", "2"]
MFU_CPU += ["--steps", "5", "--rounds", "2", "--log-every", "5"]


@dataclasses.dataclass
class Result:
    """One part's row of the table."""

    part: str
    what: str
    passed: bool | None  # None: not run
    figures: str
    seconds: float = 0.0


@dataclasses.dataclass
class Part:
    name: str
    what: str  # the table's description
    cap: float  # seconds, at most
    plan: list[str]  # what --list prints
    run: Callable[[float], Result]  # given the seconds it may take


# --- the matrix's cuda primaries -----------------------------------------------------------------


def cuda_primaries() -> list[dict[str, Any]]:
    """The matrix's combinations with device cuda that are a primary when the checks run on the
    project's own device (scaffold.matrix.plan: the device is a base answer there), less those
    copier's validators refuse."""
    cuda = [a for a in all_combinations() if a.get("device") == "cuda"]
    combos = [a for a in cuda if proving(a, native_device=True)]
    validate = _compat.answer_validator(template_dir())
    return spread([answers for answers in combos if validate(answers) is None])


def spread(combos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`combos` reordered to take each (task, distributed, precision) family in turn, so that a
    matrix cut short by the budget has run every family before any family's second combination."""
    families: dict[tuple, list[dict[str, Any]]] = {}
    for answers in combos:
        key = (answers["task"], answers["distributed"], answers["precision"])
        families.setdefault(key, []).append(answers)
    # Each family's queue rotated by its place, so that the first round mixes compile and
    # gradient accumulation across families rather than taking grad1-nocompile from all.
    queues = [
        queue[i % len(queue) :] + queue[: i % len(queue)]
        for i, queue in enumerate(families.values())
    ]
    ordered = []
    while any(queues):
        ordered += [queue.pop(0) for queue in queues if queue]
    return ordered


def matrix_child(args: argparse.Namespace) -> int:
    """The matrix part's own process: runs the combinations in --combos, one JSON line each in
    --results as it finishes (so a run stopped at the budget keeps what it finished)."""
    from scaffold.matrix.runner import run_matrix

    combos = json.loads(Path(args.combos).read_text())
    results = Path(args.results)
    native = args.device == "cuda"

    def on_done(outcome, done: int, total: int) -> None:
        line = {
            "name": outcome.name,
            "answers": outcome.answers,
            "passed": outcome.passed,
            "step": outcome.step,
            "seconds": outcome.seconds,
            "tail": "" if outcome.passed else outcome.tail(200),  # both ranks' causes
        }
        with results.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        verdict = "ok" if outcome.passed else f"FAILED at {outcome.step}"
        print(f"[{done}/{total}] {outcome.name} {verdict} ({outcome.total:.1f} s)", flush=True)

    outcomes = run_matrix(
        combos,
        jobs=args.jobs,
        workdir=Path(args.workdir),
        native_device=native,
        timeout=args.combination_timeout,
        fresh=True,  # CUDA is not fork-safe: fresh interpreters (the CPU smoke run's too)
        on_done=on_done,
    )
    return 0 if all(o.passed for o in outcomes) else 1


# --- running a part's processes ------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux's /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(process: subprocess.Popen) -> None:
    """Kills `process` and everything it started, its own sessions too (the matrix's checks
    start in new sessions, out of reach of the process group)."""
    for _ in range(2):  # a process being started during the first sweep
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@dataclasses.dataclass
class Ran:
    status: int | None  # None: stopped at its time limit
    output: str
    seconds: float


def run_command(
    command: list[str], *, cwd: Path, log: Path, timeout: float, env: dict[str, str] | None = None
) -> Ran:
    """Runs `command` with a time limit, its output (stdout and stderr) into `log`, of which the
    last LOG_LINES lines are kept."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        out.write(f"$ {' '.join(command)}\n(in {cwd})\n\n")
        out.flush()
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status: int | None = process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            stop(process)
            status = None
    seconds = time.perf_counter() - start
    output = log.read_text(encoding="utf-8", errors="replace")
    lines = output.splitlines()
    if len(lines) > LOG_LINES:
        kept = [f"(the first {len(lines) - LOG_LINES} lines left out)", *lines[-LOG_LINES:]]
        log.write_text("\n".join(kept) + "\n", encoding="utf-8")
    if status is None:
        with log.open("a", encoding="utf-8") as out:
            out.write(f"\nstopped at its time limit, {timeout:.0f} s\n")
    return Ran(status, output, seconds)


def failure(ran: Ran, log: Path) -> str:
    """Why a part failed, in a table cell."""
    if ran.status is None:
        return f"stopped at its time limit ({ran.seconds:.0f} s); see {log.name}"
    lines = [line.strip() for line in ran.output.splitlines() if line.strip()]
    last = lines[-1][:160] if lines else ""
    return f"exit status {ran.status}: {last}; see {log.name}".replace("|", "/")


def render(folder: Path, name: str, answers: dict[str, Any]) -> Path:
    from scaffold.render import new_project

    project = folder / name
    shutil.rmtree(project, ignore_errors=True)
    with contextlib.redirect_stdout(sys.stderr):
        new_project(project, answers, git=False)
    return project


def project_env(project: Path) -> dict[str, str]:
    """The project's src/ importable, and this Python's torchrun first on the PATH (the launch
    scripts call `torchrun`)."""
    path = os.pathsep.join(p for p in (str(project / "src"), os.environ.get("PYTHONPATH")) if p)
    bin_path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {"PYTHONPATH": path, "PATH": bin_path, "WANDB_MODE": "offline"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the parts -----------------------------------------------------------------------------------


def mfu_part(args: argparse.Namespace, logs: Path) -> Part:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py")]
    command += MFU_CPU if args.device == "cpu" else []
    what = "MFU: GPT-2 small (124M), bf16, compile; generated loop against PyTorch's documented one"

    def run(timeout: float) -> Result:
        log = logs / "mfu.log"
        ran = run_command(command, cwd=ROOT, log=log, timeout=timeout)
        rows = dict(
            (m[1], (float(m[2]), m[3], m[4].strip()))
            for m in re.finditer(
                r"^\| (generated|reference) \| ([\d.]+) \| ([\d,]+) \| ([^|]+) \|$", ran.output, M
            )
        )
        syncs = re.search(r"(\d+) host syncs on steps that do not log", ran.output)
        if ran.status != 0 or len(rows) < 2:
            return Result("mfu", what, False, failure(ran, log), ran.seconds)
        figures = "; ".join(
            f"{name} {ms:.1f} ms a step, {rate} tokens/s, MFU {mfu}"
            for name, (ms, rate, mfu) in rows.items()
        )
        figures += f"; generated/reference time {rows['generated'][0] / rows['reference'][0]:.3f}"
        if syncs:
            figures += f"; host syncs on steps that do not log: {syncs[1]}"
        passed = syncs is None or syncs[1] == "0"
        return Result("mfu", what, passed, figures, ran.seconds)

    return Part("mfu", what, args.mfu_timeout, [" ".join(command)], run)


def find_batch_size_part(args: argparse.Namespace, work: Path, logs: Path) -> Part:
    name = "proof-batch-size"
    command = [sys.executable, "-m", package_name(name), "find-batch-size", *device_flag(args)]
    what = f"find-batch-size: {combination_id(PROJECT)}, the memory search on the GPU"

    def run(timeout: float) -> Result:
        start = time.perf_counter()
        log = logs / "find-batch-size.log"
        project = render(work, name, PROJECT)
        left = timeout - (time.perf_counter() - start)
        ran = run_command(command, cwd=project, log=log, timeout=left, env=project_env(project))
        seconds = time.perf_counter() - start
        found = re.search(r"^(largest micro-batch under .*|fastest per sample: .*)$", ran.output, M)
        if ran.status != 0 or not found:
            return Result("find-batch-size", what, False, failure(ran, log), seconds)
        trials = re.findall(r"^\s+batch\s+\d+: (.*)$", ran.output, M)
        memory = sum("out of memory" in t for t in trials)
        figures = f"{found[1]}; {len(trials)} batch sizes tried, {memory} out of memory"
        return Result("find-batch-size", what, True, figures, seconds)

    plan = [f"(in {name}) " + " ".join(command)]
    return Part("find-batch-size", what, args.part_timeout, plan, run)


def distributed_part(args: argparse.Namespace, mode: str, work: Path, logs: Path) -> Part:
    name = f"proof-{mode}"
    answers = {**PROJECT, "distributed": mode}
    steps = 20 if args.device == "cpu" else TRAIN_STEPS
    options = ["--run-dir", "runs/proof", "--max-steps", str(steps), "--val-fraction", "0.01"]
    if mode == "fsdp":  # the blocks recomputed in the backward pass, before FSDP2 shards them
        options += ["--activation-checkpointing", "1"]
    command = ["bash", "scripts/train_single_node.sh", *options, *device_flag(args)]
    where = "one GPU" if args.device == "cuda" else "the CPU"
    what = f"{mode}: 2 processes on {where}, `train` {steps} steps, {combination_id(answers)}"

    def run(timeout: float) -> Result:
        start = time.perf_counter()
        log = logs / f"{mode}.log"
        project = render(work, name, answers)
        env = {**project_env(project), "NPROC": "2", "MASTER_PORT": str(free_port())}
        left = timeout - (time.perf_counter() - start)
        ran = run_command(command, cwd=project, log=log, timeout=left, env=env)
        seconds = time.perf_counter() - start
        best = re.search(r"best val loss ([\d.]+) at step (\d+)", ran.output)
        if ran.status != 0 or not best:
            return Result(mode, what, False, failure(ran, log), seconds)
        figures = f"best val loss {best[1]} at step {best[2]}, {steps} steps in {seconds:.0f} s"
        return Result(mode, what, True, figures + " (render and start-up included)", seconds)

    plan = [f"(in {name}) NPROC=2 " + " ".join(command)]
    return Part(mode, what, args.part_timeout, plan, run)


def matrix_part(
    args: argparse.Namespace, combos: list[dict[str, Any]], work: Path, logs: Path, out: Path
) -> Part:
    native = args.device == "cuda"
    where = "on the GPU" if native else "with --device cpu"
    what = f"matrix: {len(combos)} cuda primaries rendered, linted, `check all` {where}"
    plan = [
        f"{len(combos)} combinations, {args.jobs} at a time, each at most "
        f"{args.combination_timeout:.0f} s, in what the budget leaves",
        *(combination_id(c) for c in combos),
    ]

    def run(timeout: float) -> Result:
        (work / "matrix").mkdir(parents=True, exist_ok=True)
        combos_file, results = work / "matrix-combos.json", work / "matrix-results.jsonl"
        combos_file.write_text(json.dumps(combos))
        results.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--matrix-child"]
        command += ["--combos", str(combos_file), "--results", str(results)]
        command += ["--workdir", str(work / "matrix"), "--jobs", str(args.jobs)]
        command += ["--device", args.device]
        command += ["--combination-timeout", str(min(args.combination_timeout, timeout))]
        ran = run_command(command, cwd=ROOT, log=logs / "matrix.log", timeout=timeout)
        done = []
        if results.exists():
            done = [json.loads(line) for line in results.read_text().splitlines() if line]
        write_matrix_table(out / "matrix.md", combos, done, ran)
        failed = [d for d in done if not d["passed"]]
        with (logs / "matrix-failures.log").open("w", encoding="utf-8") as f:
            for d in failed:
                f.write(f"== {d['name']}: failed at {d['step']}\n{d['tail']}\n\n")
        unfinished = len(combos) - len(done)
        checks = [d["seconds"].get("check", 0.0) for d in done]
        figures = f"{len(done) - len(failed)} of {len(combos)} passed, {len(failed)} failed"
        if unfinished:
            figures += f", {unfinished} not finished in its {timeout:.0f} s"
        if checks:
            slowest = max(done, key=lambda d: d["seconds"].get("check", 0.0))
            figures += (
                f"; check median {statistics.median(checks):.1f} s, slowest "
                f"{slowest['name']} {slowest['seconds'].get('check', 0.0):.1f} s"
            )
        if failed:
            names = ", ".join(f"{d['name']} ({d['step']})" for d in failed[:5])
            figures += f"; failed: {names}{' ...' if len(failed) > 5 else ''} (see matrix.md)"
        if not done:
            figures = failure(ran, logs / "matrix.log")
        passed = bool(done) and not failed and not unfinished  # its teardown may be cut short
        return Result("matrix", what, passed, figures, ran.seconds)

    return Part("matrix", what, args.budget, plan, run)


def write_matrix_table(path: Path, combos: list, done: list[dict], ran: Ran) -> None:
    by_name = {d["name"]: d for d in done}
    lines = ["| combination | result | render s | lint s | prepare s | check s |"]
    lines.append("| --- | --- | ---: | ---: | ---: | ---: |")
    for answers in combos:
        name = combination_id(answers)
        d = by_name.get(name)
        if d is None:
            lines.append(f"| {name} | not finished | | | | |")
            continue
        verdict = "pass" if d["passed"] else f"FAIL ({d['step']})"
        times = [d["seconds"].get(k) for k in ("render", "lint", "prepare", "check")]
        cells = " | ".join("" if t is None else f"{t:.1f}" for t in times)
        lines.append(f"| {name} | {verdict} | {cells} |")
    status = "stopped at its time limit" if ran.status is None else f"exit status {ran.status}"
    path.write_text(f"Matrix part: {status}, {ran.seconds:.0f} s.\n\n" + "\n".join(lines) + "\n")


def device_flag(args: argparse.Namespace) -> list[str]:
    return ["--device", "cpu"] if args.device == "cpu" else []


# --- the whole run -------------------------------------------------------------------------------


def machine(device: str) -> str:
    import torch

    cpus = f"{os.cpu_count()} CPUs"
    if device != "cuda":
        return f"CPU smoke run (--device cpu), {cpus}, torch {torch.__version__}"
    name = torch.cuda.get_device_name(0)
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    driver = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    return (
        f"{torch.cuda.device_count()} x {name} ({memory:.0f} GiB), driver {driver or 'unknown'}, "
        f"CUDA {torch.version.cuda}, torch {torch.__version__}, {cpus}"
    )


def table(results: list[Result], header: str) -> str:
    lines = [header, "", "| part | result | figures | s |", "| --- | --- | --- | ---: |"]
    for r in results:
        figures = r.figures.replace("|", "/")
        lines.append(f"| {r.what} | {VERDICT[r.passed]} | {figures} | {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-proof"), help="for the results")
    parser.add_argument("--list", action="store_true", help="print the plan and run nothing")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for all parts")
    cpus = os.cpu_count() or 1
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, cpus * 3 // 4),
        help="matrix combinations at once (default: 3/4 of the CPUs, as a ddp or fsdp check runs "
        "two rank processes and the GPU one queue for all)",
    )
    parser.add_argument("--combination-timeout", type=float, default=150.0, metavar="SECONDS")
    parser.add_argument("--mfu-timeout", type=float, default=180.0, metavar="SECONDS")
    parser.add_argument(
        "--part-timeout", type=float, default=60.0, metavar="SECONDS", help="of the project parts"
    )
    parser.add_argument("--only", nargs="+", metavar="PART", help="run only these parts")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)  # default: a temporary folder
    # The matrix part's own process.
    parser.add_argument("--matrix-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--combos", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def parts(args: argparse.Namespace, work: Path, logs: Path) -> list[Part]:
    combos = cuda_primaries()
    if args.device == "cpu":
        combos = combos[:1]  # the smoke run: one combination
    found = [
        mfu_part(args, logs),
        find_batch_size_part(args, work, logs),
        distributed_part(args, "ddp", work, logs),
        distributed_part(args, "fsdp", work, logs),
        matrix_part(args, combos, work, logs, args.out),
    ]
    return [p for p in found if not args.only or p.name in args.only]


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse(argv)
    if args.matrix_child:
        return matrix_child(args)
    if args.list:
        for part in parts(args, Path("WORK"), Path("OUT/logs")):
            print(f"{part.what} (at most {part.cap:.0f} s)")
            for line in part.plan:
                print(f"  {part.name}: {line}")
        return 0
    if args.device == "cuda":
        import torch

        with warnings.catch_warnings():  # a driver too old for this torch: said below, in one line
            warnings.simplefilter("ignore")
            available = torch.cuda.is_available()
        if not available:
            print(f"gpu_proof: no CUDA GPU here (torch {torch.__version__}): nothing to run")
            return 0
    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-proof-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    deadline = started + args.budget
    header = (
        f"GPU proof, {datetime.date.today().isoformat()}: {machine(args.device)}; "
        f"`{' '.join(['python benchmarks/gpu_proof.py', *(argv or sys.argv[1:])])}`, "
        f"budget {args.budget:.0f} s"
    )
    print(header, flush=True)
    results = []
    for part in parts(args, work, logs):
        left = min(part.cap, deadline - time.monotonic())
        if left < NOT_RUN:
            results.append(Result(part.name, part.what, None, "the budget was spent"))
        else:
            try:
                results.append(part.run(left))
            except Exception as error:  # a part's own failure (a render, say), recorded
                figures = f"{type(error).__name__}: {error}"[:300]
                results.append(Result(part.name, part.what, False, figures))
        r = results[-1]
        print(f"{r.part}: {VERDICT[r.passed]}: {r.figures} ({r.seconds:.0f} s)", flush=True)
    wall = time.monotonic() - started
    text = table(results, header) + f"\nWall time {wall:.0f} s.\n"
    (out / "gpu_proof.md").write_text(text, encoding="utf-8")
    records = {"header": header, "wall_s": wall, "parts": [dataclasses.asdict(r) for r in results]}
    (out / "gpu_proof.json").write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(text, end="")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
