"""Every combination of answers renders a project that is lint-clean as rendered, has no template
residue, and holds no code for the options not chosen."""

from __future__ import annotations

import os

import pytest

from scaffold.matrix import (
    LONGEST_NAME,
    all_combinations,
    combination_id,
    combinations,
    lint_problems,
)
from scaffold.matrix.files import FileRenderer, Renders, render_many
from scaffold.matrix.lint import lint_many, lint_renders
from scaffold.render import new_project

ALL = combinations()


def _fast_subset() -> list[dict]:
    """Every loop option (device, precision, accumulation, compile, finetune) for the default task
    and tracker without streaming, every task x tracker pair with the other answers cycling
    through their values, and the matrix's streaming primaries (every task and distributed
    answer): the streaming half's renders would double it."""
    loop = [
        c
        for c in ALL
        if c["task"] == "classification" and c["tracker"] == "none" and not c.get("streaming")
    ]
    cheapest = {"tracker": "none", "precision": "fp32", "compile": False, "finetune": False}
    streaming = {**cheapest, "grad_accum_steps": 1, "device": "cpu", "streaming": True}
    primaries = [c for c in ALL if c.items() >= streaming.items()]
    pairs = sorted({(c["task"], c["tracker"]) for c in ALL})
    subset = [*loop, *primaries]
    for i, (task, tracker) in enumerate(pairs):
        candidates = [c for c in ALL if c["task"] == task and c["tracker"] == tracker]
        subset.append(candidates[(7 * i) % len(candidates)])
    return subset


FAST = _fast_subset()
REST = [c for c in ALL if c not in FAST]


def _named(combos):
    return [{**c, "project_name": LONGEST_NAME} for c in combos]


def test_renders_lint_clean_without_residue():
    """A fast subset here; `pytest -m matrix` and `scaffold matrix` lint every combination."""
    combos = _named(FAST)
    assert lint_renders(render_many(combos), combos) == [[]] * len(combos)


@pytest.mark.matrix
def test_every_combination_renders_lint_clean_without_residue():
    combos = _named(ALL)
    problems = lint_renders(render_many(combos, jobs=os.cpu_count() or 1), combos)
    failing = {combination_id(c): p for c, p in zip(combos, problems, strict=True) if p}
    assert not failing


@pytest.mark.parametrize("i", [0, len(ALL) // 3, -1])
def test_the_file_renderer_renders_what_copier_renders(tmp_path, i):
    answers = {**ALL[i], "project_name": "my-run"}
    project = new_project(tmp_path / "my-run", answers, git=False).path
    on_disk = {
        p.relative_to(project).as_posix(): p.read_text(encoding="utf-8")
        for p in project.rglob("*")
        if p.is_file()
    }
    assert FileRenderer().render(answers) == on_disk


def test_a_faulty_text_fails_every_combination_that_has_it_and_no_other():
    combos = _named([ALL[0], {**ALL[0], "tracker": "wandb"}, {**ALL[0], "compile": True}])
    renders = render_many(combos)
    config = next(p for p in renders.files[1] if p.endswith("/config.py"))
    faulty = renders.texts[renders.files[1][config]] + "\nimport os\n"  # unused, not at the top
    changed = Renders(
        texts={**renders.texts, "faulty": faulty},
        files=[renders.files[0], {**renders.files[1], config: "faulty"}, renders.files[2]],
    )

    problems = lint_renders(changed, combos)

    assert problems[0] == problems[2] == []
    assert [p.split("\n")[0] for p in problems[1]] == [
        "`ruff check` failed:",
        "`ruff format` failed:",
    ]
    assert "F401" in problems[1][0] and config in problems[1][0]


def test_lint_finds_code_of_an_option_not_chosen(tmp_path):
    answers = {**ALL[0], "compile": False}
    project = new_project(tmp_path / "p", answers, git=False).path
    train = next(project.glob("src/*/train.py"))
    train.write_text(train.read_text() + "\nmodel = torch.compile  # {{ leftover }}\n")

    problems = lint_problems(project, answers)

    assert "'torch.compile' present although not compile was chosen" in problems
    assert any(p.startswith("template residue in src/") for p in problems)


def test_linted_together_each_project_is_linted_as_alone(tmp_path):
    """The matrix lints many renders with one ruff start (lint_many): each project still takes
    its own ruff settings (a 100-character line passes its line length of 110), and a problem in
    one is reported against it alone, in lint_problems' words."""
    picked = [ALL[0], ALL[len(ALL) // 3], ALL[-1]]
    projects = [
        (new_project(tmp_path / f"{i}" / LONGEST_NAME, c, git=False).path, c)
        for i, c in enumerate(picked)
    ]
    long_line = f'\n\nLONG = "{"a" * 91}"\n'  # 100 characters: over ruff's default 88
    for project, _ in projects:
        train = next(project.glob("src/*/train.py"))
        train.write_text(train.read_text() + long_line)
    config = next(projects[1][0].glob("src/*/config.py"))
    config.write_text(config.read_text() + "\nimport os\n")  # unused, and not at the top
    train = next(projects[2][0].glob("src/*/train.py"))
    train.write_text(train.read_text() + 'x = {  "a":1}  # {{ leftover }}\n')

    together = lint_many(projects)

    assert together == [lint_problems(p, c) for p, c in projects]
    assert together[0] == []
    assert [p.split("\n")[0] for p in together[1]] == [
        "`ruff check` failed:",
        "`ruff format` failed:",
    ]
    assert "F401" in together[1][0] and "config.py" in together[1][1]
    assert together[2][0].startswith("`ruff format` failed:")
    assert together[2][1].startswith("template residue in src/")


def test_invalid_combinations_are_left_out():
    """The matrix keeps exactly what copier's validators accept: neither ddp nor fsdp on mps."""
    dropped = [c for c in all_combinations() if c not in ALL]
    assert ALL and len(ALL) + len(dropped) == len(all_combinations())
    if "distributed" in ALL[0]:
        assert dropped and all(c["device"] == "mps" and c["distributed"] != "none" for c in dropped)
        assert {c["distributed"] for c in dropped} == {"ddp", "fsdp"}


def test_defaults_are_recorded_in_the_answers_file(tmp_path):
    project = new_project(tmp_path / "my-run", {}, git=False).path
    answers = (project / ".copier-answers.yml").read_text()
    assert "project_name: my-run" in answers
    assert "machine_device" not in answers  # machine facts are never saved
    assert (project / "src" / "my_run" / "train.py").is_file()


def test_the_generation_task_is_described_as_what_it_does(scaffold, tmp_path):
    """It tokenizes characters, bytes or BPE (prepare), and its README says where each is edited."""
    project = new_project(tmp_path / "gen", {"task": "generation"}, git=False).path
    readme = (project / "README.md").read_text(encoding="utf-8")
    intro, table = readme.split("## Where to edit")[0], readme.split("## Where to edit")[1]
    table = table.split("\n\n")[1]
    options = scaffold("options").stdout
    generation = next(line for line in options.splitlines() if "generation (" in line)

    for text in (" ".join(intro.split()), generation):
        assert "character-level" not in text and "bytes or BPE tokens" in text, text
    for name in ("tokens.py", "prepare.py"):
        assert f"| `src/gen/{name}` |" in table, table
