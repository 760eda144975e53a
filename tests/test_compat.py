"""The private APIs scaffold/_compat.py relies on (checked against copier 9.19.1 and CPython
3.11) still have the shape and behaviour it expects: a failure here names what changed."""

from __future__ import annotations

import atexit
import inspect
import multiprocessing.util
import os
import threading

import copier
import jinja2
import pytest

from scaffold import _compat
from scaffold.golden import differences
from scaffold.questions import template_dir


def test_copier_has_the_worker_scaffold_drives():
    worker = _compat.copier_worker_class()

    assert worker is not None, f"copier {copier.__version__} has no usable Worker"
    assert list(inspect.signature(worker._ask).parameters) == ["self"]
    fields = inspect.signature(worker).parameters
    for name in ("src_path", "dst_path", "data", "defaults", "quiet", "unsafe", "pretend"):
        assert name in fields, name


def test_a_render_through_the_worker_equals_copier_run_copy(tmp_path):
    data = {"project_name": "demo", "task": "generation", "compile": True}
    public = tmp_path / "public" / "demo"
    private = tmp_path / "private" / "demo"
    copier.run_copy(str(template_dir()), public, data=data, defaults=True, quiet=True)
    worker = _compat.run_copy(str(template_dir()), private, data=data, defaults=True, quiet=True)

    assert differences(public, private) == []
    assert worker.answers.combined["task"] == "generation"


def test_copiers_executable_bit_sync_runs_only_where_git_ignores_file_modes(tmp_path, monkeypatch):
    """copier syncs each rendered file's executable bit into the git index, which acts only in
    a repository whose core.fileMode is false; scaffold asks git that once a render and lets
    copier's sync run for every file there, and skips it elsewhere."""
    import subprocess

    synced = []
    worker_class = _compat.copier_worker_class()
    monkeypatch.setattr(
        worker_class, "_sync_git_index_executable_bit", lambda self, path, mode: synced.append(path)
    )
    data = {"project_name": "demo", "distributed": "ddp"}
    outside = tmp_path / "outside" / "demo"
    assert not _compat.git_ignores_file_modes(outside)
    _compat.run_copy(str(template_dir()), outside, data=data, defaults=True, quiet=True)
    assert synced == []

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "core.fileMode", "false"], check=True)
    inside = repo / "demo"
    assert _compat.git_ignores_file_modes(inside)
    _compat.run_copy(str(template_dir()), inside, data=data, defaults=True, quiet=True)
    assert len(synced) == sum(1 for p in inside.rglob("*") if p.is_file())


def test_the_validator_runs_copier_s_own_questionnaire():
    validate = _compat.answer_validator(template_dir())

    assert validate({"task": "regression"}) is None
    refused = validate({"device": "mps", "distributed": "ddp"})
    assert refused is not None and "not available on mps" in refused
    refused = validate({"device": "mps", "distributed": "fsdp"})
    assert refused is not None and "fsdp needs the NCCL or gloo backend" in refused
    assert validate({"device": "cuda", "distributed": "fsdp"}) is None


@pytest.mark.parametrize(
    ("data", "question", "kind"),
    [
        ({"task": "poetry"}, "task", "choice"),
        ({"grad_accum_steps": 0}, "grad_accum_steps", "validator"),
        ({"device": "mps", "distributed": "ddp"}, "distributed", "choice"),
    ],
)
def test_copier_s_answer_errors_are_read(tmp_path, data, question, kind):
    with pytest.raises(ValueError) as raised:
        copier.run_copy(str(template_dir()), tmp_path / "demo", data=data, defaults=True)

    assert not isinstance(raised.value, copier.errors.CopierError)  # no type of its own
    refused = _compat.answer_error(raised.value)
    assert refused is not None, str(raised.value)
    assert (refused.question, refused.kind) == (question, kind)
    assert refused.detail and question not in refused.detail.split(":")[0]


def test_compiled_templates_are_reused_across_environments(tmp_path, monkeypatch):
    compiled = []
    real = jinja2.Environment.compile

    def counting(self, *args, **kwargs):
        compiled.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    renders = []
    for _ in range(2):
        env = jinja2.Environment(trim_blocks=True)
        _compat.cache_compiled_templates(env, tmp_path)
        renders.append(env.from_string("{% for i in n %}{{ i }}{% endfor %}").render(n=[1, 2]))
        renders.append(env.from_string("{{ x }}").render(x=3))

    assert renders == ["12", "3", "12", "3"]
    assert len(compiled) == 2  # the second environment found both on disk
    other = jinja2.Environment(trim_blocks=False)  # other syntax options: other code
    _compat.cache_compiled_templates(other, tmp_path)
    other.from_string("{{ x }}")
    assert len(compiled) == 3


def test_compiled_templates_stay_in_memory_for_the_next_environment(tmp_path, monkeypatch):
    """Each render makes a new environment: the code one compiled (or read from disk) serves the
    next without compiling or reading it again."""
    first = jinja2.Environment()
    _compat.cache_compiled_templates(first, tmp_path)
    assert first.from_string("{{ y }}!").render(y=1) == "1!"

    def never(*args, **kwargs):
        raise AssertionError("compiled or read again")

    monkeypatch.setattr(jinja2.Environment, "compile", never)
    monkeypatch.setattr(_compat, "_load", never)
    second = jinja2.Environment()
    _compat.cache_compiled_templates(second, tmp_path)
    assert second.from_string("{{ y }}!").render(y=2) == "2!"


def test_renders_share_copiers_template_where_asked_and_render_the_same(tmp_path, monkeypatch):
    """The matrix's workers (share_templates) give each render the Template an earlier render of
    the folder built: parsed once, the same files rendered; an edited copier.yml is read again."""
    import shutil

    from scaffold.render import new_project

    template = tmp_path / "template"
    shutil.copytree(template_dir(), template)
    built = []
    share = _compat._share_template

    def recorded(worker, src_path, options):
        share(worker, src_path, options)
        built.append(worker.template)

    monkeypatch.setattr(_compat, "_share_template", recorded)
    monkeypatch.setattr(_compat, "_SHARED_TEMPLATES", None)
    alone = new_project(tmp_path / "alone" / "p", {}, git=False, template=template).path
    monkeypatch.setattr(_compat, "_SHARED_TEMPLATES", {})
    first = new_project(tmp_path / "first" / "p", {}, git=False, template=template).path
    shared = new_project(tmp_path / "shared" / "p", {}, git=False, template=template).path

    assert built[1] is built[2] and built[0] is not built[1]
    assert differences(alone, shared) == differences(alone, first) == []
    (template / "copier.yml").write_text((template / "copier.yml").read_text() + "\n")
    new_project(tmp_path / "edited" / "p", {}, git=False, template=template)
    assert built[3] is not built[2]


def test_the_standard_library_exit_machinery_is_there():
    for module, name in [
        (atexit, "_clear"),
        (atexit, "_run_exitfuncs"),
        (threading, "_shutdown"),
        (multiprocessing.util, "_exit_function"),
    ]:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name}"
    # forget_exit_handlers() clears it only where it exists: renamed, a forked check would run
    # its parent's threading exit handlers, and nothing else would say so.
    atexits = getattr(threading, "_threading_atexits", None)
    assert isinstance(atexits, list), "threading._threading_atexits"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_runs_only_the_exit_handlers_registered_after_forgetting(tmp_path):
    log = tmp_path / "log"
    atexit.register(_append, log, "before")
    try:
        pid = os.fork()
        if pid == 0:
            try:
                _compat.forget_exit_handlers()
                atexit.register(_append, log, "after")
                _compat.run_exit_handlers()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    finally:
        atexit.unregister(_append)
    assert log.read_text() == "after\n"


def _append(path, text):
    with open(path, "a") as file:
        file.write(text + "\n")
