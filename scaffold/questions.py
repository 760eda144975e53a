"""The questionnaire, read from the template's copier.yml, and the facts about this machine.

copier.yml is the single source of truth for the questions, their choices, defaults and
validators: everything here is derived from it, nothing re-lists an option.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaffold import machine
from scaffold.errors import UsageError

_PACKAGE_DIR = Path(__file__).resolve().parent

# copier's own default for `_answers_file`.
_COPIER_ANSWERS_FILE = ".copier-answers.yml"
# Questions whose flag is not `--<name-with-dashes>`.
_FLAG_NAMES = {"project_name": "--name"}


@dataclass(frozen=True)
class Choice:
    label: str  # what copier's prompt shows
    value: Any  # what the answers file records


@dataclass(frozen=True)
class Question:
    name: str
    type: str  # copier's type: str, int, float, bool, yaml, json
    help: str
    default: Any  # as written in copier.yml: may be a Jinja template
    choices: tuple[Choice, ...] = ()
    # `when: false`: never asked nor saved; a machine fact scaffold supplies, or a derived value.
    hidden: bool = False

    @property
    def flag(self) -> str:
        """The `scaffold new` option that answers this question."""
        return _FLAG_NAMES.get(self.name, "--" + self.name.replace("_", "-"))

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(choice.value for choice in self.choices)


def template_dir() -> Path:
    """The copier template: inside the installed package, else at the root of this checkout."""
    packaged = _PACKAGE_DIR / "templates"
    if (packaged / "copier.yml").is_file():
        return packaged
    return _PACKAGE_DIR.parent / "templates"


@functools.cache
def _copier_yml(template: Path | None = None) -> dict[str, Any]:
    path = (template or template_dir()) / "copier.yml"
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_questions(template: Path | None = None) -> dict[str, Question]:
    """Every question of `template`'s copier.yml (default: scaffold's own), in file order."""
    config = _copier_yml(template)
    return {
        name: _question(name, spec) for name, spec in config.items() if not name.startswith("_")
    }


def answers_file(template: Path | None = None) -> str:
    """Where in a project copier records its answers: copier.yml's `_answers_file`."""
    return str(_copier_yml(template).get("_answers_file", _COPIER_ANSWERS_FILE))


def project_answers(project: Path, template: Path | None = None) -> dict[str, Any]:
    """The answers `project` was rendered with ({} when it has no answers file)."""
    path = project / answers_file(template)
    if not path.is_file():
        return {}
    try:
        answers = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise UsageError(f"{path} is damaged{at}: restore it from git, then run again") from None
    if not isinstance(answers, dict):
        raise UsageError(f"{path} is damaged (not a mapping of answers): restore it from git")
    return answers


def asked_questions(template: Path | None = None) -> list[Question]:
    """The questions a person answers (by a flag or a prompt), in file order."""
    return [q for q in load_questions(template).values() if not q.hidden]


def package_name(project_name: str) -> str:
    """The import name of a project: copier.yml's `package_name` rule."""
    return project_name.lower().replace("-", "_").replace(".", "_")


@functools.cache
def machine_facts() -> dict[str, Any]:
    """The answers of copier.yml's hidden machine questions, found on this machine (without
    importing torch: see scaffold.machine)."""
    found = machine.accelerator()
    return {
        "machine_device": found.device,
        "machine_cuda_precision": found.cuda_precision,
        "unavailable_packages": machine.importable_top_level_names(),
    }


def resolved_defaults(template: Path | None = None) -> dict[str, Any]:
    """What each question defaults to on this machine, for a project rendered at `.../DEST`."""
    import copier  # imported here so that reading the questionnaire stays cheap

    with tempfile.TemporaryDirectory() as parent:
        worker = copier.run_copy(
            str(template or template_dir()),
            Path(parent) / "DEST",
            data=machine_facts(),
            defaults=True,
            pretend=True,
            quiet=True,
        )
        answers = worker.answers.combined
        return {q.name: answers.get(q.name) for q in asked_questions(template)}


def describe(question: Question, default: Any) -> str:
    """A question as `scaffold options` lists it: flag, help, choices, default here."""
    lines = [f"{question.name} ({_flag_usage(question)})"]
    if question.help:
        lines.append(f"    {question.help}")
    if question.choices:
        labels = [
            c.label if c.label.startswith(str(c.value)) else f"{c.value}: {c.label}"
            for c in question.choices
        ]
        lines.append("    choices: " + ", ".join(labels))
    lines.append(f"    default: {_default_text(question, default)}")
    return "\n".join(lines)


def _flag_usage(question: Question) -> str:
    if question.type == "bool":
        return f"{question.flag}/--no-{question.flag.removeprefix('--')}"
    if question.choices:
        return f"{question.flag} {'|'.join(str(v) for v in question.values)}"
    return f"{question.flag} {'N' if question.type == 'int' else 'TEXT'}"


def _default_text(question: Question, default: Any) -> str:
    written = str(question.default)
    if "dst_path" in written:
        return "the name of DEST's folder"
    if question.type == "bool":
        return question.flag if default else f"--no-{question.flag.removeprefix('--')}"
    if "machine_" in written:  # a default copier.yml takes from scaffold.machine's findings
        return f"{default} (on this machine: {machine.accelerator().evidence})"
    if "{{" in written or "{%" in written:
        return f"{default} (on this machine)"
    return str(default)


def _question(name: str, spec: Any) -> Question:
    if not isinstance(spec, dict):  # copier's shorthand `name: default`
        return Question(name=name, type=_type_of(spec), help="", default=spec)
    return Question(
        name=name,
        type=spec.get("type") or _type_of(spec.get("default")),
        help=spec.get("help", ""),
        default=spec.get("default"),
        choices=_choices(spec.get("choices")),
        hidden=spec.get("when") is False,
    )


def _choices(raw: Any) -> tuple[Choice, ...]:
    """copier's choice forms: a list of values or of [label, value] pairs, or a mapping of
    label to value or to {value, validator}."""
    if raw is None:
        return ()
    if isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        pairs = [tuple(item) if isinstance(item, list) else (str(item), item) for item in raw]
    return tuple(
        Choice(label=str(label), value=value["value"] if isinstance(value, dict) else value)
        for label, value in pairs
    )


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str"
