"""A render file by file: each template file of the project rendered with copier's own Jinja
environment and answers, in memory, without copier writing a tree.

The matrix lints each combination's files this way (a file's text depends on the answers it
reads, so most combinations share most of their files' texts: each text is linted once), and
`python -m scaffold.matrix.files --digest` prints one digest a combination, to show that a change
to the template moved no rendered byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from scaffold import _compat
from scaffold.questions import machine_facts, template_dir


class FileRenderer:
    """Renders a template's project files for any answers; one copier worker serves every call."""

    def __init__(self, template: Path | None = None) -> None:
        self.template = template or template_dir()
        worker_class = _compat.copier_worker_class()
        if worker_class is None:
            raise RuntimeError("this copier has no Worker._ask")
        probe = Path(tempfile.gettempdir()) / "scaffold-matrix-files" / "a-project"
        self._worker = worker_class(
            src_path=str(self.template), dst_path=probe, defaults=True, quiet=True
        )
        self._env = self._worker.jinja_env
        _compat.cache_compiled_templates(self._env)
        self._root = self.template / "project"
        self._sources = sorted(
            p.relative_to(self.template)
            for p in self._root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        self._names: dict[str, Any] = {}

    def context(self, answers: dict[str, Any]) -> dict[str, Any]:
        """copier's render context for `answers` (machine facts added where not given)."""
        self._worker.data = {**machine_facts(), **answers}
        self._worker._ask()
        return self._worker._render_context()

    def paths(self, context: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """(template path under templates/, rendered path in the project) of each file rendered."""
        for source in self._sources:
            parts = list(source.relative_to("project").parts)
            parts[-1] = parts[-1].removesuffix(".jinja")
            rendered = []
            for part in parts:
                if "{" in part:
                    part = self._name(part).render(context)
                if not part:
                    break
                rendered.append(part)
            else:
                yield source.as_posix(), "/".join(rendered)

    def _name(self, part: str) -> Any:
        if part not in self._names:
            self._names[part] = self._env.from_string(part)
        return self._names[part]

    def text(self, source: str, context: dict[str, Any]) -> str:
        """The rendered text of the template file `source` (a path under templates/)."""
        if not source.endswith(".jinja"):
            return (self.template / source).read_text()
        return self._env.get_template(source).render(**context)

    def render(self, answers: dict[str, Any]) -> dict[str, str]:
        """{path in the project: text} of every file the answers render."""
        context = self.context(answers)
        return {name: self.text(source, context) for source, name in self.paths(context)}


@dataclasses.dataclass
class Renders:
    """Many combinations' renders, each distinct text once."""

    texts: dict[str, str]  # a text's digest: the text
    files: list[dict[str, str]]  # for each combination, {path in the project: its text's digest}

    def of(self, i: int) -> dict[str, str]:
        """{path: text} of combination i."""
        return {path: self.texts[key] for path, key in self.files[i].items()}

    def modules(self) -> list[frozenset[int]]:
        """For each combination, the ids of its Python modules' texts (its src/ files)."""
        ids: dict[str, int] = {}
        return [
            frozenset(
                ids.setdefault(key, len(ids))
                for path, key in files.items()
                if path.startswith("src/") and path.endswith(".py")
            )
            for files in self.files
        ]


def render_many(
    combos: Sequence[dict[str, Any]], *, jobs: int = 1, template: Path | None = None
) -> Renders:
    """Every combination's files, rendered `jobs` processes at a time, CHUNK combinations a task."""
    chunks = [list(combos[i : i + CHUNK]) for i in range(0, len(combos), CHUNK)]
    renders = Renders(texts={}, files=[])
    if jobs <= 1 or len(chunks) <= 1:
        _start(template)
        results: Iterable[tuple[dict[str, str], list[dict[str, str]]]] = map(_render_chunk, chunks)
        for texts, files in results:
            renders.texts.update(texts)
            renders.files.extend(files)
        return renders
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs, initializer=_start, initargs=(template,)) as pool:
        for texts, files in pool.imap(_render_chunk, chunks):
            renders.texts.update(texts)
            renders.files.extend(files)
    return renders


CHUNK = 64
_WORKER: dict[str, Any] = {}


def _start(template: Path | None) -> None:
    _WORKER["renderer"] = FileRenderer(template)
    _WORKER["sent"] = set()


def _render_chunk(
    combos: Sequence[dict[str, Any]],
) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Render each of `combos`: the texts this worker has not sent yet, and each one's files."""
    renderer, sent = _WORKER["renderer"], _WORKER["sent"]
    texts: dict[str, str] = {}
    files = []
    for answers in combos:
        rendered = {}
        for path, text in renderer.render(answers).items():
            key = digest_text(text)
            rendered[path] = key
            if key not in sent:
                sent.add(key)
                texts[key] = text
        files.append(rendered)
    return texts, files


def digest_text(text: str) -> str:
    """A text's name in Renders.texts."""
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def digest(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()[:16]


def digests(combos: Iterable[dict[str, Any]], template: Path | None = None) -> Iterator[str]:
    """One line a combination: its id and the digest of its rendered files."""
    from scaffold.combinations import combination_id

    renderer = FileRenderer(template)
    for answers in combos:
        yield f"{combination_id(answers)} {digest(renderer.render(answers))}"


def main(argv: list[str] | None = None) -> int:
    from scaffold.combinations import combinations
    from scaffold.matrix.runner import LONGEST_NAME

    parser = argparse.ArgumentParser(prog="python -m scaffold.matrix.files", description=__doc__)
    parser.add_argument("--digest", action="store_true", help="one digest a combination")
    parser.add_argument("--template", type=Path, help="another template folder")
    parser.add_argument("--every", type=int, default=1, metavar="N", help="every Nth combination")
    args = parser.parse_args(argv)
    combos = [{**c, "project_name": LONGEST_NAME} for c in combinations()][:: args.every]
    for line in digests(combos, args.template):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
