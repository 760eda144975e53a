"""Lint a rendered project as rendered: ruff with the project's own config, no template residue,
no code of an option not chosen."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from scaffold.errors import ScaffoldError
from scaffold.matrix.files import Renders

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
    """rendered_problems of the project's files as they are on disk."""
    files = [p for p in sorted(project.rglob("*")) if p.is_file() and ".git" not in p.parts]
    texts = {p.relative_to(project).as_posix(): p.read_text(encoding="utf-8") for p in files}
    return rendered_problems(texts, answers)


def rendered_problems(texts: Mapping[str, str], answers: dict[str, Any]) -> list[str]:
    """Template residue, a REPLACE ME or TODO, Python that does not parse, and code (or a
    dependency, or a launcher's GPU request) of an option not chosen, in a render's `texts`
    ({path in the project: text}). What each text holds is found once in this process: a matrix's
    renders share most of their texts."""
    precision, device = answers.get("precision"), answers.get("device")
    distributed = answers.get("distributed", "none")
    multi = distributed != "none"
    expect = [
        # every render makes one autocast context and one GradScaler, enabled in fp16 alone
        ("grad_scaler(device)", precision == "fp16", "fp16"),
        ('counts["skipped_steps"]', precision == "fp16", "fp16"),  # the scaler's count
        ("enabled=False", precision != "fp16", "fp32 or bf16"),
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
    markers = (*(marker for marker, _, _ in expect), "torchrun")
    problems = []
    found: set[str] = set()
    for where, text in sorted(texts.items()):
        facts = _facts(text, markers)
        if "residue" in facts:
            problems.append(f"template residue in {where}")
        if "todo" in facts:
            problems.append(f"a REPLACE ME or TODO left in {where}")
        if where.endswith(".py"):
            if error := _compile_error(text):
                problems.append(f"the project's Python does not parse: {where}: {error}")
            found |= facts
    everywhere = set().union(*(_facts(text, markers) for text in texts.values()))

    for marker, wanted, option in expect:
        if (marker in found) != wanted:
            state = "missing although" if wanted else "present although not"
            problems.append(f"{marker!r} {state} {option} was chosen")
    if not multi and "torchrun" in everywhere:
        problems.append("'torchrun' present although neither ddp nor fsdp was chosen")
    launchers = [p for p in texts if p.startswith("scripts/") and p.count("/") == 1]
    for path in launchers:
        if path.endswith(".yaml"):
            try:
                list(yaml.safe_load_all(texts[path]))
            except yaml.YAMLError as err:
                problems.append(f"{path} is not YAML: {err}")
    asked = "\n".join(texts[p] for p in launchers)
    for marker in _GPU_REQUESTS:
        if multi and (marker in asked) != (device == "cuda"):
            state = "missing from" if device == "cuda" else "in"
            problems.append(f"{marker!r} {state} scripts/ although the device is {device}")
    pyproject = texts.get("pyproject.toml", "")
    for tracker in _TRACKER_MARKERS:
        chosen = answers.get("tracker") == tracker
        if (f'"{tracker}' in pyproject) != chosen:
            state = "missing from" if chosen else "in"
            problems.append(f"the {tracker} dependency is {state} pyproject.toml")
    return problems


def _facts(text: str, markers: tuple[str, ...]) -> frozenset[str]:
    """Which of `markers` `text` holds, and "residue" and "todo" where it has them (once a text)."""
    key = (text, markers)
    if key not in _FACTS:
        facts = {marker for marker in markers if marker in text}
        if RESIDUE.search(text):
            facts.add("residue")
        if "REPLACE ME" in text or "TODO" in text:
            facts.add("todo")
        _FACTS[key] = frozenset(facts)
    return _FACTS[key]


_FACTS: dict[tuple[str, tuple[str, ...]], frozenset[str]] = {}


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


def lint_renders(renders: Renders, combos: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Each combination's lint problems, with ruff run on each distinct Python text once.

    Every file's text depends on a few answers only, so the thousands of renders hold a few
    thousand distinct texts of their Python files. Variant k of each path goes into layer k, a
    folder laid out as a project with the project's ruff settings (the same in every render:
    checked), and both ruff commands run once over all the layers."""
    flagged = _ruff_texts(renders)
    result = []
    for i, answers in enumerate(combos):
        files = renders.files[i]
        problems = [
            f"`{command}` failed:\n{said}"
            for path, key in sorted(files.items())
            for command, said in flagged.get((path, key), [])
        ]
        result.append(problems + rendered_problems(renders.of(i), answers))
    return result


def _ruff_texts(renders: Renders) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """{(path, text digest): [(ruff command, what it said)]} for each text ruff finds fault with."""
    variants: dict[str, list[str]] = {}
    for files in renders.files:
        for path, key in files.items():
            if path.endswith(".py") and key not in variants.setdefault(path, []):
                variants[path].append(key)
    settings = {_ruff_settings(renders.texts[f["pyproject.toml"]]) for f in renders.files}
    if len(settings) > 1:
        raise ScaffoldError("the renders' pyproject.toml differ in their ruff settings")
    pyproject = renders.texts[renders.files[0]["pyproject.toml"]] if renders.files else ""
    layers = max((len(keys) for keys in variants.values()), default=0)
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    with tempfile.TemporaryDirectory(prefix="scaffold-lint-") as scratch:
        root = Path(scratch)
        where: dict[str, tuple[str, str]] = {}  # a layer's file: (path, digest)
        for k in range(layers):
            layer = root / f"L{k:04d}"
            layer.mkdir()
            (layer / "pyproject.toml").write_text(pyproject, encoding="utf-8")
            for path, keys in variants.items():
                if k < len(keys):
                    target = layer / path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(renders.texts[keys[k]], encoding="utf-8")
                    where[f"L{k:04d}/{path}"] = (path, keys[k])
        for command in RUFF:
            result = _ruff([*command, "."], root)
            if result.returncode == 0:
                continue
            said = result.stdout + result.stderr
            named = [name for name in where if _says(said, name)]
            if not named:
                raise ScaffoldError(f"`{' '.join(command)}` failed on no file:\n{said[-2000:]}")
            for name in named:
                lines = [line for line in said.splitlines() if name in line]
                found.setdefault(where[name], []).append((" ".join(command[:2]), "\n".join(lines)))
    return found


def _says(output: str, name: str) -> bool:
    """Whether ruff's `output` names the file `name` (at a line's start or after a space)."""
    return re.search(rf"(^|\s){re.escape(name)}(:|\s|$)", output, re.MULTILINE) is not None


def _ruff_settings(pyproject: str) -> str:
    """The [tool.ruff...] tables of a pyproject.toml's text."""
    tables = re.split(r"(?m)^(?=\[)", pyproject)
    return "".join(t for t in tables if t.startswith("[tool.ruff"))
