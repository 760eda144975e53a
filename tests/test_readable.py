"""The golden renders, and a streaming render of each task, read as a person's project: no module
over 400 lines, no import circle (type-only and function-level imports included), and the user's
data.py on no machinery."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scaffold.combinations import combinations
from scaffold.matrix.files import FileRenderer

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
LONGEST = 400
TASKS = ("classification", "regression", "image", "generation", "custom")
# Streaming adds shard readers and writers to every task: with the other answers that add modules.
STREAMING = {"streaming": True, "distributed": "fsdp", "finetune": True, "tracker": "mlflow"}


def modules(project: Path) -> dict[str, Path]:
    """{dotted module name: its file} of the project's package under src/."""
    root = project / "src"
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that module `name` imports, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in known else target)
    return (found & known.keys()) - {name}


def circles(project: Path) -> list[list[str]]:
    """Each import circle among the project's modules, once, as the modules along it."""
    known = modules(project)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    found: list[list[str]] = []

    def walk(start: str, trail: list[str]) -> None:
        for after in sorted(edges[trail[-1]]):
            if after == start:
                found.append(trail)
            elif after > start and after not in trail:
                walk(start, [*trail, after])

    for name in sorted(known):
        walk(name, [name])
    return found


@pytest.mark.parametrize("name", ["default", "everything"])
def test_no_module_is_over_400_lines(name):
    long = {
        str(path.relative_to(GOLDEN_DIR / name)): n
        for path in (GOLDEN_DIR / name / "src").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > LONGEST
    }
    assert not long


@pytest.mark.parametrize("name", ["default", "everything"])
def test_no_import_circle(name):
    assert circles(GOLDEN_DIR / name) == []


def test_a_circle_is_found_through_a_type_only_import(tmp_path):
    package = tmp_path / "src" / "p"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    assert circles(tmp_path) == [["p.a", "p.b"]]


@pytest.fixture(scope="module")
def streaming_renders(tmp_path_factory) -> dict[str, Path]:
    """{task: a project rendered with streaming on}, written under a temporary folder."""
    renderer, root = FileRenderer(), tmp_path_factory.mktemp("streaming")
    projects = {}
    for task in TASKS:
        answers = next(
            c for c in combinations() if c.items() >= {**STREAMING, "task": task}.items()
        )
        for path, text in renderer.render({**answers, "project_name": "demo"}).items():
            (root / task / path).parent.mkdir(parents=True, exist_ok=True)
            (root / task / path).write_text(text, encoding="utf-8")
        projects[task] = root / task
    return projects


def machinery_under_data(project: Path) -> set[str]:
    """The runtime/ modules that data.py imports, or that a module it imports imports, and so on."""
    known = modules(project)
    todo = [next(name for name in known if name.endswith(".data"))]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        for after in imports(name, known[name], known) - seen:
            seen.add(after)
            todo.append(after)
    return {name for name in seen if ".runtime" in name}


@pytest.mark.parametrize("name", ["default", "everything"])
def test_the_users_data_py_imports_no_machinery(name):
    """The machinery may import the user's files, not the other way round."""
    assert not machinery_under_data(GOLDEN_DIR / name)


@pytest.mark.parametrize("task", TASKS)
def test_a_streaming_render_reads_as_a_persons_project(streaming_renders, task):
    """Its shards are read and written by data_shards.py, beside data.py: not by data.py."""
    project = streaming_renders[task]
    long = [
        path.name
        for path in (project / "src").rglob("*.py")
        if len(path.read_text(encoding="utf-8").splitlines()) > LONGEST
    ]
    assert not long
    assert circles(project) == []
    assert not machinery_under_data(project)
    assert (project / "src" / "demo" / "data_shards.py").is_file()
