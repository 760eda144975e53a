"""Lint a rendered project as rendered: ruff with the project's own config, no template residue,
no code of an option not chosen."""

from __future__ import annotations

import re
import subprocess
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
    everything = "\n".join(p.read_text(encoding="utf-8") for p in files)
    if not multi and "torchrun" in everything:
        problems.append("'torchrun' present although neither ddp nor fsdp was chosen")
    launchers = [p for p in files if p.parent == project / "scripts"]
    for path in launchers:
        if path.suffix == ".yaml":
            try:
                list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
            except yaml.YAMLError as err:
                problems.append(f"{path.relative_to(project)} is not YAML: {err}")
    asked = "\n".join(p.read_text(encoding="utf-8") for p in launchers)
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
