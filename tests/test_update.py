"""`scaffold update`: changed answers and template changes merged into an edited project.

Each test makes a project, edits and commits it as its owner would, then updates it. Template
upgrades are simulated with a copy of templates/ that the test changes between two renders, or
with an older template kept in tests/fixtures/ (the layout before runtime/ and tools/, the
training step in runtime/engine.py, the modules before their splits).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, checks_passed, snapshot

from scaffold import update
from scaffold.errors import ScaffoldError
from scaffold.git import PRISTINE_BRANCH
from scaffold.questions import _copier_yml, load_questions, machine_facts, template_dir
from scaffold.render import new_project

SUITE = "bad input (scaffolder)"  # counted with test_bad_input's interrupts of `scaffold new`
# Answers pinned so that a GPU machine's defaults do not change what an update changes.
PINNED = ("--device", "cpu", "--precision", "fp32", "--no-compile", "--grad-accum-steps", "1")
CONFIG = "src/demo/config.py"
CONFIG_JINJA = "project/src/{{ package_name }}/config.py.jinja"


def git(project, *args) -> str:
    return subprocess.run(
        ["git", *args], cwd=project, capture_output=True, text=True, check=True
    ).stdout.strip()


def replace_once(path, pattern: str, replacement: str) -> None:
    text, count = re.subn(pattern, replacement, path.read_text())
    assert count == 1, f"{pattern!r} should occur once in {path}"
    path.write_text(text)


def edit_as_owner(project) -> None:
    """A committed edit (a shorter warmup), a committed new file and an untracked one."""
    warmup = r"warmup_steps: int = fixed\(\d+\)"
    replace_once(project / CONFIG, warmup, "warmup_steps: int = fixed(50)")
    (project / "NOTES.md").write_text("# Our runs\n\nlr 3e-3 diverges on the big set.\n")
    git(project, "add", CONFIG, "NOTES.md")
    git(project, "-c", "user.name=Owner", "-c", "user.email=o@example.com", "commit", "-qm", "mine")
    (project / "scratch.txt").write_text("not committed\n")


def owner_work_is_intact(project) -> None:
    assert "warmup_steps: int = fixed(50)" in (project / CONFIG).read_text()
    assert (project / "NOTES.md").read_text() == "# Our runs\n\nlr 3e-3 diverges on the big set.\n"
    assert (project / "scratch.txt").read_text() == "not committed\n"


def merged_the_pristine_branch(project) -> None:
    """HEAD is a merge commit whose second parent is the newest pristine render."""
    assert git(project, "rev-parse", "HEAD^2") == git(project, "rev-parse", PRISTINE_BRANCH)
    assert git(project, "status", "--porcelain") == "?? scratch.txt"


def clone(project, tmp_path):
    """A fresh clone: the pristine branch exists only as origin/scaffold/template."""
    copy = tmp_path / "elsewhere" / "demo"
    subprocess.run(["git", "clone", "-q", str(project), str(copy)], check=True)
    (copy / "scratch.txt").write_text("not committed\n")
    assert git(copy, "branch", "--list", PRISTINE_BRANCH) == ""
    return copy


def files_and_refs(project) -> tuple:
    """The working tree, index, branches and HEAD: everything of a project but git's objects."""
    files = {k: v for k, v in snapshot(project).items() if not k.startswith(".git/")}
    return files, git(project, "ls-files", "-s"), git(project, "show-ref", "--head")


def saved_answers(project) -> dict:
    return yaml.safe_load((project / ".copier-answers.yml").read_text())


def run_project_checks(project) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "demo", "check", "all", "--device", "cpu"],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def template(tmp_path, monkeypatch):
    """A copy of the installed template, which `scaffold update` then takes as its own."""
    copy = tmp_path / "template"
    shutil.copytree(template_dir(), copy)
    monkeypatch.setattr(update, "template_dir", lambda: copy)
    return copy


# --- (a) and (e): an answer changed by a flag ---------------------------------------------


@pytest.mark.parametrize("where", ["project", "fresh clone"])
def test_answer_change_keeps_the_edit_and_brings_the_new_code(scaffold, tmp_path, where):
    scaffold("new", tmp_path / "demo", *PINNED)
    edit_as_owner(tmp_path / "demo")
    project = tmp_path / "demo" if where == "project" else clone(tmp_path / "demo", tmp_path)

    ran = scaffold("update", project, "--precision", "bf16")

    assert ran.exit_code == 0, ran.stderr
    assert "precision: fp32 -> bf16" in ran.stdout and "Updated" in ran.stdout
    owner_work_is_intact(project)
    assert 'PRECISION = "bf16"' in (project / "src/demo/runtime/engine.py").read_text()
    assert saved_answers(project)["precision"] == "bf16"
    merged_the_pristine_branch(project)


NO_TRACKER = pytest.mark.skipif(
    "tracker" not in load_questions(), reason="copier.yml has no tracker yet"
)


@NO_TRACKER
def test_tracker_arrives_in_an_edited_project(scaffold, tmp_path):
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED, "--tracker", "none")
    edit_as_owner(project)

    ran = scaffold("update", project, "--tracker", "tensorboard")

    assert ran.exit_code == 0, ran.stderr
    owner_work_is_intact(project)
    assert saved_answers(project)["tracker"] == "tensorboard"
    assert '"tensorboard' in (project / "pyproject.toml").read_text()  # its dependency
    sources = "".join(p.read_text() for p in (project / "src/demo").rglob("*.py"))
    assert "tensorboard" in sources.lower()
    merged_the_pristine_branch(project)


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--precision", "bf16"], id="bf16"),
        pytest.param(["--tracker", "tensorboard"], marks=NO_TRACKER, id="tensorboard"),
    ],
)
def test_updated_project_passes_its_checks(scaffold, tmp_path, flags):
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED)
    edit_as_owner(project)
    assert scaffold("update", project, *flags).exit_code == 0
    if "tensorboard" in flags:
        pytest.importorskip("tensorboard", reason="the tensorboard project's checks need it")

    checks = run_project_checks(project)

    assert checks_passed(checks), checks.stdout + checks.stderr
    assert "resume check matched: yes" in checks.stdout


def test_same_answers_and_template_is_nothing_to_update(scaffold, tmp_path):
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED)
    edit_as_owner(project)
    before = snapshot(project)

    ran = scaffold("update", project, "--precision", "fp32")

    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout.startswith("Nothing to update")
    assert snapshot(project) == before


# --- (b) and (e): a newer template --------------------------------------------------------


@pytest.mark.parametrize("where", ["project", "fresh clone"])
def test_template_change_reaches_an_edited_project(tmp_path, template, where):
    new_project(tmp_path / "demo", {"device": "cpu", "precision": "fp32"}, template=template)
    first_render = git(tmp_path / "demo", "rev-parse", PRISTINE_BRANCH)
    edit_as_owner(tmp_path / "demo")
    project = tmp_path / "demo" if where == "project" else clone(tmp_path / "demo", tmp_path)
    # The next version of the template: a new helper in config.py, and a new file.
    with (template / CONFIG_JINJA).open("a") as config:
        config.write('\n\ndef summary(cfg: Config) -> str:\n    return f"{cfg.lr=}"\n')
    (template / "project" / "UPGRADING.md.jinja").write_text("Run {{ package_name }}.\n")

    result = update.update_project(project, template=template)

    assert result.status == "merged"
    assert set(result.files) == {CONFIG, "UPGRADING.md"}
    owner_work_is_intact(project)
    assert "def summary(cfg: Config) -> str:" in (project / CONFIG).read_text()
    assert (project / "UPGRADING.md").read_text() == "Run demo.\n"
    merged_the_pristine_branch(project)
    assert git(project, "rev-parse", f"{PRISTINE_BRANCH}^") == first_render


# --- (c): an edit on the same lines as a template change ----------------------------------


def test_edit_on_the_same_lines_conflicts_with_markers(scaffold, tmp_path, template):
    project = tmp_path / "demo"
    new_project(project, {"device": "cpu", "precision": "fp32"}, template=template)
    edit_as_owner(project)
    warmup = r"warmup_steps: int = fixed\(\d+\)"
    replace_once(template / CONFIG_JINJA, warmup, "warmup_steps: int = fixed(200)")

    ran = scaffold("update", project)

    assert ran.exit_code == 1
    assert ran.stderr_lines[0].startswith("error: the update conflicts with edits")
    assert ran.stderr_lines[1] == f"    {CONFIG}"
    assert all(step in ran.stderr for step in ("git add", "git commit", "git merge --abort"))
    config = (project / CONFIG).read_text()
    assert re.search(
        r"<<<<<<< .*\n.*warmup_steps: int = fixed\(50\).*\n=======\n"
        r".*warmup_steps: int = fixed\(200\).*\n>>>>>>> ",
        config,
    ), config
    owner_work_is_intact(project)  # the file the conflict is in aside

    # The owner finishes as told (keeping their warmup); the next update has nothing to do.
    replace_once(project / CONFIG, r"<<<<<<< .*\n(.*\n)=======\n.*\n>>>>>>> .*\n", r"\1")
    git(project, "add", CONFIG)
    git(project, "-c", "user.name=Owner", "-c", "user.email=o@example.com", "commit", "-q",
        "--no-edit")  # fmt: skip
    assert scaffold("update", project).stdout.startswith("Nothing to update")
    assert "warmup_steps: int = fixed(50)" in (project / CONFIG).read_text()


# --- a project of the flat layout, moved to the current one ------------------------------

# The template before the package was split into the user's files, runtime/ and tools/.
FLAT_LAYOUT = Path(__file__).parent / "fixtures" / "template-flat-layout.tar.gz"
# The owner's edits, each (file, text as rendered, text as edited): the files the split left at the
# package's top, and a line of train.py that the split did not touch (its loop was rewritten into
# named steps, so an edit inside the old loop conflicts, as it should). Should a later template
# change one of these lines, the update rightly conflicts: edit another line instead.
USER_FILE_EDITS = [
    (
        "src/demo/model.py",
        "F.cross_entropy(logits.float(), y)",
        'F.cross_entropy(logits.float(), y, reduction="mean")',
    ),
    ("src/demo/data.py", "def synthetic_data(n: int = 4096,", "def synthetic_data(n: int = 6000,"),
    (
        "src/demo/train.py",
        '"resume with its settings, or start a new --run-dir"',
        '"resume with its settings, or start a new --run-dir (see NOTES.md)"',
    ),
]
# The same edits where a new project has those lines: check_resumable, with the train.py edit,
# has since moved into runtime/resume.py, and the update carries the edit there with it.
USER_FILE_EDITS_NOW = [
    (path.replace("src/demo/train.py", "src/demo/runtime/resume.py"), text, edited)
    for path, text, edited in USER_FILE_EDITS
]


@pytest.fixture
def flat_project(tmp_path):
    """A project rendered by the template of the flat layout (tests/fixtures/README.md)."""
    with tarfile.open(FLAT_LAYOUT) as archive:
        archive.extractall(tmp_path / "flat", filter="data")
    answers = {"device": "cpu", "precision": "fp32"}
    project = new_project(tmp_path / "demo", answers, template=tmp_path / "flat" / "templates").path
    assert (project / "src/demo/engine.py").is_file()
    assert not (project / "src/demo/runtime").exists()
    return project


def make_edits(folder, edits) -> None:
    for path, text, edited in edits:
        content = (folder / path).read_text()
        assert content.count(text) == 1, f"{text!r} should occur once in {path}"
        (folder / path).write_text(content.replace(text, edited))


def edit_and_commit(project, edits) -> None:
    make_edits(project, edits)
    owner = ("-c", "user.name=Owner", "-c", "user.email=o@example.com")
    git(project, *owner, "commit", "-qam", "mine")


def files_of(folder) -> dict:
    return {k: v for k, v in snapshot(folder).items() if not k.startswith(".git/")}


def new_project_with(tmp_path, edits, answers=None) -> dict:
    """The files of a new project of the installed template, with `edits` made to them."""
    answers = answers or {"device": "cpu", "precision": "fp32"}
    fresh = new_project(tmp_path / "fresh" / "demo", answers).path
    make_edits(fresh, edits)
    return files_of(fresh)


@pytest.mark.slow
def test_flat_project_moves_to_the_new_layout_with_its_edits(scaffold, tmp_path, flat_project):
    edit_and_commit(flat_project, USER_FILE_EDITS)

    ran = scaffold("update", flat_project)

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    # each question newer than the project (finetune, streaming) is said with its default first
    assert re.match(r"(\w+: False \(new\)\n)*Updated", ran.stdout), ran.stdout
    package = flat_project / "src/demo"
    assert not (package / "engine.py").exists() and not (package / "checks.py").exists()
    for moved in ("runtime/engine.py", "tools/checks.py", "optim.py"):
        assert (package / moved).is_file(), moved
    for path, _, edited in USER_FILE_EDITS_NOW:
        assert edited in (flat_project / path).read_text(), path
    # A new project's files exactly, with the owner's edits: nothing of the old layout is left.
    assert files_of(flat_project) == new_project_with(tmp_path, USER_FILE_EDITS_NOW)
    assert git(flat_project, "status", "--porcelain") == ""

    checks = run_project_checks(flat_project)

    assert checks_passed(checks), checks.stdout + checks.stderr
    assert "resume check matched: yes" in checks.stdout
    assert any(line.startswith("overfit: PASS") for line in checks.stdout.splitlines())

    # The update brought the reading of tables as they come: text, gaps and a named label.
    rows = "".join(f"{'AB'[i % 2]},{i % 7 or ''},{'xy'[i % 3 > 0]}\n" for i in range(400))
    (flat_project / "t.csv").write_text("kind,size,species\n" + rows)
    command = [sys.executable, "-m", "demo", "inspect-data", "--data", "t.csv", "--label", "kind"]
    env = {**os.environ, "PYTHONPATH": str(flat_project / "src")}
    seen = subprocess.run(command, cwd=flat_project, env=env, capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    assert "species: text, 0.0% missing; 2 levels" in seen.stdout
    assert re.search(r"size: number, 1\d\.\d% missing \(an indicator feature\)", seen.stdout)


def test_edit_of_a_moved_machinery_file_moves_with_it(scaffold, tmp_path, flat_project):
    """An edit of engine.py's setup reaches runtime/engine.py, where setup now is."""
    devices = '"cpu": True, "cuda": torch.cuda.is_available()'
    edited = '"cpu": True, "cuda": torch.cuda.device_count() > 0'
    edit_and_commit(flat_project, [*USER_FILE_EDITS, ("src/demo/engine.py", devices, edited)])

    ran = scaffold("update", flat_project)

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    moved = ("src/demo/runtime/engine.py", devices, edited)
    assert files_of(flat_project) == new_project_with(tmp_path, [*USER_FILE_EDITS_NOW, moved])


def test_edit_of_code_moved_to_another_file_follows_it(scaffold, tmp_path, flat_project):
    """build_optimizer moved from engine.py to optim.py: git alone cannot follow code out of a
    file (the owner's edit was a conflict in runtime/engine.py), so the update moves it first."""
    adamw = "torch.optim.AdamW(groups, lr=cfg.lr, fused=True)"
    betas = "torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)"
    edit_and_commit(flat_project, [*USER_FILE_EDITS, ("src/demo/engine.py", adamw, betas)])

    ran = scaffold("update", flat_project)

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    assert "  moved build_optimizer, lr_factor from src/demo/engine.py to src/demo/optim.py" in (
        ran.stdout
    )
    moved = ("src/demo/optim.py", adamw, betas)
    assert files_of(flat_project) == new_project_with(tmp_path, [*USER_FILE_EDITS_NOW, moved])


# --- a project of the layout with the training step in runtime/engine.py ------------------

# The template before train_step and evaluate moved from runtime/engine.py into train.py.
ENGINE_STEP = Path(__file__).parent / "fixtures" / "template-engine-step.tar.gz"


@pytest.fixture
def engine_step_project(tmp_path):
    """A project rendered by the template of tests/fixtures/template-engine-step.tar.gz."""
    with tarfile.open(ENGINE_STEP) as archive:
        archive.extractall(tmp_path / "engine-step", filter="data")
    template = tmp_path / "engine-step" / "templates"
    project = new_project(
        tmp_path / "demo", {"device": "cpu", "precision": "fp32"}, template=template
    )
    assert "def train_step(" in (project.path / "src/demo/runtime/engine.py").read_text()
    return project.path


def test_edit_of_the_old_engine_step_follows_it_into_train_py(
    scaffold, tmp_path, engine_step_project
):
    """The owner's edit inside train_step, which the template moved into train.py, goes there
    with it (git alone would leave it as a conflict in runtime/engine.py). The edited line is
    one the move left alone with its neighbours: the move (ff57263) put a line after
    `engine.optimizer.zero_grad(...)` and changed the one before it, so an edit of that line
    rightly conflicts, in train.py."""
    batch = "x, y = next(batches)"
    edited = f"{batch}  # one micro-batch"
    edit_and_commit(engine_step_project, [("src/demo/runtime/engine.py", batch, edited)])

    ran = scaffold("update", engine_step_project)

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    # each question newer than the project (finetune, streaming) is said with its default first
    assert re.match(r"(\w+: False \(new\)\n)*Updated", ran.stdout), ran.stdout
    assert edited in (engine_step_project / "src/demo/train.py").read_text()
    assert batch not in (engine_step_project / "src/demo/runtime/engine.py").read_text()
    moved = ("src/demo/train.py", batch, edited)
    assert files_of(engine_step_project) == new_project_with(tmp_path, [moved])


# --- a project of the template before its modules were split --------------------------------

# The template of 1a11658, before FSDP's parts of runtime/distributed.py moved into
# runtime/sharding.py, the shard cache of runtime/shards.py into runtime/shardcache.py,
# stage_run and check_shared into runtime/rundir.py, sample_rng and read_batch from
# runtime/loader.py into datatools.py, and before the step took one autocast and one GradScaler.
BEFORE_SPLITS = Path(__file__).parent / "fixtures" / "template-before-splits.tar.gz"
CPU_FP32 = {"device": "cpu", "precision": "fp32"}
# The owner's edits, each (definition, its file in the old render, its file now, text as
# rendered, text as edited): inside definitions the template moved to another file, and where
# nothing moved (model.py; train.py's step, whose precision lines changed around the edit).
# Each edited line is one the template left as it was, and its neighbours too: git conflicts
# on an edit next to a changed line (rightly), so should a later template change one, edit
# another line instead.
EDITS_OF_EVERY_RENDER = [
    (
        "sample_rng",
        "src/demo/runtime/loader.py",
        "src/demo/datatools.py",
        'int.from_bytes(key, "little") >> 1)',
        'int.from_bytes(key, "little") >> 1)  # a seed of 63 bits',
    ),
    (
        "train_step",
        "src/demo/train.py",
        "src/demo/train.py",
        "x, y = next(batches)",
        "x, y = next(batches)  # one micro-batch",
    ),
]
SPLIT_RENDERS = {
    "default": (
        CPU_FP32,
        [
            (
                "stage_run",
                "src/demo/runtime/distributed.py",
                "src/demo/runtime/rundir.py",
                "store.pull()",
                "store.pull()  # the newest checkpoint",
            ),
            (
                "compute_loss",
                "src/demo/model.py",
                "src/demo/model.py",
                "F.cross_entropy(logits.float(), y)",
                "F.cross_entropy(logits.float(), y, label_smoothing=0.1)",
            ),
        ],
    ),
    "custom-fsdp-streaming-finetune": (
        {**CPU_FP32, "task": "custom", "distributed": "fsdp", "streaming": True, "finetune": True},
        [
            # not the line `store.pull()`: the template changed the one after it (`barrier()`)
            (
                "stage_run",
                "src/demo/runtime/distributed.py",
                "src/demo/runtime/rundir.py",
                "check_shared(store.local, group, store.url)",
                "check_shared(store.local, group, store.url)  # before any rank writes",
            ),
            (
                "materialize",
                "src/demo/runtime/distributed.py",
                "src/demo/runtime/sharding.py",
                "torch.manual_seed(cfg.seed)",
                "torch.manual_seed(cfg.seed)  # the same draws on every rank",
            ),
            (
                "cache_bytes",
                "src/demo/runtime/shards.py",
                "src/demo/runtime/shardcache.py",
                "give a size such as 20GB or 500MB",
                "give a size such as 20GB, 500MB or 1.5TB",
            ),
            (
                "compute_loss",
                "src/demo/model.py",
                "src/demo/model.py",
                "return F.mse_loss(output.float(), targets)",
                'return F.mse_loss(output.float(), targets, reduction="mean")',
            ),
        ],
    ),
}


def updated_from_before_the_splits(scaffold, tmp_path, render: str) -> Path:
    """A project of the template of 1a11658 with the owner's edits of `render`, committed, then
    updated to the installed template: checked to be a new project's files with the edits where
    the code now lives, every move followed and nothing left behind in the old files."""
    answers, edits = SPLIT_RENDERS[render]
    edits = [*EDITS_OF_EVERY_RENDER, *edits]
    with tarfile.open(BEFORE_SPLITS) as archive:
        archive.extractall(tmp_path / "before-splits", filter="data")
    old_template = tmp_path / "before-splits" / "templates"
    project = new_project(tmp_path / "demo", answers, template=old_template).path
    edit_and_commit(project, [(old, text, edited) for _, old, _, text, edited in edits])

    ran = scaffold("update", project)

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith(f"Updated {project}: merged"), ran.stdout
    for name, old, new, _, edited in edits:
        assert edited in (project / new).read_text(), (name, new)
        if old != new:
            moved = rf"^  moved (\w+, )*{name}(, \w+)* from {re.escape(old)} to {re.escape(new)} "
            assert re.search(moved, ran.stdout, re.MULTILINE), (name, ran.stdout)
            left = (project / old).read_text()
            assert f"def {name}(" not in left and edited not in left, (name, old)
    # Exactly a new project's files with the edits: nothing of the old modules is left.
    now = [(new, text, edited) for _, _, new, text, edited in edits]
    assert files_of(project) == new_project_with(tmp_path, now, answers)
    assert git(project, "status", "--porcelain") == ""
    return project


@pytest.mark.parametrize("render", list(SPLIT_RENDERS))
def test_project_from_before_the_splits_keeps_its_edits_where_the_code_went(
    scaffold, tmp_path, render
):
    """The owner's edits follow their definitions into sharding.py, shardcache.py, rundir.py
    and datatools.py, stay in model.py and train.py, and the files they are in lint clean.
    Every other file is a new render's own (which the matrix imports and checks), so those
    files are all the update could break."""
    project = updated_from_before_the_splits(scaffold, tmp_path, render)

    edits = [*EDITS_OF_EVERY_RENDER, *SPLIT_RENDERS[render][1]]
    edited_files = sorted({new for _, _, new, _, _ in edits})
    for lint in (["ruff", "check"], ["ruff", "format", "--check"]):
        linted = subprocess.run(
            [*lint, "--no-cache", "-q", *edited_files], cwd=project, capture_output=True, text=True
        )
        assert linted.returncode == 0, linted.stdout + linted.stderr


# --- definitions the template moved from one file to another ------------------------------

# A tiny template of two versions: the second moves train_step from engine.py into train.py
# (before main) and check_resumable from train.py into a new resume.py, changes two lines of
# train.py, one of them inside train_step, and adds UPGRADING.md.
TINY_COPIER_YML = """\
_subdirectory: project
_answers_file: .copier-answers.yml
project_name:
  type: str
  help: Project name
  default: "{{ _copier_conf.dst_path | realpath | basename }}"
package_name:
  type: str
  default: "{{ project_name }}"
  when: false
"""
ENGINE_V1 = '''"""The machinery."""

import functools


def setup(seed: int) -> int:
    seed = seed + 1
    return seed * 2


# One optimizer step: forward, backward, update.
@functools.cache
def train_step(model, batch):
    model.train()
    loss = model(batch)
    loss = loss * 1.0
    loss.backward()
    return loss


def evaluate(model, batches):
    return sum(model(b) for b in batches)
'''
TRAIN_V1 = '''"""The loop."""

from . import engine


def check_resumable(run):
    if run is None:
        return False
    return run.step > 0


def main(run=None):
    engine.setup(0)
    check_resumable(run)
    print("done")
'''
ENGINE_V2 = '''"""The machinery."""

import functools


def setup(seed: int) -> int:
    seed = seed + 1
    return seed * 2


def evaluate(model, batches):
    return sum(model(b) for b in batches)
'''
TRAIN_V2 = '''"""The loop."""

import functools

from . import engine
from .resume import check_resumable


# One optimizer step: forward, backward, update.
@functools.cache
def train_step(model, batch):
    model.train(mode=True)
    loss = model(batch)
    loss = loss * 1.0
    loss.backward()
    return loss


def main(run=None):
    engine.setup(0)
    check_resumable(run)
    print("finished")
'''
RESUME_V2 = '''"""The resume policy."""


def check_resumable(run):
    if run is None:
        return False
    return run.step > 0
'''
STEP_EDIT = ("src/demo/engine.py", "loss = loss * 1.0", "loss = loss * 0.5  # halved")
RESUMABLE_EDIT = ("src/demo/train.py", "return run.step > 0", "return run.step >= 0  # ours")
MOVE_LINES = [
    "check_resumable from src/demo/train.py to src/demo/resume.py",
    "train_step from src/demo/engine.py to src/demo/train.py",
]


def write_tiny_template(folder, modules: dict[str, str]) -> None:
    package = folder / "project" / "src" / "{{ package_name }}"
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    (folder / "copier.yml").write_text(TINY_COPIER_YML)
    answers = "{{ _copier_conf.answers_file }}.jinja"  # the installed template's: no _src_path
    shutil.copy(template_dir() / "project" / answers, folder / "project" / answers)
    for name, text in modules.items():
        (package / name).write_text(text)


def upgrade(template) -> None:
    """The tiny template's second version."""
    write_tiny_template(template, {"engine.py": ENGINE_V2, "train.py": TRAIN_V2})
    (template / "project" / "src" / "{{ package_name }}" / "resume.py").write_text(RESUME_V2)
    (template / "project" / "UPGRADING.md.jinja").write_text("Run {{ package_name }}.\n")


@pytest.fixture
def moving(tmp_path):
    """(template, project): a project of the tiny template's first version."""
    template = tmp_path / "tiny"
    write_tiny_template(template, {"engine.py": ENGINE_V1, "train.py": TRAIN_V1})
    return template, new_project(tmp_path / "demo", {}, template=template).path


def second_version_with(tmp_path, edits) -> dict:
    """The files of a new project of the tiny template's second version, with `edits` made."""
    upgrade(tmp_path / "tiny-v2")
    fresh = new_project(tmp_path / "fresh" / "demo", {}, template=tmp_path / "tiny-v2").path
    make_edits(fresh, edits)
    return files_of(fresh)


def test_edit_inside_a_moved_function_lands_in_its_new_file(tmp_path, moving):
    template, project = moving
    first_render = git(project, "rev-parse", PRISTINE_BRANCH)
    edit_and_commit(project, [STEP_EDIT, RESUMABLE_EDIT])
    mine = git(project, "rev-parse", "HEAD")
    upgrade(template)

    result = update.update_project(project, template=template)

    assert result.status == "merged" and result.moved == MOVE_LINES
    step = ("src/demo/train.py", *STEP_EDIT[1:])
    resumable = ("src/demo/resume.py", *RESUMABLE_EDIT[1:])
    assert files_of(project) == second_version_with(tmp_path, [step, resumable])
    # The owner's branch: their commit, the moves (merging the pristine moves), the update.
    moved = git(project, "rev-parse", "HEAD^1")
    assert git(project, "rev-parse", f"{moved}^1") == mine
    message = git(project, "log", "-1", "--format=%B", moved)
    assert message.startswith(
        "scaffold update: move definitions to the files where the template now has them\n\n"
        + "".join(f"    {line}\n" for line in MOVE_LINES)
    ), message
    # The pristine branch: the first render, the same moves, the new render.
    pristine_moves = git(project, "rev-parse", f"{PRISTINE_BRANCH}^")
    assert git(project, "rev-parse", f"{moved}^2") == pristine_moves
    assert git(project, "rev-parse", f"{pristine_moves}^") == first_render
    # engine.py, where the template only took code out, is the new render's to the byte;
    # resume.py, which the template added, starts with the moved function alone.
    assert git(project, "diff", pristine_moves, PRISTINE_BRANCH, "--", "src/demo/engine.py") == ""
    started = git(project, "show", f"{pristine_moves}:src/demo/resume.py") + "\n"
    assert started == RESUME_V2[RESUME_V2.index("def ") :]


def test_edit_elsewhere_in_the_old_file_still_merges(tmp_path, moving):
    template, project = moving
    seed = ("src/demo/engine.py", "seed = seed + 1", "seed = seed + 7  # ours")
    shown = ("src/demo/train.py", "engine.setup(0)", "engine.setup(1)")
    edit_and_commit(project, [seed, shown])
    upgrade(template)

    result = update.update_project(project, template=template)

    assert result.status == "merged" and result.moved == MOVE_LINES
    assert files_of(project) == second_version_with(tmp_path, [seed, shown])


def delete_and_commit(project, names) -> None:
    """The owner deletes the functions `names` of the tiny template's first version."""
    for name in names:
        path = project / ("src/demo/engine.py" if name == "train_step" else "src/demo/train.py")
        text = path.read_text()
        block = re.search(rf"\n\n(# .*\n)?(@.*\n)?def {name}\(.*?\n(?=\n|\Z)", text, re.DOTALL)
        path.write_text(text.replace(block.group(), ""))
    git(project, "-c", "user.name=Owner", "-c", "user.email=o@example.com", "commit", "-qam", "-")


def without_commit_ids(files: dict) -> dict:
    """`files` with the commit ids of conflict markers (`>>>>>>> 1a76b8a...`) left out."""
    marker = re.compile(rb"^(>>>>>>>) [0-9a-f]{40}$", re.MULTILINE)
    return {k: marker.sub(rb"\1", v) if isinstance(v, bytes) else v for k, v in files.items()}


def test_owner_who_deleted_the_moved_functions_gets_the_old_behaviour(
    tmp_path, moving, monkeypatch
):
    """Nothing to move where the owner deleted the functions: no move commit, and the update
    does what it did before moves were followed (here a conflict in train.py, where the owner
    deleted check_resumable and the template put train_step)."""
    template, project = moving
    delete_and_commit(project, ["train_step", "check_resumable"])
    mine = git(project, "rev-parse", "HEAD")
    previous = git(project, "rev-parse", PRISTINE_BRANCH)
    upgrade(template)
    unfollowed = tmp_path / "unfollowed" / "demo"
    shutil.copytree(project, unfollowed, symlinks=True)

    result = update.update_project(project, template=template)

    assert result.moved == []
    assert git(project, "rev-parse", "HEAD") == mine  # its merge commit aside
    assert git(project, "rev-parse", f"{PRISTINE_BRANCH}^") == previous
    monkeypatch.setattr(update.moves, "follow", lambda *args: None)
    old = update.update_project(unfollowed, template=template)
    assert (result.status, result.files) == (old.status, old.files)
    assert without_commit_ids(files_of(project)) == without_commit_ids(files_of(unfollowed))


def test_owner_who_deleted_one_moved_function_gets_the_other_moved(tmp_path, moving):
    template, project = moving
    delete_and_commit(project, ["train_step"])
    upgrade(template)

    result = update.update_project(project, template=template)

    assert result.status == "merged" and result.moved == [MOVE_LINES[0]]
    assert git(project, "log", "-1", "--format=%s", "HEAD^1") == (
        "scaffold update: move check_resumable from src/demo/train.py to "
        "src/demo/resume.py, where the template now has it"
    )
    assert "def train_step(" not in (project / "src/demo/engine.py").read_text()
    assert files_of(project) == second_version_with(tmp_path, [])


@pytest.mark.parametrize(
    "in_the_way", ["UPGRADING.md", "src/demo/resume.py"], ids=["of the merge", "of the move"]
)
def test_failed_merge_after_a_move_leaves_the_branch_untouched(moving, in_the_way):
    """An untracked file where the new render adds one: git refuses the merge, after the move
    was committed (or refuses the move); the branch, index, files and refs are put back."""
    template, project = moving
    edit_and_commit(project, [STEP_EDIT])
    (project / in_the_way).write_text("my own notes\n")
    upgrade(template)
    before = files_and_refs(project)

    refusal = "git merge refused" if in_the_way == "UPGRADING.md" else "before the merge"
    with pytest.raises(ScaffoldError, match=rf"{refusal}.*nothing was changed.*{in_the_way}"):
        update.update_project(project, template=template)

    assert files_and_refs(project) == before
    assert git(project, "status", "--porcelain") == f"?? {in_the_way}"
    if in_the_way == "UPGRADING.md":  # the moves were made, then undone
        undone, made = git(project, "reflog", "-2", "--format=%gs", "HEAD").splitlines()
        assert made.endswith("Fast-forward") and undone.startswith("reset: moving to")


# --- (d): refusals that change nothing ----------------------------------------------------


def test_ctrl_c_at_any_moment_leaves_the_project_as_it_was_or_updated(scaffold, tmp_path, tally):
    """A real `scaffold update` stopped by SIGINT at moments across its run: before the merge
    began, one line, exit 130 and nothing changed; once begun, the merge ends and is reported,
    exit 0. It printed a KeyboardInterrupt traceback early, and exited -2 after "Updated"."""
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED)
    edit_as_owner(project)
    before = files_and_refs(project)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def update_copy(name: str, stop_after: float | None) -> tuple[Path, int, str, str]:
        copy = tmp_path / name
        shutil.copytree(project, copy, symlinks=True)
        command = [sys.executable, "-m", "scaffold", "update", str(copy), "--precision", "bf16"]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:  # fmt: skip
            try:
                proc.wait(timeout=stop_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                tally[SUITE]["interrupts sent"] += 1
            out, err = proc.communicate(timeout=120)
        return copy, proc.returncode, out, err

    start = time.monotonic()
    assert update_copy("whole", None)[1] == 0
    whole = time.monotonic() - start
    for k in range(1, 8):  # from the imports to the merge
        copy, code, out, err = update_copy(f"stopped-{k}", whole * k / 8)
        assert code in (0, 130) and "Traceback" not in err, (k, code, err)
        tally[SUITE]["inputs tried"] += 1
        if code == 130:
            assert err.startswith("error: interrupted") and len(err.splitlines()) == 1, err
            assert files_and_refs(copy) == before
            tally[SUITE]["interrupted updates that changed nothing"] += 1
        else:
            assert out.splitlines()[-1].startswith(f"Updated {copy}"), out
            merged_the_pristine_branch(copy)
            tally[SUITE]["interrupted updates complete"] += 1


def _unstaged(project):
    replace_once(project / CONFIG, r"n_layers: int = fixed\(\d+\)", "n_layers: int = fixed(5)")


def _staged(project):
    _unstaged(project)
    git(project, "add", CONFIG)


def _merge_in_progress(project):
    git(project, "checkout", "-qb", "other")
    _staged(project)
    git(project, "-c", "user.name=O", "-c", "user.email=o@o", "commit", "-qm", "five layers")
    git(project, "checkout", "-q", "-")
    replace_once(project / CONFIG, r"n_layers: int = fixed\(\d+\)", "n_layers: int = fixed(7)")
    git(project, "-c", "user.name=O", "-c", "user.email=o@o", "commit", "-qam", "seven layers")
    merge = subprocess.run(["git", "merge", "other"], cwd=project, capture_output=True)
    assert merge.returncode == 1


@pytest.mark.parametrize(
    "make_dirty", [_unstaged, _staged, _merge_in_progress], ids=["unstaged", "staged", "merging"]
)
def test_dirty_tree_is_refused_and_left_untouched(scaffold, tmp_path, make_dirty):
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED)
    make_dirty(project)
    before = snapshot(project)  # .git included: no branch, commit or index change either

    ran = scaffold("update", project, "--precision", "bf16")

    assert ran.exit_code == 2
    assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: "), ran.stderr
    assert "uncommitted changes" in ran.stderr or "merge is in progress" in ran.stderr
    assert snapshot(project) == before


@pytest.mark.parametrize(
    "args", [["--grad-accum-steps", "0"], ["--device", "tpu"]], ids=["invalid", "not a choice"]
)
def test_bad_answer_is_refused_and_changes_nothing(scaffold, tmp_path, args):
    project = tmp_path / "demo"
    scaffold("new", project, *PINNED)
    before = snapshot(project)

    ran = scaffold("update", project, *args)

    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
    assert snapshot(project) == before


@pytest.fixture(scope="module")
def regression_project(tmp_path_factory):
    """A committed regression project with a tracker: what a default render would rewrite."""
    project = tmp_path_factory.mktemp("regression") / "demo"
    new_project(project, {"task": "regression", "tracker": "tensorboard", "device": "cpu"})
    return project


def _without(*names):
    return lambda answers: {k: v for k, v in answers.items() if k not in names}


# The damage, and the start of the one line that refuses it (after "error: <answers file> ").
DAMAGED_ANSWERS = {
    "empty": ("", "has no answers: restore it from git"),
    "only a comment": ("# answers\n", "has no answers: restore it from git"),
    "no task": (_without("task"), "has no answer for task: restore it from git"),
    "no task or tracker": (_without("task", "tracker"), "has no answer for task, tracker:"),
    "task left empty": ({"task": None}, "has task: None (no value): restore it from git"),
    "task misspelt": ({"task": "regresion"}, "has task: 'regresion' (not one of classification,"),
    "compile not a bool": ({"compile": "maybe"}, "has compile: 'maybe' (not true or false)"),
    "refused by a validator": (
        {"grad_accum_steps": 0},
        "has grad_accum_steps: 0 (must be a whole number >= 1): restore it from git",
    ),
}


@pytest.mark.parametrize("damage", DAMAGED_ANSWERS.values(), ids=DAMAGED_ANSWERS)
def test_damaged_answers_file_is_refused_and_changes_nothing(
    scaffold, tmp_path, regression_project, damage
):
    """A missing answer was read as its default: a regression project's data.py and model.py
    became classification's and tracking.py was deleted, in a conflicting merge."""
    text, refusal = damage
    project = tmp_path / "demo"
    shutil.copytree(regression_project, project, symlinks=True)
    answers = project / ".copier-answers.yml"
    if callable(text):
        text = yaml.safe_dump(text(saved_answers(project)))
    elif isinstance(text, dict):
        text = yaml.safe_dump({**saved_answers(project), **text})
    answers.write_text(text)
    git(project, "-c", "user.name=O", "-c", "user.email=o@o", "commit", "-qam", "damage")
    before = snapshot(project), git(project, "status", "--porcelain"), git(project, "branch", "-av")

    ran = scaffold("update", project)

    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
    assert ran.stderr.startswith(f"error: {answers} {refusal}"), ran.stderr
    after = snapshot(project), git(project, "status", "--porcelain"), git(project, "branch", "-av")
    assert after == before


def test_question_added_since_the_last_render_takes_its_default(tmp_path, template):
    """Only the answers the last render recorded are required: a newer template's questions
    are not in an older project's answers file, and must not make it look damaged."""
    project = new_project(tmp_path / "demo", {"device": "cpu"}, template=template).path
    with (template / "copier.yml").open("a") as copier_yml:
        copier_yml.write("\nlicense:\n  type: str\n  help: License\n  default: MIT\n")
    _copier_yml.cache_clear()  # the copy's questions were read before this one was added

    result = update.update_project(project, template=template)

    assert result.status == "merged" and result.changed_answers == {"license": (None, "MIT")}
    assert saved_answers(project)["license"] == "MIT"


def test_project_without_git_is_refused(scaffold, tmp_path):
    scaffold("new", tmp_path / "demo", "--no-git")

    ran = scaffold("update", tmp_path / "demo")

    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1
    assert "not a git repository" in ran.stderr


def test_folder_that_is_not_a_project_is_refused(scaffold, tmp_path):
    ran = scaffold("update", tmp_path)

    assert ran.exit_code == 2 and ran.stderr_lines == [ran.stderr_lines[0]]
    assert "not a scaffold project" in ran.stderr


def test_untracked_file_in_the_way_is_never_overwritten(tmp_path, template):
    project = tmp_path / "demo"
    new_project(project, {"device": "cpu"}, template=template)
    (project / "UPGRADING.md").write_text("my own notes\n")  # untracked, where v2 adds a file
    (template / "project" / "UPGRADING.md.jinja").write_text("Run {{ package_name }}.\n")
    before = files_and_refs(project)

    with pytest.raises(ScaffoldError, match=r"nothing was changed.*UPGRADING\.md"):
        update.update_project(project, template=template)

    # Unreachable objects of the render may stay in .git/objects, for git gc to drop.
    assert files_and_refs(project) == before


# --- the machine the update runs on -------------------------------------------------------


def test_update_works_where_the_project_itself_is_installed(tmp_path, monkeypatch):
    project = tmp_path / "demo"
    new_project(project, {"device": "cpu", "precision": "fp32"})
    facts = machine_facts()  # as after `pip install -e .` of the project: `demo` is importable
    installed = {**facts, "unavailable_packages": [*facts["unavailable_packages"], "demo"]}
    monkeypatch.setattr(update, "machine_facts", lambda: installed)

    result = update.update_project(project, {"precision": "bf16"})

    assert result.status == "merged" and result.changed_answers == {"precision": ("fp32", "bf16")}


def test_update_commits_without_a_git_identity(tmp_path, monkeypatch):
    project = tmp_path / "demo"
    new_project(project, {"device": "cpu", "precision": "fp32"})
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME"):
        monkeypatch.delenv(variable, raising=False)

    result = update.update_project(project, {"precision": "bf16"})

    assert result.status == "merged"
    authors = git(project, "log", "-2", "--format=%an <%ae>", "--all").splitlines()
    assert authors == ["scaffold <scaffold@localhost>"] * 2
