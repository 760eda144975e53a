"""The declared floors are true: the oldest copier, typer and jinja2 pyproject.toml allows render
the template, and render exactly what the installed ones do; a copier below its floor is refused in
one line. scaffold's torch floor is the renders' own (`scaffold check` runs a project with
scaffold's Python).

Each test makes a virtual environment on top of this one and installs those versions into it from
the package index.
"""

from __future__ import annotations

import filecmp
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from scaffold.render import new_project

REPO = Path(__file__).resolve().parent.parent


def declared_floor(package: str, pyproject: Path = REPO / "pyproject.toml") -> str:
    """The version in pyproject.toml's `"package>=X"` dependency."""
    return re.search(rf'"{package}>=([\d.]+)"', pyproject.read_text())[1]


def declared_copier_floor() -> str:
    return declared_floor("copier")


def python_with(folder: Path, *requirements: str) -> Path:
    """A Python that sees this one's packages, with `requirements` installed in front of them.

    `venv --system-site-packages` would see the base interpreter's packages, which lack typer and
    the rest when the tests themselves run in a virtual environment; a .pth file adds the running
    interpreter's site directories instead, after the new environment's own.
    """
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = [*site.getsitepackages(), site.getusersitepackages()]
    lines = [f"import site; site.addsitedir({d!r})" for d in outer if d in sys.path]
    (Path(own) / "outer-environment.pth").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", *requirements],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return python


# The versions that a Python imports of the packages named in its arguments.
FLOOR_VERSIONS = """
import sys
from importlib.metadata import version
print(*(version(name) for name in sys.argv[1:]))
"""


def scaffold_new(python: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "scaffold", "new", str(dest), "--defaults", "--no-git", "--task", "image"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def same_tree(a: Path, b: Path) -> bool:
    compared = filecmp.dircmp(a, b)
    if compared.left_only or compared.right_only or compared.diff_files or compared.funny_files:
        return False
    return all(same_tree(a / sub, b / sub) for sub in compared.common_dirs)


@pytest.mark.slow
def test_the_declared_floors_render_what_the_installed_versions_do(tmp_path):
    floors = {package: declared_floor(package) for package in ("copier", "typer", "jinja2")}
    python = python_with(tmp_path / "venv", *(f"{p}=={v}" for p, v in floors.items()))
    versions = subprocess.run(
        [python, "-c", FLOOR_VERSIONS, *floors],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert versions == [v if v.count(".") == 2 else f"{v}.0" for v in floors.values()]

    done = scaffold_new(python, tmp_path / "floor" / "demo")

    assert done.returncode == 0, done.stderr
    new_project(tmp_path / "now" / "demo", {"task": "image"}, git=False)
    assert same_tree(tmp_path / "floor" / "demo", tmp_path / "now" / "demo")


@pytest.mark.slow
def test_a_copier_below_the_floor_is_refused_in_one_line(tmp_path):
    python = python_with(tmp_path / "venv", "copier==9.14.3")  # crashed on _envops.undefined

    done = scaffold_new(python, tmp_path / "old" / "demo")

    assert done.returncode != 0
    assert done.stderr.strip() == (
        "error: the template failed to render: This template requires Copier version >= "
        f"{declared_copier_floor()}, while your version of Copier is 9.14.3."
    )
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "old" / "demo").exists()


def test_scaffolds_torch_floor_is_what_every_render_requires(tmp_path):
    new_project(tmp_path / "demo", {}, git=False)
    rendered = declared_floor("torch", tmp_path / "demo" / "pyproject.toml")

    assert declared_floor("torch") == rendered
