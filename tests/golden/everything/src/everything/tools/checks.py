"""Tool: the built-in checks that prove the training code, and your edits to it, before a long run.

    python -m everything check all      # every check, then the summary
    python -m everything check overfit  # memorises one batch of 8
    python -m everything check batch    # examples do not mix, nor read padding
    python -m everything check init     # the loss at init is as expected
    python -m everything check loader   # loading keeps up with training
    python -m everything check resume   # the same losses, bit for bit

Exit status 0 only if every check run passes. Each check takes the same options as `train`
(--data, --device, ...), draws its batches through the training loader, and writes its runs
under runs/check/ (beside --run-dir), one check at a time: a second `check all` or `check resume`
there is refused while one runs. `check all` records in runs/check/summary.json what it checked,
taken as it starts: the commit (and whether the tree had uncommitted changes), a digest of the
source, the data and the config. `report` shows a run's Sanity line only when they are the run's.
"""

import itertools
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..data import DataError
from ..data_shards import load_splits
from ..model import compute_loss, initial_loss, overfit_target
from ..runtime.distributed import all_reduce_sum, any_rank_max, init_distributed, run_as_processes
from ..runtime.engine import Engine, setup
from ..runtime.loader import EpochDataset
from ..runtime.progress import announced
from ..runtime.records import commit_label
from ..runtime.runlog import PROJECT, git_state, make_folders, now_utc, source_digest, write_json_atomically
from ..runtime.stopping import RunFolderBusy, RunLock
from ..runtime.store import staging_dir
from ..runtime.weights import init_weights
from ..train import train_step
from .resume_check import resume_matches
from .timing import LOADER_WARN_SHARE, time_loader

OVERFIT_EXAMPLES = 8
OVERFIT_MAX_STEPS = 300
OVERFIT_WARMUP = 10  # steps, then --lr held: the check's own schedule, whatever --max-steps says
BATCH_CHECK_EXAMPLES = 4  # examples whose outputs are tested for dependence on each other
PADDING_CHECK_EXAMPLES = 64  # where examples are padded: the shortest and longest of these
INIT_LOSS_FACTOR = 1.5  # the loss at init may differ from initial_loss() by this factor either way
INIT_BATCHES = 4  # training batches averaged for the loss at initialisation
CHECKS = ("overfit", "batch", "init", "loader", "resume")  # in the order `check all` runs them
DOING = {  # what each check is doing, said on stderr as it starts: a long one is not a hung one
    "overfit": f"memorising one batch of {OVERFIT_EXAMPLES} (at most {OVERFIT_MAX_STEPS} steps)",
    "batch": "each example's gradient over a batch",
    "init": f"the loss of {INIT_BATCHES} batches before any training",
    "loader": "the loader alone, then training steps with it",
    "resume": "a run, a copy resumed from its checkpoint, and their losses compared",
}


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str  # one line: what was measured
    value: float = math.nan  # the headline figure for the summary
    samples_per_s: float = math.nan
    gpu_util: str = "n/a"  # the GPU's mean utilisation over the loader check's window, where it is read

    def line(self) -> str:
        return f"{self.name}: {'PASS' if self.passed else 'FAIL'}: {self.detail}"


def first_batches(splits, device: torch.device, size: int, count: int = 1) -> list:
    """The first `count` batches of `size` training examples, in order, read as the loader reads them."""
    dataset = EpochDataset(splits.train)
    count = min(count, len(dataset) // size)
    batches = [dataset.__getitems__((0, torch.arange(i * size, (i + 1) * size))) for i in range(count)]
    return [tuple(t.to(device) for t in batch) for batch in batches]


def check_overfit(cfg: Config) -> CheckResult:
    """A model that cannot memorise 8 examples has a bug: its loss must fall to model.overfit_target."""
    device, group = setup(cfg)
    splits = load_splits(cfg)
    cfg = replace(cfg, warmup_steps=min(cfg.warmup_steps, OVERFIT_WARMUP), min_lr=cfg.lr)  # no decay
    engine = Engine(cfg, splits, device)
    [(x, y)] = first_batches(splits, device, OVERFIT_EXAMPLES)

    compute_loss(engine.model(x), y).backward()
    params = engine.model.named_parameters()
    no_grad = [n for n, p in params if p.requires_grad and (p.grad is None or not p.grad.isfinite().all())]
    engine.optimizer.zero_grad(set_to_none=True)
    if no_grad:
        return CheckResult("overfit", False, f"no finite gradient reaches {', '.join(no_grad)}")

    first = target = None
    steps = range(1, OVERFIT_MAX_STEPS + 1)
    for step in announced(steps, "check overfit", "step") if group.is_main else steps:
        train_step(engine, itertools.repeat((x, y)), cfg, device)
        with torch.no_grad():  # memorised means so without dropout, as the model predicts
            loss = compute_loss(engine.model.eval()(x), y)
        engine.model.train()
        loss = (all_reduce_sum(loss) / group.world_size).item()  # stop together
        if not math.isfinite(loss):
            return CheckResult("overfit", False, f"loss became {loss} at step {step}: lower --lr", loss)
        if first is None:
            first, target = loss, overfit_target(loss)
        if loss <= target:
            break
    detail = f"loss {first:.4f} -> {loss:.4g} in {step} steps (target <= {target:.4g})"
    if loss > target:
        detail += "; a loss whose minimum is above 0 (label smoothing, say) needs it in overfit_target"
    return CheckResult("overfit", loss <= target, detail, loss)


def check_batch_independence(cfg: Config) -> CheckResult:
    """Example i's loss must not depend on example j's input: a reshape or a reduction over the wrong
    dimension mixes examples, and still trains. In eval mode: BatchNorm's batch statistics mix by design."""
    device, _ = setup(cfg)
    splits = load_splits(cfg)
    model = Engine(cfg, splits, device).model.eval()
    batches = first_batches(splits, device, BATCH_CHECK_EXAMPLES, count=2)
    x, y = batches[0]
    n = len(x)
    method, leaks = "gradient of each example's loss", []
    for i in (0, n - 1):
        inputs = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(compute_loss(model(inputs)[i : i + 1], y[i : i + 1]), inputs)
        leaks += [(i, j) for j in range(n) if j != i and grad[j].abs().max() > 0]
    detail = f"{method} over a batch of {n}, model in eval mode (BatchNorm's batch statistics not counted): "
    if leaks:
        i, j = leaks[0]
        detail += f"example {i}'s loss depends on example {j}'s input: something mixes the batch dimension"
        return CheckResult("batch", False, detail)
    detail += "no example depends on another"
    if cfg.activation_checkpointing:
        if drift := recomputation_drift(cfg, splits, device, x, y):
            return CheckResult("batch", False, f"{detail}; but {drift}")
        detail += "; recomputed blocks give the gradients of kept ones"
    padding = padding_leak(model, splits.train, device) if hasattr(splits.train, "collate") else None
    if padding:
        return CheckResult("batch", False, f"{detail}; but {padding}")
    return CheckResult("batch", True, detail + ("; nor on its padding" if padding == "" else ""))


def recomputation_drift(cfg: Config, splits, device: torch.device, x, y) -> str | None:
    """With --activation-checkpointing: a training forward and backward with the blocks recomputed,
    and one keeping them, from the same weights and random state; a block whose recomputation differs
    trains on wrong gradients: named here, not left to drift."""
    results = []
    for every in (0, cfg.activation_checkpointing):
        torch.manual_seed(cfg.seed)  # the same weights (one process builds them from the global RNG)
        engine = Engine(replace(cfg, activation_checkpointing=every), splits, device)
        torch.manual_seed(cfg.seed)  # and the same dropout masks
        random.seed(cfg.seed)
        compute_loss(engine.forward(x), y).backward()
        params = engine.model.named_parameters()
        named = [(f"{name}'s gradient", p.grad) for name, p in params if p.grad is not None]
        named += [(f"buffer {name}", buffer) for name, buffer in engine.model.named_buffers()]
        results.append({name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in named})
    for name, kept in results[0].items():
        kept, recomputed = kept.float(), results[1][name].float()
        if (recomputed - kept).abs().max() > 1e-4 * (1 + kept.abs().max()):
            return (
                f"{name} differs with --activation-checkpointing {cfg.activation_checkpointing}: a block in"
                " model.repeated_blocks gives another result when its forward runs again (random numbers"
                " drawn outside torch, or state changed in its forward)"
            )
    return None


def padding_leak(model: torch.nn.Module, dataset, device: torch.device) -> str | None:
    """Where the dataset pads examples of different lengths (`collate`), the shortest of the first
    PADDING_CHECK_EXAMPLES alone and beside the longest, so padded further: the same loss, or what
    differs. Empty when they match; None when every example pads to the same length."""
    samples = [dataset[i] for i in range(min(len(dataset), PADDING_CHECK_EXAMPLES))]
    short = min(samples, key=lambda sample: len(sample[0]))
    long = max(samples, key=lambda sample: len(sample[0]))
    alone = tuple(t.to(device) for t in dataset.collate([short]))
    beside = tuple(t.to(device) for t in dataset.collate([short, long]))
    if alone[0].shape == beside[0].shape:
        return None
    with torch.no_grad():
        losses = [compute_loss(model(x)[:1], y[:1]).item() for x, y in (alone, beside)]
    if abs(losses[0] - losses[1]) <= 1e-5 * (1 + abs(losses[0])):
        return ""
    return (
        f"an example's loss is {losses[0]:.6g} padded to length {alone[0].shape[1]} and {losses[1]:.6g}"
        f" padded to {beside[0].shape[1]}: the model reads the padding (mask it, or keep it causal)"
    )


def check_initial_loss(cfg: Config) -> CheckResult:
    """Before training the loss has a known value (model.initial_loss): ln C for C classes, say.
    A wrong output layer, a missing log-softmax or targets on the wrong scale show here first."""
    device, _ = setup(cfg)
    splits = load_splits(cfg)
    model = Engine(cfg, splits, device).model.eval()
    with torch.no_grad():
        batches = first_batches(splits, device, cfg.batch_size, INIT_BATCHES)
        losses = [compute_loss(model(x), y).item() for x, y in batches]
    got, expected = sum(losses) / len(losses), initial_loss(splits)
    passed = expected / INIT_LOSS_FACTOR <= got <= expected * INIT_LOSS_FACTOR
    detail = f"loss at initialisation {got:.4g}, expected about {expected:.4g} (model.initial_loss)"
    if not passed:
        detail += f": over {INIT_LOSS_FACTOR}x off; check the output layer, the loss and the targets"
    if cfg.init_from:
        return check_loaded_weights(cfg, model, splits, device)
    return CheckResult("init", passed, detail, got)


def check_loaded_weights(cfg: Config, model: torch.nn.Module, splits, device: torch.device) -> CheckResult:
    """With --init-from, the validation loss of the weights loaded must start below a fresh model's:
    one that does not is a fine-tune whose weights did not load as intended (another layout read
    by a wrong model.from_published, weights of another task or data)."""
    dataset = EpochDataset(splits.val)
    size = min(cfg.batch_size, len(dataset))
    count = max(1, min(INIT_BATCHES, len(dataset) // size))
    batches = [dataset.__getitems__((0, torch.arange(i * size, (i + 1) * size))) for i in range(count)]
    batches = [tuple(t.to(device) for t in batch) for batch in batches]

    @torch.no_grad()
    def val_loss() -> float:
        return sum(compute_loss(model(x), y).item() for x, y in batches) / len(batches)

    fresh = val_loss()
    kept = init_weights(model, cfg.init_from, lambda line: None)["reinitialised"]
    loaded = val_loss()
    detail = f"validation loss with --init-from {loaded:.4g}, a fresh model's {fresh:.4g}"
    if kept:  # a new head maps the loaded features at random: its loss says nothing of the load
        return CheckResult("init", True, f"{detail} (not compared: the head is re-initialised)", loaded)
    passed = loaded < fresh
    if not passed:
        detail += ": not below: the weights did not load as intended (check model.from_published, the data)"
    return CheckResult("init", passed, detail, loaded)


def check_loader(cfg: Config) -> CheckResult:
    """Data loading must not be the bottleneck: the loader alone must keep up with a step."""
    timing = time_loader(cfg)
    passed = timing.load_per_step <= timing.step
    detail = (
        f"loader alone {timing.samples_per_s_alone:,.0f} samples/s "
        f"({timing.load_per_step * 1e3:.2f} ms a step), training step {timing.step * 1e3:.2f} ms; "
        f"with real loading {timing.samples_per_s:,.0f} samples/s, "
        f"{timing.wait_share:.1%} of the time waiting for data (num_workers={cfg.num_workers})"
    )
    if timing.by_workers:
        rates = ", ".join(f"{n}: {rate:,.0f}" for n, rate in timing.by_workers.items())
        fastest = max(timing.by_workers, key=timing.by_workers.get)
        detail += f"; loader alone by --num-workers, samples/s: {rates} (fastest {fastest})"
    if not passed and timing.fetch_share > 0.5:
        detail += (
            f": the data store is the bottleneck: shards were being fetched {timing.fetch_share:.0%} of the"
            " loader's time; train nearer the store, or from a local shard folder (prepare --out DIR)"
        )
    elif not passed:
        detail += ": loading is the bottleneck; raise --num-workers or move work out of the main process"
    elif timing.wait_share > LOADER_WARN_SHARE:
        detail += f": warning, over {LOADER_WARN_SHARE:.0%}; try more --num-workers"
    return CheckResult("loader", passed, detail, timing.wait_share, timing.samples_per_s, timing.gpu_util)


def run_checks(cfg: Config, which: str) -> int:
    """Runs the checks, as several processes where the project has them: resume then covers per-rank state."""
    return run_as_processes(2, lambda: _run(cfg, which))


def _run(cfg: Config, which: str) -> int:
    """Every rank runs the checks; rank 0 reports, and its exit status is the command's."""
    main = init_distributed(torch.device(cfg.device).type).is_main
    say = print if main else lambda line: None
    work = staging_dir(cfg.run_dir).parent / "check"
    # What is checked, taken before the checks start: a commit made while they run is not theirs.
    checked = {"git": git_state(), "source_digest": source_digest(), "config": asdict(cfg)}
    checked["started"] = now_utc()
    writes = which in ("all", "resume")  # the checks that write in `work`, one at a time
    made = make_folders(work) if main and writes else None  # the outermost folder made
    lock = _lock(work, main) if writes else None
    checks = {  # the loader before resume, which pins one thread for exactness
        "overfit": lambda: check_overfit(cfg),
        "batch": lambda: check_batch_independence(cfg),
        "init": lambda: check_initial_loss(cfg),
        "loader": lambda: check_loader(cfg),
        "resume": lambda: CheckResult("resume", *resume_matches(cfg, work / "resume")),
    }
    try:
        results = _run_each({name: check for name, check in checks.items() if which in (name, "all")}, main)
    except (ConfigError, DataError):  # bad input leaves nothing behind
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if which == "all":
        ran = work / "resume" / "uninterrupted" / "run.json"  # the run whose data and config were checked
        summary = {
            "overfit_loss": results["overfit"].value,
            "resume_matched": results["resume"].passed,
            "loader_share": results["loader"].value,
            "samples_per_s": results["loader"].samples_per_s,
            "initial_loss": results["init"].value,
            "checks": {name: r.passed for name, r in results.items()},
            "passed": all(r.passed for r in results.values()),
            **checked,
            "data": json.loads(ran.read_text())["data"],
            "finished": now_utc(),
        }
        if main:
            write_json_atomically(work / "summary.json", summary)  # for `report`
        say(
            f"**Run:** {PROJECT} commit {commit_label(checked['git'])}, config {ran}, "
            f"seed {cfg.seed}, torch {torch.__version__}"
        )
        say(f"**Sanity:** {sanity(summary)}")
        say(
            f"**Throughput:** {results['loader'].samples_per_s:,.0f} samples/s, "
            f"GPU util {results['loader'].gpu_util}, data-loader time share {results['loader'].value:.1%}"
        )
    if lock is not None:
        lock.release()
    return 0 if all(r.passed for r in results.values()) else 1


def _run_each(checks: dict, main: bool) -> dict[str, CheckResult]:
    """Runs `checks` in order; rank 0 prints each one's line, and on stderr what it does and for how long."""
    results = {}
    for name, check in checks.items():
        started = time.perf_counter()
        if main:
            print(f"check {name}: {DOING[name]}...", file=sys.stderr, flush=True)
        results[name] = check()
        if main:
            print(results[name].line())
            print(f"check {name}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return results


def _lock(work: Path, main: bool) -> RunLock | None:
    """Rank 0's lock on the check folder, to the checks' end; every rank refuses if another check holds it."""
    lock, busy = None, None
    if main:
        try:
            lock = RunLock(work)
        except RunFolderBusy as error:
            busy = error
    if any_rank_max(int(busy is not None))[0]:  # decided once, before any check
        raise busy or RunFolderBusy(f"{work} is in use by another check")
    return lock


def sanity(summary: dict) -> str:
    """The Sanity line of the summary: every check's result (`report` prints it too)."""
    checks = summary.get("checks", {})  # absent from the summaries of older projects
    verdict = {name: "pass" if checks[name] else "FAIL" if name in checks else "n/a" for name in CHECKS}
    return (
        f"overfit-one-batch loss {summary['overfit_loss']:.4g}; "
        f"resume check matched: {'yes' if summary['resume_matched'] else 'no'}; "
        f"batch independence {verdict['batch']}; loss at init {summary.get('initial_loss', math.nan):.4g} "
        f"({verdict['init']}); loader {verdict['loader']}"
    )
