"""Plain copier is a client of the template too: `copier copy` and `copier update` from a
git-tagged copy of templates/ (as a team hosting the template would use it), `.` as the
destination, and the same refused names as scaffold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import copier
import pytest
import yaml

from scaffold import reserved_names
from scaffold.errors import UsageError
from scaffold.golden import differences
from scaffold.questions import answers_file, load_questions, template_dir
from scaffold.render import new_project

IDENTITY = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@localhost",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@localhost",
}


@pytest.fixture(autouse=True)
def git_identity(monkeypatch):
    for key, value in IDENTITY.items():
        monkeypatch.setenv(key, value)


def _git(folder: Path, *args: str) -> str:
    ran = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, check=True)
    return ran.stdout


def _tagged_template(folder: Path) -> Path:
    """A copy of templates/ in its own git repository, tagged v1."""
    shutil.copytree(template_dir(), folder)
    _git(folder, "init", "-q")
    _git(folder, "add", "-A")
    _git(folder, "commit", "-q", "-m", "template v1")
    _git(folder, "tag", "v1")
    return folder


def _answers(project: Path) -> dict:
    return yaml.safe_load((project / answers_file()).read_text())


def test_copier_copy_from_a_tag_renders_what_scaffold_renders(tmp_path):
    template = _tagged_template(tmp_path / "template")
    data = {"task": "regression", "tracker": "tensorboard"}

    copier.run_copy(str(template), tmp_path / "plain" / "demo", data=data, defaults=True)
    new_project(tmp_path / "scaffold" / "demo", data, git=False)

    plain, ours = tmp_path / "plain" / "demo", tmp_path / "scaffold" / "demo"
    assert differences(ours, plain) == [f"differs {answers_file()}"]
    recorded = _answers(plain)
    assert recorded["_src_path"] == str(template) and recorded["_commit"] == "v1"
    assert {k: v for k, v in recorded.items() if not k.startswith("_")} == _answers(ours)


def test_copier_update_brings_in_a_new_tag_and_keeps_the_owner_s_edits(tmp_path):
    template = _tagged_template(tmp_path / "template")
    project = tmp_path / "demo"
    copier.run_copy(str(template), project, defaults=True, quiet=True)
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    _git(project, "commit", "-q", "-m", "rendered")
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\nNotes of the owner.\n")
    _git(project, "commit", "-q", "-am", "my notes")

    (template / "project" / "CHANGES.md").write_text("Made from template v2.\n")
    _git(template, "add", "-A")
    _git(template, "commit", "-q", "-m", "template v2")
    _git(template, "tag", "v2")
    copier.run_update(project, defaults=True, overwrite=True, quiet=True)

    assert (project / "CHANGES.md").read_text() == "Made from template v2.\n"
    assert readme.read_text().endswith("\nNotes of the owner.\n")
    assert _answers(project)["_commit"] == "v2"


def test_copier_copy_into_dot_names_the_project_after_the_folder(tmp_path):
    template = _tagged_template(tmp_path / "template")
    project = tmp_path / "my-dot-run"
    project.mkdir()

    ran = subprocess.run(
        [sys.executable, "-m", "copier", "copy", "--defaults", "--quiet", str(template), "."],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, **IDENTITY},
    )

    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr
    assert _answers(project)["project_name"] == "my-dot-run"
    assert (project / "src" / "my_dot_run" / "__main__.py").is_file()


@pytest.mark.parametrize("name", ["torch", "numpy", "json", "asyncio", "tomllib", "class"])
def test_plain_copier_refuses_the_names_scaffold_refuses(tmp_path, name):
    with pytest.raises(ValueError, match="project_name") as plain:
        copier.run_copy(str(template_dir()), tmp_path / "plain", data={"project_name": name})
    with pytest.raises(UsageError) as ours:
        new_project(tmp_path / "ours", {"project_name": name}, git=False)

    assert str(ours.value) in str(plain.value)
    assert not (tmp_path / "plain").exists() and not (tmp_path / "ours").exists()


def test_copier_yml_reserves_this_python_s_standard_library():
    listed = load_questions()["reserved_packages"].default
    stdlib = {name for name in sys.stdlib_module_names if not name.startswith("_")}

    missing = stdlib - set(listed)
    assert not missing, f"run `python -m scaffold.reserved_names`: {sorted(missing)[:10]}"
    assert set(reserved_names.COMMON) <= set(listed)
    assert listed == sorted(listed)
