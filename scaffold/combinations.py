"""The valid combinations of answers: enumerated from copier.yml, selected, dealt into shards.

The combinations come from templates/copier.yml alone: the product of every asked question's
values (the project name aside), less those copier's own validators refuse (choice validators
such as "ddp is not for mps"). The matrix runs them; the golden renders pick two of them.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from scaffold import _compat
from scaffold.errors import UsageError
from scaffold.questions import Question, asked_questions, load_questions, template_dir

# Integer questions have no choices to enumerate: the matrix takes these values, for accumulation
# off and on (README.md, "The combination matrix").
INT_VALUES = {"grad_accum_steps": (1, 4)}


def values(question: Question) -> tuple[Any, ...]:
    """The values a question takes in the matrix."""
    if question.choices:
        return question.values
    if question.type == "bool":
        return (False, True)
    if question.name in INT_VALUES:
        return INT_VALUES[question.name]
    raise ValueError(f"no matrix values for question {question.name!r} ({question.type})")


def varied_questions(template: Path | None = None) -> list[Question]:
    """The questions whose answers make the combinations: every asked one but the name."""
    return [q for q in asked_questions(template) if q.name != "project_name"]


def all_combinations(template: Path | None = None) -> list[dict[str, Any]]:
    """Every combination of the asked questions' values (the project name aside), in file order,
    valid or not."""
    questions = varied_questions(template)
    names = [q.name for q in questions]
    return [
        dict(zip(names, product, strict=True))
        for product in itertools.product(*(values(q) for q in questions))
    ]


def combinations(template: Path | None = None) -> list[dict[str, Any]]:
    """Every valid combination, in file order: those copier's validators accept.

    Asking copier's questionnaire about all ~4,320 combinations takes half a minute, so the
    answer is kept: in this process, and on disk in the user's cache folder for the next one
    (pytest's workers, `scaffold matrix`). It is named by what decides it: copier.yml's bytes and
    the versions of copier and Jinja, which run its validators."""
    template = (template or template_dir()).resolve()
    key = _combinations_key(template)
    if key not in _COMBINATIONS:
        valid = _load_combinations(key)
        if valid is None:
            valid = _valid_combinations(template)
            _store_combinations(key, valid)
        _COMBINATIONS[key] = valid
    return [dict(answers) for answers in _COMBINATIONS[key]]


_COMBINATIONS: dict[str, list[dict[str, Any]]] = {}


def _valid_combinations(template: Path) -> list[dict[str, Any]]:
    """Ask copier's questionnaire about every combination: once for each set of values of the
    answers its validators read (the others cannot change its verdict), each verdict then dealt to
    every combination with those values."""
    validate = _compat.answer_validator(template)
    # The hidden questions given as answers: copier would otherwise render each of them for every
    # combination (the reserved names' list alone, item by item, was three quarters of the time),
    # a plain default to the same value, a templated one (the answers' folders, the checkpoint
    # format) to a value no validator reads.
    questions = load_questions(template)
    fixed = {
        q.name: q.default if _plain_hidden(q) else ""
        for q in questions.values()
        if q.hidden and q.default is not None
    }
    read = _validators_read(template)
    verdicts: dict[tuple[Any, ...], bool] = {}
    valid = []
    for answers in all_combinations(template):
        key = tuple(sorted((k, repr(v)) for k, v in answers.items() if read is None or k in read))
        if key not in verdicts:
            verdicts[key] = validate({**fixed, **answers}) is None
        if verdicts[key]:
            valid.append(answers)
    return valid


def _validators_read(template: Path) -> set[str] | None:
    """The questions copier.yml's validators read (None: one reads a hidden question computed from
    others, so every answer counts)."""
    from jinja2 import Environment, nodes

    raw = yaml.safe_load((template / "copier.yml").read_text(encoding="utf-8"))
    hidden = {n for n, q in load_questions(template).items() if q.hidden and not _plain_hidden(q)}
    texts = []
    names: set[str] = set()  # a validated question's own answer, then what its validators read
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            continue
        choices = spec.get("choices")
        mine = [spec.get("validator")]
        mine += [c.get("validator") for c in (choices or {}).values() if isinstance(c, dict)]
        if any(mine):
            names.add(name)
            texts += mine
    for text in filter(None, texts):
        tree = Environment().parse(text)
        names |= {n.name for n in tree.find_all(nodes.Name) if n.ctx == "load"}
    return None if names & hidden else names


def _plain_hidden(question: Question) -> bool:
    """A `when: false` question whose default is a value, not a Jinja template."""
    default = question.default
    templated = isinstance(default, str) and ("{{" in default or "{%" in default)
    return question.hidden and default is not None and not templated


def _combinations_key(template: Path) -> str:
    source = (template / "copier.yml").read_bytes()
    versions = (_compat.distribution_version("copier"), _compat.distribution_version("jinja2"))
    return hashlib.sha256(repr((CACHE_FORMAT, versions)).encode() + source).hexdigest()


CACHE_FORMAT = 1  # raised when what is stored changes shape


def _load_combinations(key: str) -> list[dict[str, Any]] | None:
    folder = _compat.cache_folder("combinations")
    if folder is None:
        return None
    try:
        stored = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, list) or not all(isinstance(a, dict) for a in stored):
        return None
    return stored


def _store_combinations(key: str, valid: list[dict[str, Any]]) -> None:
    folder = _compat.cache_folder("combinations")
    if folder is not None:
        _compat.write_atomically(folder / f"{key}.json", json.dumps(valid).encode())


def combination_id(answers: dict[str, Any]) -> str:
    """A short readable name: classification-none-cpu-fp32-grad1-nocompile."""
    parts = []
    for name, value in answers.items():
        if isinstance(value, bool):
            parts.append(name if value else f"no{name}")
        elif isinstance(value, int):
            parts.append(f"{name.split('_')[0]}{value}")
        else:
            parts.append(str(value))
    return "-".join(parts)


def select(
    combos: Sequence[dict[str, Any]], only: Iterable[str], template: Path | None = None
) -> list[dict[str, Any]]:
    """The combinations matching every KEY=VALUE of `only` (keys and values from copier.yml)."""
    questions = {q.name: q for q in varied_questions(template)}
    wanted: dict[str, Any] = {}
    for item in only:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in questions:
            known = ", ".join(questions)
            raise UsageError(f"--only {item!r}: expected KEY=VALUE with KEY one of {known}")
        taken = values(questions[key])
        matches = [v for v in taken if _spelled(v, text.strip())]
        if not matches:
            listed = ", ".join(spelling(v) for v in taken)
            raise UsageError(f"--only {item!r}: {key} takes {listed} in the matrix")
        wanted[key] = matches[0]
    return [c for c in combos if all(c[k] == v for k, v in wanted.items())]


def spelling(value: Any) -> str:
    """How an answer is written in KEY=VALUE: yes and no for booleans."""
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _spelled(value: Any, text: str) -> bool:
    if isinstance(value, bool):
        return text.lower() in (("yes", "true", "1") if value else ("no", "false", "0"))
    return str(value) == text


def shard(
    combos: Sequence[dict[str, Any]],
    spec: str,
    key: Callable[[dict[str, Any]], str] = combination_id,
) -> list[dict[str, Any]]:
    """Slice I of N (1 <= I <= N), deterministic, the slices together exactly `combos`.

    Combinations are dealt round-robin in the order of a hash of their names, not in file
    order (where a stride can fall in step with the inner questions: every shard all compile
    or none), so each slice is a fair sample of the matrix and slices take similar times.
    Combinations with the same `key` go to the same slice (dealt by the hash of the key), the
    largest groups first, so that groups of a size are dealt evenly, not three of the largest to
    one slice and none to another."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise UsageError(f"--shard {spec!r}: expected I/N with 1 <= I <= N, such as 2/8")
    index, count = int(match[1]), int(match[2])
    sizes = collections.Counter(key(c) for c in combos)
    keys = sorted(sizes, key=lambda k: (-sizes[k], _stable_hash(k)))
    mine = set(keys[index - 1 :: count])
    return [c for c in combos if key(c) in mine]


def _stable_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
