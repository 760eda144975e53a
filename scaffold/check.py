"""Run a generated project's own checks (`python -m <pkg> check all`) from the scaffolder."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from scaffold.errors import UsageError
from scaffold.machine import device_available
from scaffold.questions import answers_file, package_name, project_answers


def project_package(project: Path) -> str:
    """The import name of the project in `project`: from its answers, else its only package."""
    name = project_answers(project).get("project_name")
    if name:
        return package_name(str(name))
    packages = sorted(p.parent.name for p in (project / "src").glob("*/__main__.py"))
    if len(packages) != 1:
        raise UsageError(
            f"{project} is not a scaffold project: no {answers_file()}, and "
            f"{len(packages)} packages under src/ instead of one"
        )
    return packages[0]


def check_command(
    project: Path,
    *,
    which: str = "all",
    device: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[str]:
    """The command line that runs the checks of `project` with this Python: `python -m <pkg>
    check all` (or the check `which`), with `--device` when given and each of `options` (config
    fields such as batch_size) as the project's own `--batch-size VALUE` (a flag alone, such as
    `--no-compile`, for the value None)."""
    command = [sys.executable, "-m", project_package(project), "check", which]
    if device:
        command += ["--device", device]
    for name, value in (options or {}).items():
        command += ["--" + name.replace("_", "-")] + ([] if value is None else [str(value)])
    return command


def check_device(project: Path, device: str | None, say: Callable[[str], None]) -> str | None:
    """The --device to pass: `device` if given, else cpu when this machine lacks the project's."""
    if device:
        return device
    wanted = project_answers(project).get("device")
    if wanted and not device_available(str(wanted)):
        say(f"this machine has no {wanted}: running the checks with --device cpu")
        return "cpu"
    return None


def run_checks(
    project: Path | str, device: str | None = None, *, say: Callable[[str], None] = print
) -> int:
    """Run `python -m <pkg> check all` in `project`, output streaming; return its exit status."""
    project = Path(os.path.abspath(project))
    if not project.is_dir():
        raise UsageError(f"{project} is not a folder")
    command = check_command(project, device=check_device(project, device, say))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(project / "src"), env.get("PYTHONPATH")) if p
    )
    return subprocess.run(command, cwd=project, env=env, check=False).returncode
