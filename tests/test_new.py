"""`scaffold new`: answers from flags and defaults, refusals, git, and all-or-nothing writes."""

from __future__ import annotations

import os
import signal
import subprocess

import jinja2
import pytest
import yaml
from conftest import scaffold_process, snapshot

from scaffold import render
from scaffold.questions import load_questions, machine_facts


def answers_file(project) -> dict:
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert "_src_path" not in answers  # a path on the machine that rendered it: never saved
    return answers


def git(project, *args) -> str:
    return subprocess.run(
        ["git", *args], cwd=project, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_flags_answer_the_questions(scaffold, tmp_path):
    ran = scaffold(
        "new", tmp_path / "demo", "--name", "my-run", "--task", "classification",
        "--device", "cuda", "--precision", "fp16", "--grad-accum-steps", "4", "--compile",
        "--no-git",
    )  # fmt: skip

    assert ran.exit_code == 0, ran.stderr
    assert (
        answers_file(tmp_path / "demo").items()
        >= {
            "project_name": "my-run",
            "task": "classification",
            "device": "cuda",
            "precision": "fp16",
            "grad_accum_steps": 4,
            "compile": True,
        }.items()
    )
    assert (tmp_path / "demo" / "src" / "my_run" / "__main__.py").is_file()


@pytest.mark.parametrize("extra", [[], ["--defaults"]], ids=["no-terminal", "--defaults"])
def test_unanswered_questions_take_their_defaults(scaffold, tmp_path, extra):
    ran = scaffold("new", tmp_path / "Demo-Run", "--no-git", *extra)

    assert ran.exit_code == 0, ran.stderr
    device = machine_facts()["machine_device"]
    assert (
        answers_file(tmp_path / "Demo-Run").items()
        >= {
            "project_name": "Demo-Run",  # DEST's folder name
            "task": "classification",
            "device": device,  # what this machine has
            "precision": machine_facts()["machine_cuda_precision"] if device == "cuda" else "fp32",
            "grad_accum_steps": 1,
            "compile": False,
        }.items()
    )
    assert (tmp_path / "Demo-Run" / "src" / "demo_run").is_dir()


def test_machine_facts_are_never_saved(scaffold, tmp_path):
    scaffold("new", tmp_path / "demo", "--no-git")

    saved = (tmp_path / "demo" / ".copier-answers.yml").read_text()
    for question in load_questions().values():
        if question.hidden:
            assert question.name not in saved


def test_new_project_lands_in_missing_parent_folders(scaffold, tmp_path):
    ran = scaffold("new", "runs/2024/demo", "--no-git", cwd=tmp_path)

    assert ran.exit_code == 0, ran.stderr
    assert answers_file(tmp_path / "runs" / "2024" / "demo")["project_name"] == "demo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no staging left behind


def test_empty_dest_is_filled_in_place(scaffold, tmp_path):
    dest = tmp_path / "demo"
    dest.mkdir()
    inode = dest.stat().st_ino

    ran = scaffold("new", ".", "--no-git", cwd=dest)

    assert ran.exit_code == 0, ran.stderr
    assert dest.stat().st_ino == inode  # the same folder: a shell inside it still sees it
    assert answers_file(dest)["project_name"] == "demo"


# --- refusals: one line on stderr, exit code 2, nothing written ---------------------------

BAD_ANSWERS = {
    "unknown flag": ["--colour", "blue"],
    "bad choice": ["--device", "tpu"],
    "bad task": ["--task", "segmentation"],
    "fraction": ["--grad-accum-steps", "2.5"],
    "word": ["--grad-accum-steps", "two"],
    "zero": ["--grad-accum-steps", "0"],
    "negative": ["--grad-accum-steps", "-3"],
    "stdlib name": ["--name", "json"],
    "installed name": ["--name", "numpy"],
    "keyword": ["--name", "class"],
    "starts with a digit": ["--name", "1st-run"],
    "jinja": ["--name", "{{ 7 * 7 }}"],
    "jinja block": ["--name", "{% raw %}x"],
    "quotes": ["--name", 'it\'s "mine"'],
    "path separator": ["--name", "../escape"],
    "absolute path": ["--name", "/tmp/escape"],
    "spaces": ["--name", "my run"],
    "trailing newline": ["--name", "demo\n"],
    "empty name": ["--name", ""],
}


@pytest.mark.parametrize("args", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_bad_input_is_one_line_exit_2_and_writes_nothing(scaffold, tmp_path, args):
    (tmp_path / "keep.txt").write_text("someone's file\n")
    before = snapshot(tmp_path)

    ran = scaffold("new", tmp_path / "demo", *args)

    assert ran.exit_code == 2
    assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: "), ran.stderr
    assert snapshot(tmp_path) == before


def test_messages_name_the_flag_and_the_value(scaffold, tmp_path):
    assert scaffold("new", tmp_path / "d", "--grad-accum-steps", "2.5").stderr == (
        "error: --grad-accum-steps must be a whole number, got '2.5'\n"
    )
    assert scaffold("new", tmp_path / "d", "--grad-accum-steps", "0").stderr == (
        "error: --grad-accum-steps must be a whole number >= 1, got 0\n"
    )
    assert "'json' would shadow" in scaffold("new", tmp_path / "d", "--name", "json").stderr
    assert "project name 'проект' must be" in scaffold("new", tmp_path / "проект").stderr  # not \u


@pytest.mark.skipif(
    "distributed" not in load_questions(), reason="copier.yml has no distributed question yet"
)
def test_invalid_combination_is_refused(scaffold, tmp_path):
    ran = scaffold("new", tmp_path / "demo", "--device", "mps", "--distributed", "ddp")

    assert ran.exit_code == 2
    assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: --distributed")
    assert list(tmp_path.iterdir()) == []


def test_bad_input_from_a_real_process_is_one_line_without_traceback(tmp_path):
    for args in (["--device", "tpu"], ["--grad-accum-steps", "2.5"], ["--name", "a/b"]):
        ran = scaffold_process("new", "demo", *args, cwd=tmp_path)

        assert ran.returncode == 2
        assert ran.stderr.count("\n") == 1 and ran.stderr.startswith("error: "), ran.stderr
        assert ran.stdout == ""
        assert list(tmp_path.iterdir()) == []


def test_dest_that_is_not_empty_needs_force(scaffold, tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)

    ran = scaffold("new", tmp_path / "demo")

    assert ran.exit_code == 2
    assert ran.stderr_lines == [ran.stderr_lines[0]] and "--force" in ran.stderr
    assert snapshot(tmp_path) == before


def test_dest_that_is_a_file_is_refused(scaffold, tmp_path):
    (tmp_path / "demo").write_text("a file\n")

    ran = scaffold("new", tmp_path / "demo", "--force")

    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1
    assert (tmp_path / "demo").read_text() == "a file\n"


def test_force_never_overwrites_a_users_file(scaffold, tmp_path):
    dest = tmp_path / "demo"
    dest.mkdir()
    (dest / "pyproject.toml").write_text("# my own build\n")
    (dest / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)

    ran = scaffold("new", dest, "--force")

    assert ran.exit_code == 2
    assert len(ran.stderr_lines) == 1 and "pyproject.toml" in ran.stderr
    assert snapshot(tmp_path) == before


def test_force_adds_the_project_beside_a_users_files(scaffold, tmp_path):
    dest = tmp_path / "demo"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")

    ran = scaffold("new", dest, "--force")

    assert ran.exit_code == 0, ran.stderr
    assert (dest / "notes.txt").read_text() == "mine\n"
    assert answers_file(dest)["project_name"] == "demo"
    committed = git(dest, "ls-files").splitlines()
    assert "notes.txt" not in committed and ".copier-answers.yml" in committed
    assert git(dest, "status", "--porcelain") == "?? notes.txt"


def test_force_over_the_same_render_changes_nothing(scaffold, tmp_path):
    scaffold("new", tmp_path / "demo", "--no-git")
    before = snapshot(tmp_path)

    ran = scaffold("new", tmp_path / "demo", "--force", "--no-git")

    assert ran.exit_code == 0, ran.stderr
    assert snapshot(tmp_path) == before


def test_accepted_names_never_leave_dest(scaffold, tmp_path):
    for name in ("my.run", "Run-2", "a_b.c-d"):
        dest = tmp_path / name / "dest"
        ran = scaffold("new", dest, "--name", name, "--no-git")

        assert ran.exit_code == 0, ran.stderr
        assert [p.name for p in (tmp_path / name).iterdir()] == ["dest"]
        package = name.lower().replace("-", "_").replace(".", "_")
        assert (dest / "src" / package / "__main__.py").is_file()


# --- git ----------------------------------------------------------------------------------


def test_new_project_is_a_git_repository_with_one_commit(scaffold, tmp_path):
    ran = scaffold("new", tmp_path / "demo")

    assert ran.exit_code == 0, ran.stderr
    project = tmp_path / "demo"
    assert git(project, "rev-list", "--count", "HEAD") == "1"
    assert git(project, "log", "-1", "--format=%s").startswith("Initial project from scaffold ")
    assert git(project, "status", "--porcelain", "--ignored") == ""


def test_commit_works_without_a_git_identity(scaffold, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME"):
        monkeypatch.delenv(variable, raising=False)

    ran = scaffold("new", tmp_path / "demo")

    assert ran.exit_code == 0, ran.stderr
    assert git(tmp_path / "demo", "log", "-1", "--format=%an <%ae>") == (
        "scaffold <scaffold@localhost>"
    )


def test_a_project_inside_a_git_checkout_says_where_it_rendered(scaffold, tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git(checkout, "init", "-q")
    ran = scaffold("new", "demo", "--defaults", cwd=checkout)

    assert ran.exit_code == 0, ran.stderr
    assert ran.stderr == (
        f"note: rendered into {checkout / 'demo'}, inside the git repository {checkout}\n"
    )
    assert git(checkout / "demo", "rev-list", "--count", "HEAD") == "1"  # its own repository
    elsewhere = scaffold("new", tmp_path / "apart", "--defaults", "--no-git")
    assert elsewhere.exit_code == 0 and elsewhere.stderr == ""


def test_no_git_makes_no_repository(scaffold, tmp_path):
    ran = scaffold("new", tmp_path / "demo", "--no-git")

    assert ran.exit_code == 0, ran.stderr
    assert not (tmp_path / "demo" / ".git").exists()


# --- interruption ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_render_leaves_nothing(scaffold, tmp_path, monkeypatch, how):
    def interrupt(*args, **kwargs):  # stands in for the git commit, after copier has rendered
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(render, "commit_first_render", interrupt)

    ran = scaffold("new", tmp_path / "demo")

    assert ran.exit_code == 130
    assert ran.stderr == "error: interrupted: nothing was written\n"
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_template_error_leaves_nothing(tmp_path):
    template = tmp_path / "template"
    (template / "project").mkdir(parents=True)
    (template / "copier.yml").write_text("_subdirectory: project\nname:\n  type: str\n")
    (template / "project" / "ok.txt.jinja").write_text("{{ name }}\n")
    (template / "project" / "broken.txt.jinja").write_text("{{ name | no_such_filter }}\n")
    (tmp_path / "out").mkdir()

    with pytest.raises(jinja2.TemplateError):  # a template bug keeps its traceback
        render.new_project(tmp_path / "out" / "demo", {"name": "x"}, template=template)

    assert list((tmp_path / "out").iterdir()) == []
