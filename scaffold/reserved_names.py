"""The names copier.yml refuses for a package on its own, without scaffold: a literal list.

`scaffold` also refuses every name importable where it runs (machine_facts'
`unavailable_packages`); plain `copier copy` knows nothing of that environment, so copier.yml
carries this list of the ones that matter anywhere: every standard-library module of the Pythons
scaffold supports, and the packages a generated project imports or commonly sits beside.
Refresh it (it keeps the names already there, so run it with each supported Python) with

    python -m scaffold.reserved_names             # adds this Python's stdlib names
    python3.13 -m scaffold.reserved_names

tests/test_names.py fails when this Python has a standard-library module the list lacks.
Standard library only: it runs under any Python without scaffold's dependencies.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

COPIER_YML = Path(__file__).resolve().parent.parent / "templates" / "copier.yml"
# What generated projects import (their trackers and tests too), and the packaging tools.
COMMON = (
    "torch", "torchvision", "torchaudio", "numpy", "tqdm", "tensorboard", "wandb", "mlflow",
    "matplotlib", "pytest", "yaml", "setuptools", "pip", "pkg_resources",
)  # fmt: skip
# The line of copier.yml that holds the list.
_LINE = re.compile(r"^(  default: )\[(?P<names>[^\]]*)\]  # reserved names: .*$", re.M)


def reserved_names(text: str) -> list[str]:
    """The names in copier.yml's list."""
    match = _LINE.search(text)
    if match is None:
        raise SystemExit(f"{COPIER_YML}: no `default: [...]  # reserved names: ...` line")
    return [name.strip() for name in match["names"].split(",") if name.strip()]


def wanted(current: list[str]) -> list[str]:
    """The list with this Python's standard-library names and COMMON added. Names starting with
    `_` are left out: a project name starts with a letter or digit."""
    names = set(current) | set(COMMON) | set(sys.stdlib_module_names)
    return sorted(n for n in names if not n.startswith("_"))


def main() -> int:
    text = COPIER_YML.read_text(encoding="utf-8")
    names = wanted(reserved_names(text))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    line = f"  default: [{', '.join(names)}]  # reserved names: python -m scaffold.reserved_names"
    new = _LINE.sub(lambda m: line, text, count=1)
    if new != text:
        COPIER_YML.write_text(new, encoding="utf-8")
    print(f"{len(names)} reserved names in {COPIER_YML} (with Python {version}'s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
