"""Whatever the project name, scaffold writes inside DEST or nowhere."""

from __future__ import annotations

import keyword
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from scaffold import render
from scaffold.errors import UsageError
from scaffold.questions import package_name

# Letters plus everything that could escape a folder or a template: separators, dots, Jinja
# delimiters, quotes, backslashes, spaces, newlines.
NAMES = st.text(alphabet="aZ09-_./\\{}%#'\" \n~$", min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(name=NAMES)
def test_a_project_name_is_refused_or_stays_inside_dest(name):
    with tempfile.TemporaryDirectory() as parent:
        dest = Path(parent) / "dest"
        try:
            project = render.new_project(dest, {"project_name": name}, git=False)
        except UsageError:
            assert list(Path(parent).iterdir()) == []
            return

        assert [p.name for p in Path(parent).iterdir()] == ["dest"]
        assert project.answers["project_name"] == name
        package = package_name(name)
        assert package.isidentifier() and not keyword.iskeyword(package)
        assert (dest / "src" / package).is_dir()
