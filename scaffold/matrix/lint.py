"""Lint a rendered project as rendered: ruff with the project's own config, no template residue,
no code of an option not chosen."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from scaffold.errors import ScaffoldError

RESIDUE = re.compile(r"\{%-?\s|\s-?%\}|\{\{\s|\s\}\}|\{#|#\}|\.jinja\b")
_TRACKER_MARKERS = {"tensorboard": "SummaryWriter", "wandb": "wandb", "mlflow": "mlflow"}
_DISTRIBUTED_MARKERS = ("torch.distributed", "torchrun")  # in ddp and fsdp renders alone
_DDP_MARKERS = ("DistributedDataParallel", "no_sync")
_FSDP_MARKERS = ("fully_shard", "torch.distributed.checkpoint as dcp", "set_requires_gradient_sync")
# What asks a cluster for GPUs, in each launcher of scripts/: SLURM, Kubeflow Trainer, SkyPilot.
_GPU_REQUESTS = ("--gpus-per-node", "nvidia.com/gpu", "accelerators:")


RUFF = (
    ["ruff", "check", "--no-cache", "--output-format", "concise"],
    ["ruff", "format", "--no-cache", "--check", "--diff"],
)


def lint_problems(project: Path, answers: dict[str, Any]) -> list[str]:
    """Why `project`, rendered with `answers`, is not clean as rendered ([] when it is): ruff
    with the project's own config, template residue, and code for options not chosen."""
    return lint_many([(project, answers)])[0]


def lint_many(projects: Sequence[tuple[Path, dict[str, Any]]]) -> list[list[str]]:
    """Each project's lint_problems, in order, with each ruff command run once over them all.

    ruff takes each file's settings from the nearest pyproject.toml, each project's own, as it
    does run in the project (tests/test_render.py compares the two); a ruff start costs more than
    linting a project (0.34 s a project alone, 0.06 in a batch of 24). A project the batch's
    output names (or every one, where it names none: ruff could not run) is run again alone,
    so that its problems read exactly as lint_problems words them."""
    again = _ruff_flagged([project for project, _ in projects]) if len(projects) > 1 else None
    result = []
    for i, (project, answers) in enumerate(projects):
        problems = _ruff_problems(project) if again is None or i in again else []
        result.append(problems + _rendered_problems(project, answers))
    return result


def _ruff(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise ScaffoldError("ruff is not installed: pip install ruff") from None


def _ruff_problems(project: Path) -> list[str]:
    """ruff check and ruff format --check, run in `project`: what each finds."""
    problems = []
    for command in RUFF:
        result = _ruff([*command, "."], project)
        if result.returncode != 0:
            problems.append(f"`{' '.join(command[:2])}` failed:\n{result.stdout}{result.stderr}")
    return problems


def _ruff_flagged(projects: Sequence[Path]) -> set[int]:
    """The indexes of the projects whose files ruff, run once over them all, has something to
    say about: every one where it says something about none of them (it could not run)."""
    root = Path(os.path.commonpath([p.resolve() for p in projects]))
    names = [p.resolve().relative_to(root).as_posix() for p in projects]
    flagged: set[int] = set()
    for command in RUFF:
        result = _ruff([*command, *names], root)
        if result.returncode == 0:
            continue
        said = result.stdout + result.stderr
        named = {i for i, name in enumerate(names) if _names(said, name)}
        flagged |= named or set(range(len(projects)))
    return flagged


def _names(output: str, folder: str) -> bool:
    """Whether ruff's `output` names a file under `folder` (at a line's start, or after a space:
    a diff's `--- path`)."""
    return re.search(rf"(^|\s){re.escape(folder)}/", output, re.MULTILINE) is not None


def _rendered_problems(project: Path, answers: dict[str, Any]) -> list[str]:
    """Template residue, a REPLACE ME or TODO, Python that does not parse, and code (or a
    dependency, or a launcher's GPU request) of an option not chosen."""
    problems = []
    files = [p for p in sorted(project.rglob("*")) if p.is_file() and ".git" not in p.parts]
    texts = {path: path.read_text(encoding="utf-8") for path in files}
    for path, text in texts.items():
        where = path.relative_to(project)
        if RESIDUE.search(text):
            problems.append(f"template residue in {where}")
        if "REPLACE ME" in text or "TODO" in text:
            problems.append(f"a REPLACE ME or TODO left in {where}")
        if path.suffix == ".py" and (error := _compile_error(text)):
            problems.append(f"the project's Python does not parse: {where}: {error}")
    source = "\n".join(text for path, text in texts.items() if path.suffix == ".py")

    precision, device = answers.get("precision"), answers.get("device")
    distributed = answers.get("distributed", "none")
    multi = distributed != "none"
    expect = [
        ("GradScaler", precision == "fp16", "fp16"),
        ("skipped_steps", precision == "fp16", "fp16"),  # the scaler's count, read by diagnose
        ("autocast", precision != "fp32", "bf16 or fp16"),
        ("torch.compile", bool(answers.get("compile")), "compile"),
        ("set_float32_matmul_precision", device == "cuda", "cuda"),
        ("largest_fitting", device != "cpu", "cuda or mps"),  # memory bounds no batch on a CPU
        ("--memory-target", device != "cpu", "cuda or mps"),
        ("torch.mps", device == "mps", "mps"),
        ("torch.cuda.get_rng_state", device == "cuda", "cuda"),
        ("def sample(", answers.get("task") == "generation", "generation"),
    ]
    shared = [marker for marker in _DISTRIBUTED_MARKERS if marker != "torchrun"]  # source only
    expect += [(marker, multi, "ddp or fsdp") for marker in shared]
    expect += [(marker, distributed == "ddp", "ddp") for marker in _DDP_MARKERS]
    expect += [(marker, distributed == "fsdp", "fsdp") for marker in _FSDP_MARKERS]
    expect += [
        (marker, answers.get("tracker") == tracker, tracker)
        for tracker, marker in _TRACKER_MARKERS.items()
    ]
    for marker, wanted, option in expect:
        if (marker in source) != wanted:
            state = "missing although" if wanted else "present although not"
            problems.append(f"{marker!r} {state} {option} was chosen")
    everything = "\n".join(texts.values())
    if not multi and "torchrun" in everything:
        problems.append("'torchrun' present although neither ddp nor fsdp was chosen")
    launchers = [p for p in files if p.parent == project / "scripts"]
    for path in launchers:
        if path.suffix == ".yaml":
            try:
                list(yaml.safe_load_all(texts[path]))
            except yaml.YAMLError as err:
                problems.append(f"{path.relative_to(project)} is not YAML: {err}")
    asked = "\n".join(texts[p] for p in launchers)
    for marker in _GPU_REQUESTS:
        if multi and (marker in asked) != (device == "cuda"):
            state = "missing from" if device == "cuda" else "in"
            problems.append(f"{marker!r} {state} scripts/ although the device is {device}")
    pyproject = (project / "pyproject.toml").read_text(encoding="utf-8")
    for tracker in _TRACKER_MARKERS:
        chosen = answers.get("tracker") == tracker
        if (f'"{tracker}' in pyproject) != chosen:
            state = "missing from" if chosen else "in"
            problems.append(f"the {tracker} dependency is {state} pyproject.toml")
    return problems


def _compile_error(source: str) -> str | None:
    """Why `source` does not compile as a module (None when it does), each text compiled once in
    this process: the renders of a matrix share most of their files, and compiling a project's
    Python was most of its lint after ruff's (0.13 s of 0.19 a project, measured)."""
    key = hashlib.sha256(source.encode()).digest()
    if key not in _COMPILED:
        try:
            compile(source, "<file>", "exec", dont_inherit=True)
            _COMPILED[key] = None
        except (SyntaxError, ValueError) as err:  # ValueError: a NUL byte in the source
            _COMPILED[key] = str(err)
    return _COMPILED[key]


_COMPILED: dict[bytes, str | None] = {}
