"""The generated loop reads nothing back from the device on a plain optimizer step.

Every `.item()`, `.tolist()`, `.cpu()`, printed tensor or `if tensor:` makes the host wait for the
accelerator. TRAINING-RULES.md allows them only when logging (and evaluating, checkpointing). These
tests run each default project's real `train()` in this process under a TorchFunctionMode that
records every call that would sync, tag each with the optimizer step it happened in (by wrapping
the project's `train_step`), and assert that steps which neither log, evaluate nor checkpoint
record none. On the CPU nothing actually waits, so the calls are what is counted; on a GPU,
`torch.cuda.set_sync_debug_mode` counts the real syncs.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from scaffold.questions import load_questions
from scaffold.render import new_project

# Tensor methods and torch functions that hand a value to Python, so the host waits for the device.
SYNCING = {
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__array__",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "__repr__",
    "__str__",
    "equal",
    "allclose",
    "is_nonzero",
    "nonzero",  # the output's size depends on the values
    "masked_select",
    "unique",
}

# Steps 4, 6, 8 and 12 log, checkpoint or evaluate; steps 1-3, 5, 7 and 9-11 must not sync.
MAX_STEPS = 12
LOG_EVERY, EVAL_EVERY, CKPT_EVERY = 4, 12, 6  # one evaluation: the slowest part
BATCH_SIZE = 8  # small: the recorder intercepts every torch call


def _busy(step: int) -> bool:
    """Whether the loop may read values back at this step: it logs, evaluates or checkpoints."""
    return step == MAX_STEPS or any(step % n == 0 for n in (LOG_EVERY, EVAL_EVERY, CKPT_EVERY))


def _to_host_blocking(args, kwargs) -> bool:
    """Tensor.to(...) that copies to the host and waits (a non_blocking copy does not wait)."""
    if kwargs.get("non_blocking") or any(a is True for a in args[2:]):
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )


def _syncs(name: str, args, kwargs) -> bool:
    if name in SYNCING:
        return True
    if name == "__getitem__":  # a boolean mask: the result's size depends on the values
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return name in ("to", "copy_") and _to_host_blocking(args, kwargs)


def _host_side(frame, name: str) -> bool:
    """Calls that never touch a device tensor, though on the CPU they look as if they might.

    The DataLoader (with its sampler and dataset) works on host tensors, in worker processes when
    --num-workers > 0, and so does the project's runtime/loader.py, which reads the batches itself
    in place of the DataLoader when there are no workers; and torch's own `.to(device)` calls
    (gradient clipping gathers the per-parameter norms with them) stay on the device they were
    given.
    """
    caller = frame.f_globals.get("__name__", "")
    if name in ("to", "copy_") and caller.startswith("torch."):
        return True
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("torch.utils.data") or module.endswith(".runtime.loader"):
            return True
        frame = frame.f_back
    return False


class SyncRecorder(TorchFunctionMode):
    """Records (step, call) for every call that would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0  # optimizer steps begun; 0 is the set-up before the first
        self.syncs: list[tuple[int, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _syncs(name, args, kwargs) and not _host_side(sys._getframe(1), name):
            self.syncs.append((self.step, name))
        return func(*args, **kwargs)

    def plain_step_syncs(self) -> list[tuple[int, str]]:
        return [(step, name) for step, name in self.syncs if step > 0 and not _busy(step)]


@contextmanager
def rendered_package(dest: Path, answers: dict):
    """Renders a project and imports its package; forgets the package's modules afterwards."""
    project = new_project(dest, answers, git=False).path
    package = next((project / "src").glob("*/__main__.py")).parent.name
    sys.path.insert(0, str(project / "src"))
    try:
        yield (
            importlib.import_module(f"{package}.train"),
            importlib.import_module(f"{package}.config"),
        )
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


def _counting_steps(train_module, on_step):
    """Wraps the project's train_step so that `on_step` runs as each optimizer step begins."""
    original = train_module.train_step

    def train_step(*args, **kwargs):
        on_step()
        return original(*args, **kwargs)

    return original, train_step


def _run(train_module, config_module, run_dir: Path, device: str = "cpu") -> None:
    cfg = config_module.Config(
        max_steps=MAX_STEPS,
        log_every=LOG_EVERY,
        eval_every=EVAL_EVERY,
        ckpt_every=CKPT_EVERY,
        run_dir=str(run_dir),
        batch_size=BATCH_SIZE,
        device=device,
        num_workers=0,  # the loader runs in this process, under the recorder
    )
    train_module.train(cfg, quiet=True)


VARIANTS = [{"task": task} for task in load_questions()["task"].values] + [
    {"grad_accum_steps": 4},
    {"device": "cuda", "precision": "bf16"},  # run on the CPU: the rendered code is what counts
    {"device": "cuda", "precision": "fp16"},  # the GradScaler, and its count of skipped steps
]


@pytest.mark.parametrize("answers", VARIANTS, ids=lambda a: "-".join(map(str, a.values())))
def test_no_host_sync_outside_logging_evaluation_and_checkpoint_steps(tmp_path, answers):
    answers = {"device": "cpu", "precision": "fp32", "compile": False, **answers}
    recorder = SyncRecorder()

    def next_step() -> None:
        recorder.step += 1

    with rendered_package(tmp_path / "syncprobe", answers) as (train_module, config_module):
        original, train_module.train_step = _counting_steps(train_module, next_step)
        try:
            with recorder:
                _run(train_module, config_module, tmp_path / "run")
        finally:
            train_module.train_step = original

    assert recorder.step == MAX_STEPS
    # The recorder sees the loop's reads where they belong: the loss on each logging step.
    logged = {step for step, name in recorder.syncs if name == "item"}
    assert {LOG_EVERY, 2 * LOG_EVERY, MAX_STEPS} <= logged, recorder.syncs
    plain = recorder.plain_step_syncs()
    per_step = len(plain) / sum(not _busy(s) for s in range(1, MAX_STEPS + 1))
    assert not plain, f"{per_step:.2f} host syncs per plain optimizer step: {plain}"


def test_the_recorder_catches_a_loss_read_on_every_step():
    recorder = SyncRecorder()
    loss = torch.ones(())
    with recorder:
        for _ in range(3):
            recorder.step += 1
            loss.item()
            f"{loss:.3f}"
            loss.to("cpu")
            loss.to("cpu", non_blocking=True)  # an asynchronous copy does not wait
            if loss > 0:
                pass
            torch.arange(3)[torch.arange(3) > 0]
    assert [name for step, name in recorder.plain_step_syncs() if step == 1] == [
        "item",
        "__format__",
        "to",
        "__bool__",
        "__getitem__",
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_cuda_sync_outside_logging_evaluation_and_checkpoint_steps(tmp_path):
    """The same on a GPU, counted by CUDA itself: set_sync_debug_mode warns at each sync."""
    step = 0
    syncs: list[tuple[int, str]] = []

    def next_step() -> None:
        nonlocal step
        step += 1

    def record(message, *args, **kwargs) -> None:
        if "synchroniz" in str(message):
            syncs.append((step, str(message)))

    answers = {"device": "cuda", "compile": False}
    with rendered_package(tmp_path / "cudasyncprobe", answers) as (train_module, config_module):
        original, train_module.train_step = _counting_steps(train_module, next_step)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _run(train_module, config_module, tmp_path / "run", device="cuda")
            finally:
                torch.cuda.set_sync_debug_mode("default")
                train_module.train_step = original

    assert step == MAX_STEPS
    assert {s for s, _ in syncs} & {LOG_EVERY, MAX_STEPS}, "no sync seen even on logging steps"
    plain = [(s, message) for s, message in syncs if s > 0 and not _busy(s)]
    assert not plain, plain
