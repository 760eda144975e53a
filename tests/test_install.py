"""A non-editable install into a fresh virtual environment renders a project that passes its checks:
every import of scaffold and of the generated project is declared, the wheel carries the template,
and none of the dev extra is needed. The project's README runs as pasted in that environment, its
own set-up line first, its `check all` among them: the default project's README test
(test_readme_commands's run_as_pasted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO
from readme_commands import fenced_commands
from test_readme_commands import NOT_HERE, run_as_pasted, users_files

pytestmark = pytest.mark.slow


def run(*command, cwd, env) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def test_installed_scaffold_renders_a_project_that_passes_its_checks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path, env=env)
    run(python, "-m", "pip", "install", "-q", REPO, cwd=tmp_path, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    located = run(
        python, "-c", "from scaffold.questions import template_dir; print(template_dir())",
        cwd=elsewhere, env=env,
    )  # fmt: skip
    assert located.stdout.strip().startswith(str(venv))  # the wheel's copy, not the checkout's

    run(venv / "bin" / "scaffold", "new", "demo", "--defaults", "--no-git", cwd=elsewhere, env=env)
    project = elsewhere / "demo"
    light = run(python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path, env=env).stdout
    installed = {line.split("==")[0].lower() for line in light.splitlines()}
    assert not installed & {"pytest", "ruff", "moto", "mlflow-skinny", "wandb", "matplotlib"}

    # The project's README, every command as pasted, from its own set-up on: in this environment,
    # which had nothing of the project's extras (matplotlib for step 4's plot among them).
    path = {**env, "PATH": os.pathsep.join([str(venv / "bin"), env["PATH"]])}
    commands = fenced_commands((project / "README.md").read_text(encoding="utf-8"))
    assert commands[0].line.startswith("pip install -e ")  # the set-up comes first
    users_files(project, {})  # new_rows.csv, which the README names as standing for the user's
    ran = run_as_pasted(project, path, {k: v for k, v in NOT_HERE.items() if k != "pip install"})
    assert next(iter(ran)).startswith("pip install -e ")
    checked = ran["python -m demo check all"].output  # the checks, as the README has them run
    for start in ("**Run:**", "**Sanity:**", "**Throughput:**"):
        assert any(line.startswith(start) for line in checked.splitlines()), checked
