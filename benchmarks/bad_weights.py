"""Bad weight files given to `train --init-from`: each loads exactly right or is refused in one line
with exit 2 before any step; none loads in part, silently (issue 42).

    python benchmarks/bad_weights.py

Renders a classification project with finetune on, trains it 8 steps and exports its best
checkpoint (a state_dict .pt and a .safetensors), then makes each file below from them and runs
`train --init-from FILE --max-steps 2` in a fresh process. A refusal must exit 2, print one line on
stderr, log no step and write no run.json. A load must exit 0, and the model `train` builds, with
the file put in by the project's init_weights, must hold exactly the file's tensors (a head
re-initialised: the fresh model's, said in one line). "no head declared" runs in a copy of the
project whose model.py declares HEAD = (). It prints one row a file: the outcome, the exit status
and the line the project printed (the error, or the weights lines); the last line says whether
every file behaved, and whether the pickle that would run code did.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaffold.render import new_project

PACKAGE = "weights_probe"
TINY = ["--max-train-examples", "256", "--batch-size", "32", "--eval-every", "4", "--log-every",
        "1", "--ckpt-every", "4", "--num-workers", "0", "--deterministic"]  # fmt: skip

# The model as `train` builds it, FILE put in by init_weights; its state_dict saved to OUT.
LOADED = f"""
import sys, torch
from {PACKAGE}.config import Config
from {PACKAGE}.data import load_splits
from {PACKAGE}.model import build_model
from {PACKAGE}.runtime.weights import init_weights
cfg = Config()
torch.manual_seed(cfg.seed)
model = build_model(cfg, load_splits(cfg))
init_weights(model, sys.argv[1], lambda line: None)
torch.save(model.state_dict(), sys.argv[2])
"""


class RunsCode:
    """A pickle whose loading would run a shell command (weights_only must refuse it)."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def sh(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=project, env=env, capture_output=True, text=True, timeout=600)


def train(project: Path, source: str, run_dir: str) -> subprocess.CompletedProcess[str]:
    args = ("train", "--run-dir", run_dir, "--init-from", source, "--max-steps", "2", *TINY)
    return sh(project, sys.executable, "-m", PACKAGE, *args)


def make_files(project: Path, files: Path) -> dict[str, tuple[Path | str, dict | None, str]]:
    """name: (SOURCE, the tensors a load must give or None for a refusal, the project to run in)."""
    best = project / "runs" / "source" / "checkpoints" / "best.pt"
    state = torch.load(project / "source.pt", weights_only=True)
    head = {k for k in state if k.startswith("head.")}
    body = {k: v for k, v in state.items() if k not in head}
    width = state["head.weight"].shape[1]
    other_head = {**state, "head.weight": torch.zeros(9, width), "head.bias": torch.zeros(9)}
    cases: dict[str, tuple[object, dict | None, str]] = {}

    def saved(name: str, payload: object, expect: dict | None, where: str = "project") -> None:
        path = files / name
        torch.save(payload, path)
        cases[name] = (path, expect, where)

    def raw(name: str, data: bytes) -> None:
        path = files / name
        path.write_bytes(data)
        cases[name] = (path, None, "project")

    # loads exactly right
    cases["the run's best.pt"] = (best, state, "project")
    cases["export's .pt"] = (project / "source.pt", state, "project")
    cases["export's .safetensors"] = (project / "source.safetensors", state, "project")
    saved("ddp_compiled.pt", {f"module._orig_mod.{k}": v for k, v in state.items()}, state)
    saved("other_head.pt", other_head, body)  # HEAD declared: re-initialised
    saved(
        "fp16.pt",
        {k: v.half() for k, v in state.items()},
        {k: v.half().float() for k, v in state.items()},
    )
    saved(
        "bf16.pt",
        {k: v.bfloat16() for k, v in state.items()},
        {k: v.bfloat16().float() for k, v in state.items()},
    )
    # refused
    first = next(iter(body))
    saved("missing_key.pt", {k: v for k, v in state.items() if k != first}, None)
    saved("missing_block.pt", {k: v for k, v in state.items() if not k.startswith("body.1.")}, None)
    saved("extra_key.pt", {**state, "extra.weight": torch.ones(3)}, None)
    saved("extra_keys.pt", {**state, **{f"aux.{k}": v for k, v in body.items()}}, None)
    saved("wrong_shape.pt", {**state, first: torch.zeros(3, 3)}, None)
    saved("transposed.pt", {**state, first: state[first].T.contiguous()}, None)
    saved("other_head_no_head.pt", other_head, None, "nohead")  # HEAD = (): nothing may differ
    saved("fp64.pt", {k: v.double() for k, v in state.items()}, None)
    saved("integers.pt", {k: v.long() for k, v in state.items()}, None)
    saved("nan.pt", {**state, first: state[first] * float("nan")}, None)
    saved("optimizer_only.pt", torch.load(best, weights_only=True)["optimizer"], None)
    saved("a_tensor.pt", state[first], None)
    saved("a_list.pt", list(state.values()), None)
    saved("not_only_tensors.pt", {**state, "epoch": 3}, None)
    saved("empty_dict.pt", {}, None)
    raw("runs_code.pt", pickle.dumps(RunsCode()))
    whole = (project / "source.pt").read_bytes()
    raw("truncated.pt", whole[: len(whole) // 2])
    raw("empty.pt", b"")
    raw("text.pt", b"these are not weights\n")
    tensors = (project / "source.safetensors").read_bytes()
    raw("truncated.safetensors", tensors[: len(tensors) // 2])
    raw("text.safetensors", b"these are not weights\n")
    damaged = bytearray(best.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    raw("damaged_checkpoint.pt", bytes(damaged))
    folder = files / "dcp_folder"
    dcp.save({"model": dict(state)}, checkpoint_id=folder, no_dist=True)
    cases["a DCP folder"] = (
        folder,
        None,
        "project",
    )  # torch.distributed.checkpoint's own, not a run's
    (files / "a_folder").mkdir()
    cases["a directory"] = (files / "a_folder", None, "project")
    cases["no such file"] = (files / "nothere.pt", None, "project")
    cases["a URL that does not exist"] = (
        f"file://{files}/no-run/checkpoints/best.pt",
        None,
        "project",
    )
    return cases


def outcome(
    projects: dict[str, Path], name: str, source, expect: dict | None, where: str, k: int
) -> tuple:
    project = projects[where]
    source = os.path.relpath(source, project) if isinstance(source, Path) else source  # short lines
    done = train(project, source, f"runs/case{k}")
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    stepped = any(line.startswith("step ") for line in done.stdout.splitlines())
    recorded = (project / "runs" / f"case{k}" / "run.json").exists()
    said = [line for line in done.stdout.splitlines() if line.startswith("weights:")]
    if expect is None:
        ok = done.returncode == 2 and len(errors) == 1 and not stepped and not recorded
        return (
            "refused" if ok else "WRONG",
            done.returncode,
            errors[-1] if errors else "(nothing on stderr)",
            ok,
        )
    out = Path(tempfile.mkdtemp()) / "loaded.pt"
    sh(project, sys.executable, "-c", LOADED, source, str(out))
    loaded = torch.load(out, weights_only=True) if out.exists() else {}
    exact = (
        all(torch.equal(loaded[k], v) for k, v in expect.items()) and loaded.keys() >= expect.keys()
    )
    ok = done.returncode == 0 and exact and stepped
    return ("loaded exactly" if ok else "WRONG", done.returncode, " | ".join(said[1:] or said), ok)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bad-weights-"))
    project = new_project(work / "weights-probe", {"finetune": True}).path
    done = sh(
        project,
        sys.executable,
        "-m",
        PACKAGE,
        "train",
        "--run-dir",
        "runs/source",
        "--max-steps",
        "8",
        *TINY,
    )
    assert done.returncode == 0, done.stderr
    best = "runs/source/checkpoints/best.pt"
    done = sh(
        project, sys.executable, "-m", PACKAGE, "export", "--checkpoint", best, "--out", "source.pt"
    )
    assert done.returncode == 0, done.stderr
    nohead = work / "nohead"
    shutil.copytree(project, nohead)
    model = nohead / "src" / PACKAGE / "model.py"
    model.write_text(model.read_text().replace('HEAD = ("head",)', "HEAD = ()"))
    files = work / "files"
    files.mkdir()
    cases = make_files(project, files)
    projects = {"project": project, "nohead": nohead}
    rows = []
    for k, (name, (source, expect, where)) in enumerate(cases.items()):
        rows.append((name, *outcome(projects, name, source, expect, where, k)))
        print(f"{name:26} {rows[-1][1]:15} {rows[-1][2]:>4}  {rows[-1][3]}", flush=True)
    ran_code = (project / "PWNED").exists() or (nohead / "PWNED").exists()
    good = sum(row[4] for row in rows)
    behaved = "loaded exactly, or refused in one line with exit 2 before any step"
    ran = "YES" if ran_code else "no"
    print(f"\n{good} of {len(rows)} files behaved ({behaved}); the pickle's code ran: {ran}")
    return 0 if good == len(rows) and not ran_code else 1


if __name__ == "__main__":
    sys.exit(main())
