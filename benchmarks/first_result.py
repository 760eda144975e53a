"""Time to a first result: `scaffold new --defaults`, then the project's `check all`, per task.

    python benchmarks/first_result.py
    python benchmarks/first_result.py --repeats 5 --matrix

For every choice of copier.yml's `task` question (read at run time, so new tasks are included),
times `scaffold new DEST --defaults --task T` (a real process: the command a person types, git
repository and first commit included) and `python -m <pkg> check all` in the new project (what
`scaffold check` runs), --repeats times each, and prints the median with the range. With --matrix
it also times `scaffold matrix` once, when this scaffold has that command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaffold.check import check_command, check_device
from scaffold.questions import load_questions


def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    """Wall seconds of one command, which must succeed."""
    start = time.perf_counter()
    ran = subprocess.run(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if ran.returncode != 0:
        tail = (ran.stderr or ran.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"error: {' '.join(command)} exited {ran.returncode}:\n" + "\n".join(tail))
    return seconds


def scaffold_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaffold", *args]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (default: 3)")
    parser.add_argument("--matrix", action="store_true", help="also time `scaffold matrix` once")
    args = parser.parse_args(argv)
    tasks = load_questions()["task"].values

    print(f"{os.cpu_count()} CPUs; median (min-max) of {args.repeats} runs")
    print()
    print("| task | `scaffold new --defaults` | `check all` | together |")
    print("| --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            new_times, check_times = [], []
            for i in range(args.repeats):
                dest = Path(tmp) / f"first-{task}-{i}"
                new = scaffold_command("new", str(dest), "--defaults", "--task", task)
                new_times.append(timed(new, Path(tmp)))
                command = check_command(dest, device=check_device(dest, None, say=lambda _: None))
                env = dict(os.environ, PYTHONPATH=str(dest / "src"))
                check_times.append(timed(command, dest, env))
            together = [a + b for a, b in zip(new_times, check_times, strict=True)]
            print(
                f"| {task} | {spread(new_times)} | {spread(check_times)} | {spread(together)} |",
                flush=True,
            )

        if args.matrix:
            help_text = subprocess.run(
                scaffold_command("--help"), capture_output=True, text=True, check=False
            ).stdout
            if " matrix " not in help_text:
                print("\nscaffold matrix: not available in this scaffold")
            else:
                seconds = timed(scaffold_command("matrix"), Path(tmp))
                print(f"\nscaffold matrix (every valid combination): {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
