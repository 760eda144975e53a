"""`train --init-from SOURCE` in finetune renders (issue 42): a checkpoint, a state_dict .pt or a
.safetensors file loads every parameter and buffer exactly, or the run is refused in one line with
exit 2 before any step; the head model.HEAD declares is re-initialised where it does not fit, said
and recorded; a resume never reads the source again; export writes a .safetensors beside its .pt."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from test_ddp import SMALL, _env_ddp, _torchrun
from test_project import _env, records, run

from scaffold.render import new_project

TINY = (
    "--max-train-examples",
    "256",
    "--batch-size",
    "32",
    "--eval-every",
    "4",
    "--log-every",
    "1",
    "--ckpt-every",
    "4",
    "--num-workers",
    "0",
    "--deterministic",
)

# The model as `train` builds it, SOURCE put in with init_weights; its tensors saved to OUT.
LOADED = """
import sys, torch
from {package}.config import Config
from {package}.data import load_splits
from {package}.model import build_model
from {package}.runtime.weights import init_weights
cfg = Config()
torch.manual_seed(cfg.seed)
model = build_model(cfg, load_splits(cfg))
init_weights(model, sys.argv[1], print)
torch.save(model.state_dict(), sys.argv[2])
"""


def render(dest: Path, **answers) -> Path:
    return new_project(dest, {"finetune": True, **answers}).path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("ft") / "ft-demo")


@pytest.fixture(scope="module")
def source(project) -> Path:
    """A finished 8-step run: its best.pt, and its export (.pt and .safetensors)."""
    done = run(project, "train", "--run-dir", "runs/source", "--max-steps", "8", *TINY)
    assert done.returncode == 0, done.stderr
    exported = run(
        project, "export", "--checkpoint", "runs/source/checkpoints/best.pt", "--out", "source.pt"
    )
    assert exported.returncode == 0, exported.stderr
    return project / "runs" / "source" / "checkpoints" / "best.pt"


def loaded(project: Path, path: Path) -> tuple[dict, str]:
    """The model's state_dict after init_weights(SOURCE=path), and what it printed."""
    out = project / "loaded.pt"
    code = LOADED.format(package="ft_demo")
    command = [sys.executable, "-c", code, str(path), str(out)]
    done = warm_python.run(command, cwd=project, env=_env(project), timeout=600)
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True), done.stdout


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["checkpoint", "state_dict", "safetensors"])
def test_each_kind_of_source_loads_every_tensor_exactly(project, source, name):
    path = {"checkpoint": source, "state_dict": project / "source.pt",
            "safetensors": project / "source.safetensors"}[name]  # fmt: skip
    expected = torch.load(source, weights_only=True)["model"]
    state, said = loaded(project, path)
    assert same(state, expected)
    assert f"weights: {len(expected)} tensors from {path}" in said


def test_the_wrappers_prefixes_are_dropped(project, source):
    """DDP's `module.` and torch.compile's `_orig_mod.` (of the model or of a block)."""
    expected = torch.load(source, weights_only=True)["model"]
    wrapped = {
        f"module._orig_mod.{k}".replace("body.0.", "body.0._orig_mod."): v
        for k, v in expected.items()
    }
    torch.save(wrapped, project / "wrapped.pt")
    state, _ = loaded(project, project / "wrapped.pt")
    assert same(state, expected)


def test_another_head_is_re_initialised_said_and_recorded(project, source):
    """the head keeps the fresh model's values, the rest is the source's."""
    expected = torch.load(source, weights_only=True)["model"]
    other = {
        **expected,
        "head.weight": torch.zeros(7, expected["head.weight"].shape[1]),
        "head.bias": torch.zeros(7),
    }
    torch.save(other, project / "other_head.pt")
    state, said = loaded(project, project / "other_head.pt")
    assert all(torch.equal(state[k], expected[k]) for k in expected if not k.startswith("head."))
    assert state["head.weight"].shape == expected["head.weight"].shape
    assert state["head.weight"].abs().sum() > 0  # the fresh initialisation, not the zeros
    assert "re-initialised, not loaded (model.HEAD): head.weight (7x" in said
    done = run(
        project,
        "train",
        "--run-dir",
        "runs/other",
        "--init-from",
        "other_head.pt",
        "--max-steps",
        "4",
        *TINY,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((project / "runs" / "other" / "run.json").read_text())["init_from"]
    digest = hashlib.sha256((project / "other_head.pt").read_bytes()).hexdigest()
    assert record == {
        "source": "other_head.pt",
        "sha256": digest,
        "reinitialised": ["head.weight", "head.bias"],
    }
    shown = run(project, "report", "runs/other")
    assert shown.returncode == 0, shown.stderr
    kept = "re-initialised (model.HEAD): head.weight, head.bias"
    assert f"**Weights:** other_head.pt (sha256 {digest[:12]}); {kept}" in shown.stdout.splitlines()


@pytest.mark.parametrize(
    "edit, said",
    [
        (
            lambda s: {k: v for k, v in s.items() if k != "body.0.0.weight"},
            "1 missing (body.0.0.weight)",
        ),
        (lambda s: {**s, "extra.weight": torch.ones(2)}, "1 unexpected (extra.weight)"),
        (
            lambda s: {**s, "body.0.0.bias": torch.ones(3)},
            "1 of another shape (body.0.0.bias: 3, here 256); only model.HEAD (head) may differ",
        ),
        (lambda s: {k: v.double() for k, v in s.items()}, "tensors of other dtypes"),
        (
            lambda s: {**s, "body.0.0.bias": s["body.0.0.bias"] * float("nan")},
            "NaN or inf in 1 tensors",
        ),
        (
            lambda s: {"state": {}, "param_groups": []},
            "2 of its entries are not tensors (state, param_groups; an optimizer's state_dict)",
        ),
    ],
    ids=["missing", "unexpected", "shape", "float64", "nan", "optimizer"],
)
def test_a_misfit_is_refused_in_one_line_before_any_step(project, source, edit, said):
    torch.save(edit(torch.load(source, weights_only=True)["model"]), project / "bad.pt")
    done = run(
        project,
        "train",
        "--run-dir",
        "runs/bad",
        "--init-from",
        "bad.pt",
        "--max-steps",
        "4",
        *TINY,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: --init-from bad.pt")
    assert "step 1/" not in done.stdout and not (project / "runs" / "bad" / "run.json").exists()


def test_fp16_weights_are_widened_exactly(project, source):
    expected = torch.load(source, weights_only=True)["model"]
    torch.save({k: v.half() for k, v in expected.items()}, project / "half.pt")
    state, said = loaded(project, project / "half.pt")
    assert same(state, {k: v.half().float() for k, v in expected.items()})
    assert f"weights: {len(expected)} tensors of a narrower float dtype widened" in said


def test_a_resume_takes_its_checkpoint_and_never_reads_the_source_again(project, source):
    """Stopped at step 4 (a checkpoint), its source then damaged: the resume ends as an
    uninterrupted run does, record for record."""
    (project / "init.pt").write_bytes((project / "source.pt").read_bytes())
    args = ("train", "--init-from", "init.pt", *TINY)
    assert run(project, *args, "--run-dir", "runs/whole", "--max-steps", "8").returncode == 0
    assert run(project, *args, "--run-dir", "runs/cut", "--max-steps", "4").returncode == 0
    (project / "init.pt").write_bytes(b"not weights any more")
    done = run(project, *args, "--run-dir", "runs/cut", "--max-steps", "8")
    assert done.returncode == 0, done.stderr
    assert "weights:" not in done.stdout and "resuming from" in done.stdout

    def losses(name):
        lines = (project / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["split"], r["loss"]) for r in map(json.loads, lines)]

    assert losses("cut") == losses("whole")


def _train(project: Path, run_dir: str, batch: int, nproc: int, *extra: str):
    """2 steps of `batch` examples a rank, each logged; torchrun's processes where nproc > 1."""
    args = (
        "train",
        "--run-dir",
        run_dir,
        "--max-steps",
        "2",
        "--batch-size",
        str(batch),
        *SMALL,
        *extra,
    )
    if nproc == 1:
        done = run(project, *args)
    else:
        command = _torchrun(project, *args, nproc=nproc, extra=("--nnodes", "1"))
        done = warm_python.run(command, cwd=project, env=_env_ddp(project), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_under_torchrun_every_rank_starts_from_the_weights(tmp_path, distributed):
    """Rank 0 alone reads the file (another head: re-initialised); 2 processes x 16 then log the
    losses 1 process x 32 does from the same file, so every rank holds the same loaded weights
    (the dropout is off: the global batch alone decides the step)."""
    project = render(tmp_path / "p", distributed=distributed)
    _train(project, "runs/source", 32, 1)
    checkpoint = "runs/source/checkpoints/" + ("best" if distributed == "fsdp" else "best.pt")
    assert run(project, "export", "--checkpoint", checkpoint, "--out", "source.pt").returncode == 0
    state = torch.load(project / "source.pt", weights_only=True)
    width = state["head.weight"].shape[1]
    torch.save(
        {**state, "head.weight": torch.ones(7, width), "head.bias": torch.ones(7)},
        project / "other.pt",
    )
    one = _train(project, "runs/one", 32, 1, "--init-from", "other.pt")
    two = _train(project, "runs/two", 16, 2, "--init-from", "other.pt")
    assert two.stdout.count("weights: re-initialised, not loaded (model.HEAD): head.weight") == 1
    losses = [
        [r["loss"] for r in records(project / "runs" / name) if r["split"] == "train"]
        for name in ("one", "two")
    ]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), losses
    fresh = _train(project, "runs/fresh", 32, 1)
    assert fresh.stdout != one.stdout
    recorded = [
        json.loads((project / "runs" / name / "run.json").read_text())["init_from"]
        for name in ("one", "two")
    ]
    assert recorded[0] == recorded[1] and recorded[0]["reinitialised"] == [
        "head.weight",
        "head.bias",
    ]
    # a sharded checkpoint folder as the source, read whole by rank 0
    if distributed == "fsdp":
        two = _train(project, "runs/from-folder", 16, 2, "--init-from", checkpoint)
        assert f"weights: {len(state)} tensors from {checkpoint}" in two.stdout


def test_check_init_compares_the_loaded_weights_with_a_fresh_model(project, source):
    """Trained weights start below a fresh model's validation loss; weights that make it worse (the
    head turned against the labels) are the finding "did not load as intended", exit 1."""
    done = run(project, "check", "init", "--init-from", "source.safetensors", *TINY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "init: PASS: validation loss with --init-from" in done.stdout
    state = torch.load(project / "source.pt", weights_only=True)
    torch.save({**state, "head.weight": state["head.weight"] * -20}, project / "against.pt")
    done = run(project, "check", "init", "--init-from", "against.pt", *TINY)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not below: the weights did not load as intended" in done.stdout


def test_export_writes_tied_weights_to_safetensors(project):
    """Safetensors refuses tensors that share memory (a language model's embedding and output
    layer, views of a fused tensor): export's writer gives each its own copy, equal in value."""
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from safetensors.torch import load_file\n"
        "from ft_demo.runtime.checkpoint import save_safetensors\n"
        "wte = torch.randn(5, 3)\n"
        "save_safetensors({'wte.weight': wte, 'lm_head.weight': wte}, Path('tied.safetensors'))\n"
        "back = load_file('tied.safetensors')\n"
        "assert torch.equal(back['wte.weight'], wte) and torch.equal(back['lm_head.weight'], wte)\n"
        "qkv = torch.randn(6, 3)\n"  # views of one fused tensor share its memory too
        "save_safetensors({'q': qkv[:3], 'k': qkv[3:]}, Path('fused.safetensors'))\n"
        "back = load_file('fused.safetensors')\n"
        "assert torch.equal(back['q'], qkv[:3]) and torch.equal(back['k'], qkv[3:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=_env(project), capture_output=True
    )
    assert done.returncode == 0, done.stderr


def test_a_checkpoint_on_a_store_is_fetched_and_loaded(project, source, tmp_path):
    """RUN_URL/checkpoints/best.pt, as `export` and `sample` take it (a file:// store here)."""
    url = f"file://{tmp_path}/store/run"
    assert run(project, "train", "--run-dir", url, "--max-steps", "4", *TINY).returncode == 0
    best = f"{url}/checkpoints/best.pt"
    done = run(
        project, "train", "--run-dir", "runs/url", "--init-from", best, "--max-steps", "4", *TINY
    )
    assert done.returncode == 0, done.stderr
    assert f"weights: 10 tensors from {best}" in done.stdout
    gone = f"{url}x/checkpoints/best.pt"
    missing = run(
        project, "train", "--run-dir", "runs/no", "--init-from", gone, "--max-steps", "4", *TINY
    )
    assert missing.returncode == 2 and "no complete checkpoint in" in missing.stderr, missing.stderr
