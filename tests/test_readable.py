"""The golden renders, a streaming render of each task and each task's largest renders (those
with the most answers away from their first values) read as a person's project: no module over 400
lines, no import circle (type-only and function-level imports included), and the user's data.py on
no machinery. Its manual too: no README.md or docs/*.md over 400 lines, and every docs page linked
from the README."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scaffold.combinations import combination_id, combinations
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


@pytest.fixture(scope="module")
def largest():
    """{task: {combination id: {path: text}}}: each task's renders with the most answers away from
    their first values (every boolean on, a tracker, cuda, ddp or fsdp, ...), their README.md,
    docs/*.md and modules, rendered in memory."""
    combos = combinations()
    first = combos[0]

    def away(answers):
        return sum(answers[k] != first[k] for k in answers)

    renderer, found = FileRenderer(), {}
    for task in TASKS:
        own = [c for c in combos if c["task"] == task]
        most = max(map(away, own))
        found[task] = {}
        for answers in (c for c in own if away(c) == most):
            context = renderer.context({**answers, "project_name": "everything"})
            found[task][combination_id(answers)] = {
                path: renderer.text(source, context)
                for source, path in renderer.paths(context)
                if path.endswith((".md", ".py"))
            }
    return found


def golden_files(name: str) -> dict[str, str]:
    root = GOLDEN_DIR / name
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in root.rglob("*")
        if p.suffix in (".md", ".py")
    }


def manual_pages(files: dict[str, str]) -> dict[str, str]:
    return {p: t for p, t in files.items() if p == "README.md" or p.startswith("docs/")}


def too_long(files: dict[str, str]) -> dict[str, int]:
    return {p: n for p, t in files.items() if (n := len(t.splitlines())) > LONGEST}


@pytest.mark.parametrize("name", ["default", "everything"])
def test_no_page_of_the_goldens_manual_is_over_400_lines(name):
    pages = manual_pages(golden_files(name))
    assert "README.md" in pages and "docs/object-store.md" in pages
    assert not too_long(pages)


@pytest.mark.parametrize("task", TASKS)
def test_no_page_of_a_tasks_largest_manual_is_over_400_lines(task, largest):
    long = {key: too_long(manual_pages(files)) for key, files in largest[task].items()}
    assert not {key: pages for key, pages in long.items() if pages}


@pytest.mark.parametrize("task", TASKS)
def test_no_module_of_a_tasks_largest_render_is_over_400_lines(task, largest):
    long = {
        key: too_long({p: t for p, t in files.items() if p.endswith(".py")})
        for key, files in largest[task].items()
    }
    assert not {key: modules for key, modules in long.items() if modules}


@pytest.mark.parametrize("task", TASKS)
def test_every_docs_page_is_linked_from_the_readme(task, largest):
    """A page the README does not point to is a page nobody finds."""
    for files in [golden_files("default"), golden_files("everything"), *largest[task].values()]:
        docs = [p for p in files if p.startswith("docs/")]
        assert docs, "docs/object-store.md at least"
        for page in docs:
            assert f"]({page})" in files["README.md"] or f"]({page}#" in files["README.md"], page


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
    combos, projects = combinations(), {}
    for task in TASKS:
        answers = next(c for c in combos if c.items() >= {**STREAMING, "task": task}.items())
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
