"""`scaffold check` and `new --check`: run a project's own checks, exit with their status."""

from __future__ import annotations

import re

import pytest
from test_project import render, run

from scaffold.machine import device_available

SUMMARY = ("**Run:**", "**Sanity:**", "**Throughput:**")


def fake_project(root, *, answers: str, exit_code: int):
    """A project whose `check` prints how it was called and exits with `exit_code`."""
    package = root / "src" / "fake_run"
    package.mkdir(parents=True)
    (root / ".copier-answers.yml").write_text(answers)
    (package / "__main__.py").write_text(
        "import os, sys\n"
        "print('argv:', ' '.join(sys.argv[1:]))\n"
        "print('cwd:', os.getcwd())\n"
        f"sys.exit({exit_code})\n"
    )
    return root


def test_check_runs_the_project_module_and_passes_on_its_status(scaffold, tmp_path):
    project = fake_project(tmp_path, answers="project_name: Fake-Run\ndevice: cpu\n", exit_code=3)

    ran = scaffold("check", project)

    assert ran.exit_code == 3
    assert "argv: check all\n" in ran.stdout
    assert f"cwd: {project}\n" in ran.stdout


def test_check_finds_the_only_package_without_an_answers_file(scaffold, tmp_path):
    project = fake_project(tmp_path, answers="", exit_code=0)
    (project / ".copier-answers.yml").unlink()

    ran = scaffold("check", project, "--device", "cpu")

    assert ran.exit_code == 0
    assert "argv: check all --device cpu\n" in ran.stdout


@pytest.mark.skipif(device_available("cuda"), reason="this machine has cuda")
def test_check_falls_back_to_cpu_when_the_device_is_missing(scaffold, tmp_path):
    project = fake_project(tmp_path, answers="project_name: fake-run\ndevice: cuda\n", exit_code=0)

    ran = scaffold("check", project)

    assert ran.exit_code == 0
    assert "argv: check all --device cpu\n" in ran.stdout
    assert ran.stderr_lines == ["this machine has no cuda: running the checks with --device cpu"]


def test_check_of_a_folder_that_is_no_project_is_refused(scaffold, tmp_path):
    ran = scaffold("check", tmp_path)

    assert ran.exit_code == 2
    assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: ")


def test_rendered_project_passes_its_checks(scaffold, tmp_path):
    scaffold("new", tmp_path / "demo", "--no-git")

    ran = scaffold("check", tmp_path / "demo")

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    for start in SUMMARY:
        assert any(line.startswith(start) for line in lines), ran.stdout


def test_new_with_check_renders_then_checks(scaffold, tmp_path):
    ran = scaffold("new", tmp_path / "demo", "--device", "cuda", "--check")

    assert ran.exit_code == 0, ran.stdout + ran.stderr
    for start in SUMMARY:
        assert any(line.startswith(start) for line in ran.stdout.splitlines()), ran.stdout
    if not device_available("cuda"):
        assert "running the checks with --device cpu" in ran.stderr


# A user's own model: two layers in place of the rendered MLP's body, which memorises its batch of
# 8 in tens of steps (67 here), past the 40 that `--max-steps 40` gives a run.
TWO_LAYERS = """        self.body = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU())
        self.head = nn.Linear(32, n_outputs)

"""


def test_the_overfit_verdict_is_the_same_for_any_max_steps(tmp_path):
    """`check overfit --max-steps 40` (the way to make checks quick) trained on a schedule planned
    for 40 steps, at --min-lr past step 40, and failed this model at 0.11 after 300 steps while
    the default passed it. The check's schedule is its own: the same line either way."""
    project = render(tmp_path / "two", task="classification", device="cpu")
    model = project / "src" / "two" / "model.py"
    text = model.read_text()
    body = text[text.index("        layers: list[nn.Module] = []") : text.index("    def forward")]
    model.write_text(text.replace(body, TWO_LAYERS))

    lines = []
    for args in (("--max-steps", "40"), ()):
        done = run(project, "check", "overfit", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        lines += [line for line in done.stdout.splitlines() if line.startswith("overfit: ")]

    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert lines[0].startswith("overfit: PASS: ")
    assert 40 < int(re.search(r" in (\d+) steps", lines[0]).group(1)) < 300, lines[0]
