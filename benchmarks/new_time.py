"""How long `scaffold new --defaults` takes, beside the imports it cannot avoid.

    python benchmarks/new_time.py
    python benchmarks/new_time.py --repeats 15

Times, as real processes without a terminal, interleaved round by round so that a noisy machine
slows each alike: `python -c pass` (the interpreter), `python -c "import copier"` (the renderer
every render needs), `scaffold new DEST --defaults --no-git`, and `scaffold new DEST --defaults`
(git repository and first commit included), and that once more with SCAFFOLD_NO_CACHE=1 (every
Jinja template compiled afresh, as on the first run after an install or a template change).
Prints the median and the range of each. Runs the scaffold of the checkout this script is in
(PYTHONPATH set to it), whatever is installed.
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

REPO = Path(__file__).resolve().parent.parent


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> float:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="runs of each (default: 9)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    scaffold = [sys.executable, "-m", "scaffold", "new"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        'python -c "import copier"': [sys.executable, "-c", "import copier"],
        "scaffold new DEST --defaults --no-git": [*scaffold, "{dest}", "--defaults", "--no-git"],
        "scaffold new DEST --defaults": [*scaffold, "{dest}", "--defaults"],
        "  the same, templates compiled afresh": [*scaffold, "{dest}", "--defaults"],
    }
    uncached = {**env, "SCAFFOLD_NO_CACHE": "1"}
    times: dict[str, list[float]] = {label: [] for label in commands}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for n, (label, command) in enumerate(commands.items()):
                dest = Path(tmp) / f"demo{round_}x{n}"
                filled = [part.replace("{dest}", str(dest)) for part in command]
                own = uncached if "afresh" in label else env
                times[label].append(timed(filled, Path(tmp), own))
    print(f"{os.cpu_count()} CPUs; median (min-max) of {args.repeats} interleaved runs")
    width = max(map(len, times))
    for label, values in times.items():
        print(
            f"{label:<{width}}  {statistics.median(values):.3f} s "
            f"({min(values):.3f}-{max(values):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
