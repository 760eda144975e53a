"""The scaffolder under bad input, and what no render may contain.

Every input either renders a project that compiles and is lint-clean as rendered, or is refused
in one line with exit code 2 and nothing written. A name is text, never a template: it is never
evaluated and never leads outside DEST. Interrupts leave no half-written project, `--force`
keeps every file the user had, and nothing a project does unpickles code.
(Fixed lists of refused answers and names: tests/test_new.py and tests/test_names.py.)
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaffold import _compat, render
from scaffold.errors import UsageError
from scaffold.matrix import combinations
from scaffold.questions import asked_questions, package_name, template_dir

SUITE = "bad input (scaffolder)"


def examples(n: int) -> settings:
    """A fixed, modest set of examples (the scaffold fixture is reset for each one)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


# Names that have broken generators: template syntax, shell syntax, quotes, separators,
# non-ASCII, control characters, reserved and edge-of-limit lengths.
NASTY_NAMES = [
    "{{7*7}}", "{{ 7*7 }}", "a{{7*7}}b", "{% raw %}x", "{%- if true %}x{% endif %}", "{# x #}",
    "{{ project_name }}", "{{''.__class__}}", "${HOME}", "$(echo 49)", "`id`", "x; rm -rf ~",
    "'x'", '"x"', "it's", "a\\b", "a/b", "../x", "..", ".", "/abs", "~", "a\tb", "a\x00b",
    "a\rb", "ü-run", "naïve", "名前", "Ωmega", "x" * 40, "x" * 41, "x" * 4096, "-x", "x-",
    "_x", "a..b", "a.-b", "A.B-c_d", "con", "nul", "__init__", "__main__", "test", "site",
    "sitecustomize", "torch", "scaffold", "os", "None", "True", "async", "0x", "x0",
]  # fmt: skip
NAMES = st.one_of(
    st.sampled_from(NASTY_NAMES),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60),
    st.text(alphabet="aZ09-_./\\{}%#'\"$`;~ ", max_size=20),
)
# Names the regex of copier.yml accepts: the ones that actually render.
VALID_NAMES = st.from_regex(r"\A[A-Za-z][A-Za-z0-9._-]{0,30}[A-Za-z0-9]\Z", fullmatch=True)


def lint_clean(project: Path) -> bool:
    for command in (["ruff", "check", "--no-cache", "-q", "."], ["ruff", "format", "--check"]):
        done = subprocess.run(command, cwd=project, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout, done.stderr)
            return False
    for path in project.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    return True


def rendered_text(project: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in sorted(project.rglob("*")) if p.is_file()
    )


def renders_or_refuses(scaffold, tally, args: list[str], name: str | None = None) -> str:
    """Run `scaffold new DEST ARGS` in an empty folder and check the one property; returns
    "rendered" or "refused"."""
    tally[SUITE]["inputs tried"] += 1
    with tempfile.TemporaryDirectory() as parent:
        parent = Path(parent)
        dest = parent / "dest"
        ran = scaffold("new", dest, "--no-git", "--defaults", *args)
        if ran.exit_code == 2:
            assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: "), ran.stderr
            assert list(parent.iterdir()) == []  # nothing written, not even a staging folder
            if name is not None and "49" not in name:
                assert "49" not in ran.stderr, ran.stderr  # the name was never evaluated
            tally[SUITE]["refused in one line, nothing written"] += 1
            return "refused"

        assert ran.exit_code == 0, ran.stderr
        assert [p.name for p in parent.iterdir()] == ["dest"]  # nothing outside DEST
        for path in dest.rglob("*"):
            assert path.resolve().is_relative_to(dest.resolve()), path
        if name is not None:
            answers = yaml.safe_load((dest / ".copier-answers.yml").read_text())
            assert answers["project_name"] == name
            assert (dest / "src" / package_name(name) / "__main__.py").is_file()
            if "49" not in name:
                assert "49" not in rendered_text(dest).replace(name, "")
        assert lint_clean(dest)
        tally[SUITE]["rendered lint-clean"] += 1
        return "rendered"


@pytest.fixture(autouse=True)
def _tally_escapes(tally):
    tally[SUITE]["escaped DEST or evaluated"] += 0  # any such case fails its test
    yield


# --- names ----------------------------------------------------------------------------------------


@examples(40)
@given(name=NAMES)
def test_any_name_renders_clean_or_is_refused(scaffold, tally, name):
    renders_or_refuses(scaffold, tally, ["--name", name], name)


@examples(4)
@given(name=VALID_NAMES)
def test_names_the_rule_accepts_render_lint_clean(scaffold, tally, name):
    renders_or_refuses(scaffold, tally, ["--name", name], name)


@pytest.mark.slow
@examples(25)
@given(name=VALID_NAMES)
def test_many_accepted_names_render_lint_clean(scaffold, tally, name):
    renders_or_refuses(scaffold, tally, ["--name", name], name)


def test_a_jinja_name_is_refused_as_written(scaffold, tally):
    tally[SUITE]["inputs tried"] += 1
    with tempfile.TemporaryDirectory() as parent:
        ran = scaffold("new", Path(parent) / "d", "--name", "{{7*7}}", "--defaults")
    assert ran.exit_code == 2 and "'{{7*7}}'" in ran.stderr and "49" not in ran.stderr
    tally[SUITE]["refused in one line, nothing written"] += 1


# --- values and combinations ----------------------------------------------------------------------


def _flags(question) -> st.SearchStrategy[list[str]]:
    """A question's flag with a valid value, a junk one, or left out."""
    if question.type == "bool":
        negative = f"--no-{question.flag.removeprefix('--')}"
        return st.sampled_from([[], [question.flag], [negative]])
    if question.choices:
        valid = st.sampled_from([str(v) for v in question.values])
    else:
        valid = st.integers(1, 8).map(str)
    junk = st.one_of(
        st.text(max_size=12),
        st.integers(-(2**70), 2**70).map(str),
        st.sampled_from(["", " ", "1.0", "1e3", "0x10", "٣", "{{7*7}}", "--defaults", "None"]),
    )
    return st.one_of(
        st.just([]),
        valid.map(lambda v: [question.flag, v]),
        junk.map(lambda v: [question.flag, v]),
    )


QUESTIONS = [q for q in asked_questions() if q.name != "project_name"]
ARGUMENTS = st.tuples(*(_flags(q) for q in QUESTIONS)).map(
    lambda parts: [a for part in parts for a in part]
)


@examples(12)
@given(args=ARGUMENTS)
def test_any_values_render_clean_or_are_refused(scaffold, tally, args):
    renders_or_refuses(scaffold, tally, args)


@pytest.mark.slow
@examples(40)
@given(args=ARGUMENTS)
def test_many_values_render_clean_or_are_refused(scaffold, tally, args):
    renders_or_refuses(scaffold, tally, args)


# --- --force never loses a user's file -----------------------------------------------------------

PROJECT_FILES = ["pyproject.toml", "README.md", ".gitignore", ".copier-answers.yml"]
USER_FILES = st.dictionaries(
    st.sampled_from([*PROJECT_FILES, "src/dest/train.py", "notes.txt", "data/x.csv", "src/x.py"]),
    st.one_of(st.just(None), st.binary(max_size=40)),  # None: exactly what scaffold renders
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return render.new_project(tmp_path_factory.mktemp("pristine") / "dest", {}, git=False).path


@pytest.mark.slow
@examples(10)
@given(files=USER_FILES)
def test_force_keeps_every_file_the_user_had(scaffold, tally, pristine, files):
    tally[SUITE]["inputs tried"] += 1
    with tempfile.TemporaryDirectory() as parent:
        dest = Path(parent) / "dest"
        for name, content in files.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            same = content is None and (pristine / name).is_file()
            (dest / name).write_bytes((pristine / name).read_bytes() if same else content or b"")
        before = snapshot(dest)

        ran = scaffold("new", dest, "--force", "--no-git", "--defaults")

        after = snapshot(dest)
        if ran.exit_code == 2:
            assert len(ran.stderr_lines) == 1 and after == before
            tally[SUITE]["refused in one line, nothing written"] += 1
        else:
            assert ran.exit_code == 0, ran.stderr
            assert {k: after[k] for k in before} == before  # every user file kept as it was
            tally[SUITE]["rendered lint-clean"] += 1


# --- interrupts at random moments of a real `scaffold new` ----------------------------------------


def interrupt_at_random(tmp_path: Path, seed: int, how: signal.Signals, tally) -> None:
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        [sys.executable, "-m", "scaffold", "new", "demo", "--defaults"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            proc.wait(timeout=rng.uniform(0.3, 4.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(how)
            tally[SUITE]["interrupts sent"] += 1
        _, stderr = proc.communicate(timeout=120)
    tally[SUITE]["inputs tried"] += 1
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".demo.scaffold-"))
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".demo.scaffold-")]
    if how == signal.SIGKILL:  # no clean-up can run: the staging folder may stay behind
        tally[SUITE]["staging folders a SIGKILL left beside DEST"] += len(staging)
    else:
        assert staging == [], (proc.returncode, stderr)
    if left == ["demo"]:  # finished, or interrupted only once the whole project was in place
        assert (tmp_path / "demo" / ".copier-answers.yml").is_file(), proc.returncode
        assert (tmp_path / "demo" / "src" / "demo" / "__main__.py").is_file()
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=tmp_path / "demo", capture_output=True, text=True
        )
        assert status.returncode == 0 and status.stdout == ""  # complete and committed
        tally[SUITE]["interrupted renders complete"] += proc.returncode != 0
        return
    assert proc.returncode != 0 and left == [], (proc.returncode, left, stderr)
    tally[SUITE]["interrupted renders that left nothing"] += 1


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_at_a_random_moment_leaves_nothing_or_all(tmp_path, tally, how):
    interrupt_at_random(tmp_path, 7, how, tally)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_interrupts_at_random_moments_leave_nothing_or_all(tmp_path, tally, how, seed):
    interrupt_at_random(tmp_path, seed, how, tally)


# --- security: nothing unpickles code, and copier runs without unsafe features ------------------

UNSAFE = re.compile(
    r"weights_only\s*=\s*False|allow_pickle\s*=\s*True|\bimport\s+(c?pickle|dill|marshal|shelve)\b"
    r"|\bfrom\s+(c?pickle|dill|marshal|shelve)\b|\bpickle\.|\bcloudpickle\b|(?<![\w.])(eval|exec)\("
)
TORCH_LOAD = re.compile(r"torch\.load\(([^()]|\([^()]*\))*\)")
NP_LOAD = re.compile(r"np\.load\(([^()]|\([^()]*\))*\)")


def unsafe_lines(text: str) -> list[str]:
    found = [line for line in text.splitlines() if UNSAFE.search(line)]
    found += [m[0] for m in TORCH_LOAD.finditer(text) if "weights_only=True" not in m[0]]
    found += [m[0] for m in NP_LOAD.finditer(text) if "allow_pickle=False" not in m[0]]
    return found


def test_the_template_never_unpickles(tally):
    for path in sorted((template_dir() / "project").rglob("*")):
        if path.is_file():
            tally[SUITE]["files scanned for unpickling"] += 1
            assert unsafe_lines(path.read_text()) == [], path


def pairwise_cover(combos: list[dict]) -> list[dict]:
    """Combinations that between them hold every pair of answers some valid combination holds."""

    def pairs(answers: dict) -> set:
        items = sorted((k, str(v)) for k, v in answers.items())
        return {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}

    chosen, covered = [], set()
    for answers in sorted(combos, key=lambda a: -len(pairs(a))):
        if not pairs(answers) <= covered:
            chosen.append(answers)
            covered |= pairs(answers)
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize(
    "answers", pairwise_cover(combinations()), ids=lambda a: "-".join(map(str, a.values()))
)
def test_no_render_unpickles(tmp_path, tally, answers):
    try:
        project = render.new_project(tmp_path / "demo", answers, git=False).path
    except UsageError:  # an invalid combination (ddp on mps): nothing rendered to scan
        return
    for path in sorted(project.rglob("*")):
        if path.is_file():
            tally[SUITE]["files scanned for unpickling"] += 1
            assert unsafe_lines(path.read_text()) == [], path


def test_copier_runs_without_unsafe_features(tmp_path, monkeypatch):
    calls = []
    real = _compat.run_copy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_compat, "run_copy", spy)
    render.new_project(tmp_path / "demo", {}, git=False)

    assert len(calls) == 1 and calls[0]["unsafe"] is False
    assert not any("trust" in key for key in calls[0])
    config = yaml.safe_load((template_dir() / "copier.yml").read_text())
    # the features copier only runs with --trust/unsafe: none in the template
    assert not {"_tasks", "_migrations", "_jinja_extensions", "_external_data"} & config.keys()
    for source in (REPO / "scaffold").rglob("*.py"):
        text = source.read_text()
        assert "unsafe=True" not in text and "--trust" not in text and "--UNSAFE" not in text


def test_the_readme_documents_the_checkpoint_guarantees(tmp_path):
    project = render.new_project(tmp_path / "demo", {}, git=False).path
    readme = (project / "README.md").read_text()
    section = readme.split("## Checkpoints", 1)[1].split("\n## ", 1)[0]
    for promise in ("temporary file", "fsync", "renamed", "weights_only=True", "pickled code"):
        assert promise in section, promise
    assert "data is never\n  unpickled" in section or "allow_pickle=False" in section
    assert "truncated or corrupt" in section


def test_a_dest_name_longer_than_the_file_system_allows_is_one_line(scaffold, tally, tmp_path):
    """It was an OSError traceback (File name too long)."""
    tally[SUITE]["inputs tried"] += 1
    ran = scaffold("new", tmp_path / ("x" * 300), "--no-git", "--defaults")
    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
    assert "is 300 bytes, longer than this file system allows (255)" in ran.stderr
    assert list(tmp_path.iterdir()) == []
    tally[SUITE]["refused in one line, nothing written"] += 1


# DEST (under tmp_path) and the one line that refuses it: each was a traceback.
BAD_DESTS = {
    "a 5,000-byte folder name": ("x" * 5000, "the folder name xxxxxxxxxxxxxxxxxxxx... is 5000"),
    "a 300-byte folder above DEST": (
        "y" * 300 + "/demo",
        "the folder name yyyyyyyyyyyyyyyyyyyy...",
    ),
    "a 5,000-byte path of short names": ("/".join(["abcdefghi"] * 500), "DEST is 5"),
    "inside a file": ("a-file/demo", "{tmp}/a-file is not a folder: DEST cannot be inside it"),
    "deeper inside a file": ("a-file/sub/demo", "{tmp}/a-file is not a folder: DEST cannot"),
}


@pytest.mark.parametrize("dest, refusal", BAD_DESTS.values(), ids=BAD_DESTS)
def test_a_dest_that_cannot_be_made_is_one_line(scaffold, tally, tmp_path, dest, refusal):
    tally[SUITE]["inputs tried"] += 1
    (tmp_path / "a-file").write_text("mine\n")
    before = snapshot(tmp_path)
    ran = scaffold("new", f"{tmp_path}/{dest}", "--defaults")
    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
    assert ran.stderr.startswith("error: " + refusal.format(tmp=tmp_path)), ran.stderr
    assert snapshot(tmp_path) == before
    tally[SUITE]["refused in one line, nothing written"] += 1


@pytest.mark.parametrize("dest", ["demo", "sub/demo", "."], ids=["in", "below", "itself"])
def test_a_dest_in_a_folder_without_write_permission_is_one_line(scaffold, tally, tmp_path, dest):
    """`.`: a read-only folder that already holds files, with --force."""
    tally[SUITE]["inputs tried"] += 1
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "notes.txt").write_text("mine\n")
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes in read-only folders (root)")
        before = snapshot(tmp_path)
        ran = scaffold("new", locked / dest, "--defaults", "--force")
        assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
        assert ran.stderr.startswith(f"error: cannot write in {locked}: choose a DEST you can")
        assert snapshot(tmp_path) == before
    finally:
        locked.chmod(0o755)
    tally[SUITE]["refused in one line, nothing written"] += 1


def test_a_damaged_answers_file_is_one_line_before_update(scaffold, tally, tmp_path):
    """It was a 91-line YAML traceback."""
    tally[SUITE]["inputs tried"] += 1
    project = render.new_project(tmp_path / "demo", git=True).path
    (project / ".copier-answers.yml").write_text("task: [unclosed\n  : : bad\n")
    subprocess.run(["git", "commit", "-qam", "damage"], cwd=project, check=True)
    before = snapshot(project)
    ran = scaffold("update", project)
    assert ran.exit_code == 2 and len(ran.stderr_lines) == 1, ran.stderr
    assert ran.stderr.startswith(f"error: {project / '.copier-answers.yml'} is damaged (line 2)")
    assert snapshot(project) == before
    tally[SUITE]["refused in one line, nothing written"] += 1


def test_a_full_disk_while_rendering_is_one_line_and_nothing_is_written(
    scaffold, tally, tmp_path, monkeypatch
):
    """It was an OSError traceback from copier's file writes (measured on a 48 KB tmpfs)."""
    tally[SUITE]["inputs tried"] += 1
    written = []
    write_bytes = Path.write_bytes

    def fills_up(path: Path, data) -> int:
        written.append(path)
        if len(written) > 5:  # the disk is full after five files
            raise OSError(28, os.strerror(28))
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", fills_up)
    ran = scaffold("new", tmp_path / "demo", "--defaults")
    assert len(written) > 5  # copier wrote the project's files this way: the fault was hit
    assert ran.exit_code == 1 and len(ran.stderr_lines) == 1, ran.stderr
    assert ran.stderr.startswith("error: cannot write the project: No space left on device")
    assert list(tmp_path.iterdir()) == []  # no DEST, no staging folder
    tally[SUITE]["refused in one line, nothing written"] += 1


def test_the_counted_suites_print_their_counts_under_xdist(tally):
    """CI runs `pytest -n auto`, where each worker kept its own counts and none were printed."""
    tally[SUITE]["inputs tried"] += 1
    cases = "jinja_name_is_refused or rng_state_is_its_own"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-k", cases,
         "tests/test_bad_input.py", "tests/test_faults.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    assert "2 passed" in done.stdout
    summary = done.stdout.split("fault and bad-input summary")[1]
    assert f"{SUITE}: escaped DEST or evaluated 0, inputs tried 1, refused" in summary
    assert "faults (generated projects): data lost 0, inputs tried 1\n" in summary
