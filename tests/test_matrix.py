"""`scaffold matrix` runs each check as `python -m <pkg> check all` would: in a process forked
from a worker that loaded torch once, ddp ones as two rank processes with torchrun's
environment. Exit statuses, output, exit handlers, failing ranks and timeouts behave as they
do for a fresh interpreter."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_until

from scaffold import matrix
from scaffold.matrix import fork, runner
from scaffold.matrix import plan as plan_module
from scaffold.questions import package_name

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not matrix.forking_supported(), reason="checks fork on Linux")

# A stand-in project: its __main__ does what the file `mode` in its folder says.
FAKE_MAIN = """\
import atexit
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

mode = Path("mode").read_text().strip()
rank = os.environ.get("RANK")
print(f"args {sys.argv[1:]} rank {rank} of {os.environ.get('WORLD_SIZE')} in {os.getcwd()}")
print(f"main {__name__} package {__package__} path0 {sys.path[0]}")
print(f"start method {multiprocessing.get_start_method()}")
atexit.register(print, f"exit handler of rank {rank}")
if mode == "fail":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("boom")
if mode == "rank-fails":
    if rank == "1":
        sys.exit(2)
    time.sleep(60)
if mode == "forkserver":
    from multiprocessing import forkserver
    said = f"a worker of rank {rank}"
    worker = multiprocessing.get_context("forkserver").Process(target=print, args=(said,))
    worker.start()
    worker.join()
    server = Path(f"/proc/{forkserver._forkserver._forkserver_pid}/cmdline").read_bytes()
    print(f"forkserver of rank {rank}: {server.replace(bytes(1), b' ').decode()}")
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path("grandchild").write_text(str(child.pid))
    time.sleep(60)
"""


def _fake_project(folder: Path, mode: str) -> Path:
    project = folder / matrix.LONGEST_NAME
    package = project / "src" / package_name(matrix.LONGEST_NAME)
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("")
    (package / "__main__.py").write_text(FAKE_MAIN)
    (project / "mode").write_text(mode)
    return project


def _check_fake(folder: Path, mode: str, ddp: bool, timeout: float | None) -> tuple[int, str]:
    project = _fake_project(folder, mode)
    answers = {"distributed": "ddp" if ddp else "none"}
    job = matrix.Job(
        answers=answers,
        plan=matrix.Plan(which="all", options={}),
        folder=folder,
        template=None,
        native_device=False,
        threads=1,
        keep=True,
        timeout=timeout,
        fork=True,
    )
    command = runner._check_command(project, job)
    return runner._run_forked(project, job, command, "check.log", ranks=2 if ddp else 1)


def _in_worker(*args) -> tuple[int, str]:
    """Run a fake check from a matrix worker, as run_matrix does (not from pytest itself)."""
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=runner.WORKER_START, initializer=fork.start_worker, initargs=(1, False)
    ) as pool:
        return pool.submit(_check_fake, *args).result()


def test_a_passing_check_runs_as_python_dash_m(tmp_path):
    status, output = _in_worker(tmp_path, "pass", False, 60)

    assert status == 0
    project = tmp_path / matrix.LONGEST_NAME
    sizes = ["--batch-size", "8", "--val-fraction", "0.01"]
    args = ["check", "all", "--device", "cpu", *sizes]
    assert f"args {args} rank None of None in {project}" in output
    package = package_name(matrix.LONGEST_NAME)
    assert f"main __main__ package {package} path0 {project}" in output
    assert output.rstrip().endswith("exit handler of rank None")


def test_a_check_starts_processes_as_a_fresh_interpreter_would(tmp_path):
    # The worker itself was spawned (and spawn sets the child's start method): a check that
    # inherited it started each loader worker as a fresh interpreter, 5x slower (CI timed out).
    fresh = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    status, output = _in_worker(tmp_path, "pass", False, 60)

    assert status == 0
    assert f"start method {fresh}\n" in output


@pytest.mark.parametrize(("mode", "status", "shown"), [("fail", 3, None), ("raise", 1, "boom")])
def test_a_failing_check_keeps_its_status_and_output(tmp_path, mode, status, shown):
    got, output = _in_worker(tmp_path, mode, False, 60)

    assert got == status
    assert output.startswith(f"exit status {status}\n")
    if shown:
        assert f"RuntimeError: {shown}" in output


def test_ddp_checks_run_as_two_ranks(tmp_path):
    status, output = _in_worker(tmp_path, "pass", True, 60)

    assert status == 0
    assert "rank 0 of 2" in output and "rank 1 of 2" in output


def test_a_ranks_loader_workers_start_from_a_forkserver_forked_from_it(tmp_path):
    """Not from multiprocessing's fresh interpreter importing torch again (fork._forkserver)."""
    status, output = _in_worker(tmp_path, "forkserver", True, 60)

    assert status == 0, output
    assert "a worker of rank 0" in output and "a worker of rank 1" in output
    servers = [line for line in output.splitlines() if line.startswith("forkserver of rank")]
    assert len(servers) == 2 and not any("multiprocessing.forkserver" in s for s in servers), output


def test_a_failing_rank_stops_the_other(tmp_path):
    start = time.monotonic()
    status, output = _in_worker(tmp_path, "rank-fails", True, 60)

    assert status == 2
    assert "rank 1 exited with status 2: stopping the others" in output
    assert time.monotonic() - start < 30


def test_a_check_past_its_timeout_is_stopped_with_its_children(tmp_path):
    status, output = _in_worker(tmp_path, "hang", False, 3)

    assert status == -1
    assert output.startswith("timed out after 3 s")
    grandchild = int((tmp_path / matrix.LONGEST_NAME / "grandchild").read_text())
    assert wait_until(lambda: not _running(grandchild), timeout=10)  # it would sleep for 60 s


def _running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie is not: it waits only for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# In the matrix only: `scaffold matrix` (CI's last phase) runs these three base primaries' check
# all through the same run_matrix, and fails where a check fails.
@pytest.mark.matrix
def test_run_matrix_checks_real_projects_in_forked_processes(tmp_path):
    """The default combination and its ddp and fsdp siblings, rendered, linted and checked."""
    only = ["task=classification", "tracker=none", "device=cpu", "precision=fp32", "finetune=no"]
    only.append("streaming=no")
    combos = matrix.select(matrix.combinations(), [*only, "grad_accum_steps=1", "compile=no"])
    assert [c["distributed"] for c in combos] == ["none", "ddp", "fsdp"]

    outcomes = matrix.run_matrix(combos, jobs=2, workdir=tmp_path, keep=True, timeout=600)

    assert [o.passed for o in outcomes] == [True, True, True], [o.tail() for o in outcomes]
    for i in range(len(outcomes)):
        log = (tmp_path / f"{i:04d}" / "check.log").read_text()
        assert "**Sanity:** overfit-one-batch loss" in log
        assert "resume check matched: yes" in log


@pytest.mark.slow
def test_a_trackers_primary_runs_check_resume_with_its_tracker_logging(tmp_path):
    """The base primary runs every check; tensorboard's primary and cuda's (checked on the CPU) the
    resume check alone, the tracker logging; a cuda render with tensorboard runs its --help: its
    runlog.py reads both answers, a text no check loaded."""
    base = {"task": "classification", "distributed": "none", "precision": "fp32"}
    only = [f"{k}={v}" for k, v in base.items()] + ["grad_accum_steps=1", "compile=no"]
    only += ["finetune=no", "streaming=no"]
    pairs = [("none", "cpu"), ("tensorboard", "cpu"), ("none", "cuda"), ("tensorboard", "cuda")]
    combos = [
        c
        for c in matrix.select(matrix.combinations(), only)
        if (c["tracker"], c["device"]) in pairs
    ]
    assert len(combos) == 4

    outcomes = matrix.run_matrix(combos, jobs=2, workdir=tmp_path, keep=True, timeout=600)

    assert all(o.passed for o in outcomes), [o.tail() for o in outcomes]
    kinds = {(o.answers["tracker"], o.answers["device"]): o.plan.kind for o in outcomes}
    assert kinds == {
        ("none", "cpu"): "all",
        ("tensorboard", "cpu"): "resume",
        ("none", "cuda"): "resume",
        ("tensorboard", "cuda"): "import",
    }
    tracked = combos.index(next(o.answers for o in outcomes if o.plan.primary == "tracker"))
    log = (tmp_path / f"{tracked:04d}" / "check.log").read_text()
    assert "resume: PASS" in log and "overfit" not in log
    runs = tmp_path / f"{tracked:04d}" / matrix.LONGEST_NAME / "runs" / "check" / "resume"
    assert list(runs.rglob("events.out.tfevents.*"))  # its tracker logged


def test_each_compile_family_starts_once_before_the_rest():
    combos = matrix.combinations()
    order = matrix.schedule(combos)

    assert sorted(order) == list(range(len(combos)))
    families = {tuple(c[k] for k in matrix.COMPILE_FAMILY) for c in combos if c["compile"]}
    first = [combos[i] for i in order[: len(families)]]
    assert all(c["compile"] for c in first)
    assert {tuple(c[k] for k in matrix.COMPILE_FAMILY) for c in first} == families
    rest = order[len(families) :]
    assert rest == sorted(rest)  # all check all: in their order


def test_the_help_combinations_go_to_a_worker_a_batch_at_a_time():
    """Each check alone (they take seconds to minutes: the jobs finish together); the --help
    combinations BATCH at a time, in the schedule's order, every one exactly once."""
    combos = matrix.combinations()
    plans = matrix.plans(combos)  # without the texts, each combination no primary runs --help
    order = matrix.schedule(combos, plans)

    batches = runner.batches(order, plans)

    assert [i for batch in batches for i in batch] == order
    for batch in batches:
        kinds = {plans[i].which for i in batch}
        assert len(batch) == 1 or (kinds == {"import"} and len(batch) <= runner.BATCH)
    assert sum(len(b) > 1 for b in batches) >= (len(combos) - 1000) // runner.BATCH


def test_generation_checks_run_on_a_folder_its_own_prepare_wrote(tmp_path):
    """bf16 with accumulation: BPE token files, trained with --documents; the resume check's run
    records the prepared folder, its tokenizer and digest."""
    only = ["task=generation", "tracker=none", "device=cpu", "precision=bf16", "finetune=no"]
    only.append("streaming=no")
    combos = matrix.select(
        matrix.combinations(), [*only, "grad_accum_steps=4", "compile=no", "distributed=none"]
    )

    [outcome] = matrix.run_matrix(
        combos, jobs=1, workdir=tmp_path, keep=True, timeout=600, full=True
    )

    assert outcome.passed, outcome.tail()
    assert set(outcome.seconds) == {"render", "lint", "prepare", "check"}
    project = tmp_path / "0000" / runner.LONGEST_NAME
    meta = json.loads((project / runner.PREPARED / "meta.json").read_text())
    record = json.loads((project / "runs/check/resume/uninterrupted/run.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["train_documents"] == 1350
    assert record["data"]["source"] == runner.PREPARED
    assert record["data"]["digest"] == meta["digest"] and record["config"]["documents"] is True
    assert "nor on its padding" in (tmp_path / "0000" / "check.log").read_text()


def _cross_job(tmp_path: Path, template: Path) -> runner.Job:
    """A generation ddp cross (wandb on cuda), checked as the matrix checks it."""
    answers = {"task": "generation", "tracker": "wandb", "device": "cuda", "distributed": "ddp"}
    [combo] = [
        c
        for c in matrix.select(matrix.combinations(), [f"{k}={v}" for k, v in answers.items()])
        if c["precision"] == "fp32" and c["grad_accum_steps"] == 1 and not c["compile"]
        if not c["finetune"] and not c["streaming"]
    ]
    plan = matrix.Plan(which=plan_module.CROSS_CHECK, options={})
    return runner.Job(
        answers=combo,
        plan=plan,
        folder=tmp_path / "0000",
        template=template,
        native_device=False,
        threads=1,
        keep=True,
        timeout=300,
        fork=False,  # a fresh interpreter: pytest's own process is not forked from
    )


def test_a_cross_imports_its_project_and_fails_on_a_module_that_does_not_load(tmp_path):
    """A cross runs its project's --help: one process, no prepare. A module that does not import
    (its import resolves only at run time, so the lint passes) fails it at that step."""
    template = tmp_path / "template"
    shutil.copytree(REPO / "templates", template)

    good = runner._run_one(_cross_job(tmp_path / "good", template))

    assert good.passed, good.tail()
    assert set(good.seconds) == {"render", "check"}  # no prepare, no check run (linted before)

    tracker = template / "trackers" / "wandb" / "runtime" / "tracking.py.jinja"
    tracker.write_text(tracker.read_text() + '\n\n_missing = __import__("no_such_module")\n')
    bad = runner._run_one(_cross_job(tmp_path / "bad", template))

    assert not bad.passed and bad.step == "check"
    assert "No module named 'no_such_module'" in bad.output


def test_a_plan_of_two_checks_runs_the_second_after_the_first_with_its_own_options(tmp_path):
    """A finetune primary's plan: check resume, a short train, then check init from the checkpoint
    that left (--init-from, in a finetune render); each its own command and log, the options
    after the first only the later check's."""
    only = ["task=regression", "tracker=none", "device=cpu", "distributed=none", "precision=fp32"]
    only += ["grad_accum_steps=1", "compile=no", "finetune=no", "streaming=no"]
    [combo] = matrix.select(matrix.combinations(), only)
    then = ("train", "init")
    plan = matrix.Plan(which="resume", options={}, then=then, then_options={"lr": 0.002})
    job = runner.Job(
        answers=combo,
        plan=plan,
        folder=tmp_path / "0000",
        template=None,
        native_device=False,
        threads=1,
        keep=True,
        timeout=300,
        fork=False,
    )

    outcome = runner._run_one(job)

    assert outcome.passed, outcome.tail()
    project = job.folder / matrix.LONGEST_NAME
    assert "--lr" not in runner._check_command(project, job)
    assert runner._check_command(project, job, "init")[-2:] == ["--lr", "0.002"]
    assert runner._check_command(project, job, "train")[3:8] == [
        "train",
        "--run-dir",
        plan_module.SOURCE_RUN,
        "--max-steps",
        str(plan_module.SOURCE_STEPS),
    ]
    assert "--lr" not in runner._check_command(project, job, "train")
    first, then = (job.folder / log for log in ("check.log", "check-init.log"))
    assert "resume: PASS" in first.read_text() and "init: " not in first.read_text()
    assert "init: PASS" in then.read_text() and "resume" not in then.read_text()
    assert (job.folder / "check-train.log").is_file()
    assert (project / plan_module.INIT_SOURCE / "best.pt").is_file()  # what init loads there
