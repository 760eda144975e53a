"""Definitions the template moved from one Python file to another, moved in the project first.

git's merge follows a renamed file but not a function moved into another file: the owner's edit
inside it would be a conflict in the old file, and the new file would get the template's version
without the edit. So before it merges, `scaffold update` makes the template's moves itself, on
both sides of the merge, and git's three-way merge then carries the edit into the new file.

The rule. Compare the previous pristine render P with the new render N, taking a file the
template renamed (git's rename detection, as the merge sees it) as the same file. A top-level
`def`, `async def` or `class` named X moved from file A to file B when:
- X is defined in A in P and not in A (or what A was renamed to) in N;
- X is defined in B in N and not in B (or what B was renamed from) in P; B may be new;
- no other file lost X and no other file gained X, and A in P and B in N define X once;
- every Python file that differs between P and N parses (else nothing moves).
A definition spans the comment lines directly above it (from column 0, no blank line between),
its decorators and its body to its last line (ast's end_lineno); the blank lines after it leave
with it (those before it, where it ends its file). It goes into B after the nearest definition
that precedes it in N's B and that B already defines once, else before the nearest following
one, else at B's end, two blank lines apart from its neighbours; into a B that does not exist
yet it goes alone.

The same moves are made to P, giving P' (a child of P on the pristine branch, and the parent of
N), and to the owner's HEAD, giving a commit on their branch whose parents are HEAD and P', so
that P' is the merge's base and differs from ours only by the owner's edits. This needs a HEAD
that has merged P (else nothing moves). A move is made only where HEAD allows the same one: A
defines X once there, B does not define X, and B exists there exactly when it exists in P; the
definition it goes after or before is one that both P's and HEAD's B define once. Otherwise X is
left to the merge, as before (an owner who deleted X from A gets the template's X in B).
"""

from __future__ import annotations

import ast
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from scaffold import __version__, git


@dataclass(frozen=True)
class Move:
    name: str
    source: str  # the file it leaves, as P and the owner's HEAD name it
    target: str  # the file it goes to, as P names it (N's file, or the one N's was renamed from)
    order: tuple[str, ...]  # the definitions of N's file, in order: where it goes among them


@dataclass(frozen=True)
class Moved:
    moves: list[Move]
    base: str  # P with the moves made, a child of P: the merge's base
    ours: str  # the owner's HEAD with the moves made: a merge of HEAD and `base`

    def lines(self) -> list[str]:
        return described(self.moves)


def described(moves: list[Move]) -> list[str]:
    """'train_step, evaluate from A to B': a line for each pair of files."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for move in moves:
        pairs.setdefault((move.source, move.target), []).append(move.name)
    return [f"{', '.join(names)} from {a} to {b}" for (a, b), names in pairs.items()]


# A top-level definition: its name and its lines, first to last (1-based), comments above included.
_Span = tuple[str, int, int]
# What `_read` gives for a file it cannot take as it is: no parse, so no move touches the file.
_UNREADABLE = "\0"


def follow(project: Path, previous: str, tree: str, head: str) -> Moved | None:
    """Make the template's moves between render `previous` and `tree` in `previous` and in
    `head`, committed (no ref moves); None when there is none to make, or when `head` has not
    merged `previous` (the merge's base is then an older render, which the moves do not fit)."""
    moves = find(project, previous, tree) if git.is_ancestor(project, previous, head) else []
    if not moves:
        return None
    paths = {m.source for m in moves} | {m.target for m in moves}
    base = {path: _read(project, previous, path) for path in paths}
    ours = {path: _read(project, head, path) for path in paths}
    made = [move for move in moves if _make(move, [base, ours])]
    if not made:
        return None
    lines = described(made)
    listed = "\n".join(f"    {line}" for line in lines)
    it = "it" if len(made) == 1 else "them"
    subject = f"move {lines[0]}, where the template now has {it}"
    if len(lines) > 1:
        subject = "move definitions to the files where the template now has them"
    why = (
        f"The template of scaffold {__version__} moved {it}. Moving {it} here first, with your "
        "edits,\nlets the merge of the new render carry those edits along, where git alone "
        "would\nleave them as conflicts in the old files."
    )
    base_message = (
        f"Move definitions where the template of scaffold {__version__} has them\n\n{listed}\n\n"
        "The base of the merge of the next render, made like the move on the project's branch."
    )
    base_commit = _commit(project, [previous], base, base_message)
    message = f"scaffold update: {subject}\n\n{listed}\n\n{why}\n"
    return Moved(made, base_commit, _commit(project, [head, base_commit], ours, message))


def find(project: Path, previous: str, tree: str) -> list[Move]:
    """The moves from render `previous` to `tree`, by the module's rule, in the order to make
    them: by target file, in the order of N's target file."""
    diff = git.run(project, "diff-tree", "-r", "-M", "-z", "--name-status", previous, tree)
    fields = diff.stdout.split("\0")
    after: dict[str, str | None] = {}  # a file of P: its name in N (None: deleted)
    before: dict[str, str | None] = {}  # a file of N: its name in P (None: added)
    i = 0
    while i + 1 < len(fields):
        status, path = fields[i], fields[i + 1]
        if status.startswith("R"):
            renamed = fields[i + 2]
            i += 3
            if path.endswith(".py") != renamed.endswith(".py"):
                continue  # neither side is compared: the rename leaves or joins Python
            after[path], before[renamed] = renamed, path
            continue
        i += 2
        if status != "A":
            after[path] = None if status == "D" else path
        if status != "D":
            before[path] = None if status == "A" else path
    old = {p: _definitions(_read(project, previous, p)) for p in after if p.endswith(".py")}
    new = {p: _definitions(_read(project, tree, p)) for p in before if p.endswith(".py")}
    if None in old.values() or None in new.values():
        return []
    lost: dict[str, list[str]] = {}
    for path, spans in old.items():
        kept = _names(new.get(after[path] or "") or [])
        for name in _names(spans):
            if name not in kept:
                lost.setdefault(name, []).append(path)
    gained: dict[str, list[str]] = {}
    for path, spans in new.items():
        had = _names(old.get(before[path] or "") or [])
        for name in _names(spans):
            if name not in had:
                gained.setdefault(name, []).append(path)
    moves = []
    for name, sources in lost.items():
        targets = gained.get(name, [])
        if len(sources) != 1 or len(targets) != 1:
            continue
        source, target = sources[0], targets[0]
        if _names(old[source])[name] == 1 and _names(new[target])[name] == 1:
            order = tuple(span[0] for span in new[target])
            moves.append(Move(name, source, before[target] or target, order))
    return sorted(moves, key=lambda m: (m.target, m.order.index(m.name)))


def _make(move: Move, versions: list[dict[str, str | None]]) -> bool:
    """Make `move` in every one of `versions` (file: text, None where absent), or in none."""
    found = []
    for files in versions:
        source, target = files[move.source], files[move.target]
        spans, there = _definitions(source), _definitions(target)
        if spans is None or there is None or _names(spans)[move.name] != 1:
            return False
        if move.name in _names(there) or (target is None) != (versions[0][move.target] is None):
            return False
        found.append((spans, there))
    anchor = _anchor(move, [there for _, there in found])
    for files, (spans, there) in zip(versions, found, strict=True):
        lines = _lines(files[move.source])
        _, start, end = next(span for span in spans if span[0] == move.name)
        block = lines[start - 1 : end]
        files[move.source] = _removed(lines, start, end)
        files[move.target] = _inserted(_lines(files[move.target]), block, there, anchor)
    return True


def _anchor(move: Move, targets: list[list[_Span]]) -> tuple[str, bool] | None:
    """The definition to put `move` after (True) or before (False): the nearest one in N's
    order that every target defines once; None: at the end."""
    shared = set.intersection(*({n for n, c in _names(t).items() if c == 1} for t in targets))
    at = move.order.index(move.name)
    preceding = [name for name in reversed(move.order[:at]) if name in shared]
    if preceding:
        return preceding[0], True
    following = [name for name in move.order[at + 1 :] if name in shared]
    return (following[0], False) if following else None


def _removed(lines: list[str], start: int, end: int) -> str:
    """`lines` without lines `start` to `end` and the blank lines after them (before them, when
    nothing follows)."""
    first, last = start - 1, end
    while last < len(lines) and not lines[last].strip():
        last += 1
    if last == len(lines):
        while first > 0 and not lines[first - 1].strip():
            first -= 1
    return "".join(lines[:first] + lines[last:])


def _inserted(
    lines: list[str], block: list[str], spans: list[_Span], anchor: tuple[str, bool] | None
) -> str:
    gap = ["\n", "\n"]
    if anchor is None:
        while lines and not lines[-1].strip():
            lines.pop()
        return "".join([*lines, *gap, *block] if lines else block)
    name, after = anchor
    _, start, end = next(span for span in spans if span[0] == name)
    if after:
        rest = lines[end:]
        apart = gap if rest and rest[0].strip() else []
        return "".join([*lines[:end], *gap, *block, *apart, *rest])
    return "".join([*lines[: start - 1], *block, *gap, *lines[start - 1 :]])


def _lines(text: str | None) -> list[str]:
    """The lines of `text` as ast counts them, each ending with a newline (the last one too).
    Split at newlines only: `_read` lets no carriage return through, and str.splitlines would
    also split at a form feed."""
    lines = [line + "\n" for line in (text or "").split("\n")]
    if lines[-1] == "\n":  # the text ended with a newline, or was empty
        lines.pop()
    return lines


def _definitions(text: str | None) -> list[_Span] | None:
    """The top-level defs and classes of `text` in order (none: no file); None: no parse."""
    if text is None:
        return []
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    lines = _lines(text)
    spans = []
    previous_end = 0
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            while start - 1 > previous_end and lines[start - 2].startswith("#"):
                start -= 1
            spans.append((node.name, start, node.end_lineno or node.lineno))
        previous_end = node.end_lineno or node.lineno
    return spans


def _names(spans: list[_Span]) -> Counter[str]:
    return Counter(span[0] for span in spans)


def _read(project: Path, rev: str, path: str) -> str | None:
    """The file `path` of commit or tree `rev` as text; None where absent. A file that is not
    UTF-8 or whose line endings text mode would change reads as one that does not parse."""
    shown = git.run(project, "cat-file", "-s", f"{rev}:{path}", check=False)
    if shown.returncode != 0:
        return None
    try:
        text = git.run(project, "cat-file", "blob", f"{rev}:{path}").stdout
    except UnicodeDecodeError:
        text = None
    if text is None or len(text.encode()) != int(shown.stdout):
        return _UNREADABLE
    return text


def _commit(project: Path, parents: list[str], files: dict[str, str | None], message: str) -> str:
    """A commit of the first parent's tree with `files` written (a None one left as it is)."""
    parent = parents[0]
    with tempfile.TemporaryDirectory(prefix="scaffold-moves-") as scratch:
        index = Path(scratch) / "index"
        git.run(project, "read-tree", parent, index=index)
        for path, text in files.items():
            if text is None:
                continue
            blob = git.run(project, "hash-object", "-w", "--stdin", input=text).stdout.strip()
            listed = git.run(project, "ls-tree", parent, "--", path).stdout.split()
            mode = listed[0] if listed else "100644"
            git.run(project, "update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}",
                    index=index)  # fmt: skip
        tree = git.run(project, "write-tree", index=index).stdout.strip()
    linked = [arg for parent in parents for arg in ("-p", parent)]
    commit = ("commit-tree", "--no-gpg-sign", tree, *linked, "-m", message)
    return git.run(project, *git.identity(project), *commit).stdout.strip()
