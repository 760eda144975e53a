"""The combinations of answers that CI renders and checks, derived from templates/copier.yml."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from scaffold.questions import Question, asked_questions

# Integer questions have no choices to enumerate; DESIGN.md fixes the values the matrix takes.
INT_VALUES = {"grad_accum_steps": (1, 4)}


def _values(question: Question) -> tuple[Any, ...]:
    if question.choices:
        return question.values
    if question.type == "bool":
        return (False, True)
    if question.name in INT_VALUES:
        return INT_VALUES[question.name]
    raise ValueError(f"no matrix values for question {question.name!r} ({question.type})")


def combinations(template: Path | None = None) -> list[dict[str, Any]]:
    """Every combination of the asked questions' values (the project name aside), in file order."""
    questions = [q for q in asked_questions(template) if q.name != "project_name"]
    names = [q.name for q in questions]
    return [
        dict(zip(names, values, strict=True))
        for values in itertools.product(*(_values(q) for q in questions))
    ]


def combination_id(answers: dict[str, Any]) -> str:
    """A short readable name: cpu-fp32-accum1-nocompile."""
    parts = []
    for name, value in answers.items():
        if isinstance(value, bool):
            parts.append(name if value else f"no{name}")
        elif isinstance(value, int):
            parts.append(f"{name.split('_')[0]}{value}")
        else:
            parts.append(str(value))
    return "-".join(parts)
