"""Time per optimizer step: the generated loop beside a bare loop, Lightning and Accelerate.

    pip install -e ".[bench]"
    python benchmarks/overhead.py                       # 15 rounds of 200 steps, all CPU threads
    python benchmarks/overhead.py --rounds 30 --threads 1

Renders the default project (cpu, fp32) into a temporary folder, imports its package, and runs four
loops on the same model (the project's MLP, built by its `build_model`), the same in-memory data,
batch size, precision (fp32), thread count, optimizer (AdamW, fused, weight decay on matrices only),
gradient clipping and warmup-cosine schedule (the project's `lr_factor`):

  generated   the project's own `train()`, timed between its calls of `train_step`: its DataLoader,
              scheduler, step bookkeeping and logging cadence (a train record every log_every
              steps, with its `.item()`s) are all inside the timed window; evaluation and
              checkpoints fall outside it (eval_every and ckpt_every lie beyond the window)
  bare        the floor: index a shuffled permutation of the tensors, forward, backward, clip,
              step, schedule, zero_grad; no DataLoader, no logging
  lightning   lightning.Trainer.fit (no logger, checkpointing, progress bar or model summary),
              timed between on_train_batch_start calls
  accelerate  Accelerator.prepare(model, optimizer, scheduler) and the loop from its docs

Lightning and Accelerate are fed the project's own training DataLoader. Accelerate does not
prepare it: `prepare` rebuilds a DataLoader around its sampler as if that yielded one example
index at a time, while the project's sampler yields a whole batch of indices (batch_size=None), so
a prepared loader hands out single examples (shape (16,), not (256, 16)): it would time a step
over one example. On one device `prepare` only moves batches to the device, which they are on.
Every loop checks its first batch's shape. The loops run interleaved,
in a rotated order each round, after a warm-up round that is thrown away; each loop's time per
step is a ratio to the bare loop's in the same round, and the table shows the median ratio and its
interquartile range across rounds (this machine's noise hits the loops of one round alike).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
import types
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from scaffold.render import new_project

LOOPS = ("bare", "generated", "lightning", "accelerate")
TARGET = 1.02  # the generated loop within 2% of the bare loop (median ratio)


def render_default(parent: Path):
    """Renders the default project (on the CPU, fp32) and imports its modules."""
    answers = {"device": "cpu", "precision": "fp32", "compile": False, "grad_accum_steps": 1}
    project = new_project(parent / "overhead-probe", answers, git=False).path
    package = next((project / "src").glob("*/__main__.py")).parent.name
    sys.path.insert(0, str(project / "src"))
    modules = {
        name: importlib.import_module(f"{package}.{name}")
        for name in ("config", "train", "model", "optim", "data", "runtime.loader")
    }
    pieces = types.SimpleNamespace(  # each where the project defines it
        compute_loss=modules["model"].compute_loss,
        build_model=modules["model"].build_model,
        build_optimizer=modules["optim"].build_optimizer,
        lr_factor=modules["optim"].lr_factor,
        load_splits=modules["data"].load_splits,
        build_loaders=modules["runtime.loader"].build_loaders,
    )
    return modules["config"], modules["train"], pieces


class Bench:
    """One benchmark set-up: the project's modules, its config and data, the step counts.

    Everything the loops share comes from the project's own modules (model, optim, data,
    runtime/loader); the generated loop is the project's train(), timed at its calls of train_step.
    """

    def __init__(self, modules, work: Path, warmup: int, steps: int) -> None:
        self.config, self.train, self.pieces = modules
        self.work = work
        self.warmup, self.steps = warmup, steps
        self.runs = 0
        self.cfg = self.config.Config(
            max_steps=warmup + steps + 1,  # the last step evaluates and checkpoints: not timed
            eval_every=10**9,
            ckpt_every=10**9,
            num_workers=0,
            device="cpu",
        )
        self.splits = self.pieces.load_splits(self.cfg)
        self.loss = self.pieces.compute_loss  # the project's loss: cross-entropy for the default
        self.device = torch.device("cpu")

    def model_and_optimizer(self):
        torch.manual_seed(self.cfg.seed)
        model = self.pieces.build_model(self.cfg, self.splits)
        optimizer = self.pieces.build_optimizer(model, self.cfg)
        return model, optimizer

    def schedule(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.pieces.lr_factor(self.cfg))

    def loader(self):
        return self.pieces.build_loaders(self.splits, self.cfg, self.device)[0]

    def checked(self, batch):
        """The batch, having made sure it is a whole batch (a loop timing less would look fast)."""
        if batch[0].shape[0] != self.cfg.batch_size:
            shape = tuple(batch[0].shape)
            raise AssertionError(f"a batch of shape {shape}, not {self.cfg.batch_size} examples")
        return batch

    def fresh_run_dir(self) -> str:
        self.runs += 1
        return str(self.work / f"run-{self.runs}")

    def per_step(self, stamps: list[float]) -> float:
        """Seconds per step from the time stamps taken as each step began (warm-up left out)."""
        return (stamps[self.warmup + self.steps] - stamps[self.warmup]) / self.steps


def run_generated(bench: Bench) -> float:
    stamps: list[float] = []
    original = bench.train.train_step

    def train_step(*args, **kwargs):
        stamps.append(time.perf_counter())
        return original(*args, **kwargs)

    bench.train.train_step = train_step  # train() looks it up in its module at every step
    try:
        bench.train.train(replace(bench.cfg, run_dir=bench.fresh_run_dir()), quiet=True)
    finally:
        bench.train.train_step = original
    return bench.per_step(stamps)


def run_bare(bench: Bench) -> float:
    model, _ = bench.model_and_optimizer()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": bench.cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=bench.cfg.lr,
        fused=True,
    )
    scheduler = bench.schedule(optimizer)
    x, y = bench.splits.train.x, bench.splits.train.y
    batch, n = bench.cfg.batch_size, len(y)
    generator = torch.Generator().manual_seed(bench.cfg.seed)

    def batches():
        while True:
            order = torch.randperm(n, generator=generator)
            for i in range(n // batch):
                index = order[i * batch : (i + 1) * batch]
                yield x[index], y[index]

    model.train()
    stream = batches()
    stamps = []
    for _ in range(bench.warmup + bench.steps + 1):
        stamps.append(time.perf_counter())
        xb, yb = bench.checked(next(stream))
        loss = bench.loss(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), bench.cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return bench.per_step(stamps)


def run_lightning(bench: Bench) -> float:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.optimizer = bench.model_and_optimizer()

        def training_step(self, batch, batch_idx):
            x, y = bench.checked(batch)
            return bench.loss(self.model(x), y)

        def configure_optimizers(self):
            scheduler = bench.schedule(self.optimizer)
            return {
                "optimizer": self.optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    class Stamps(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.stamps.append(time.perf_counter())

    stamps = Stamps()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=bench.warmup + bench.steps + 1,
        gradient_clip_val=bench.cfg.grad_clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[stamps],
        default_root_dir=bench.fresh_run_dir(),
    )
    trainer.fit(Module(), train_dataloaders=bench.loader())
    return bench.per_step(stamps.stamps)


def run_accelerate(bench: Bench) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    model, optimizer = bench.model_and_optimizer()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, bench.schedule(optimizer))
    loader = bench.loader()  # not prepared: see the module docstring

    def batches():
        while True:
            yield from loader

    model.train()
    stream = batches()
    stamps = []
    for _ in range(bench.warmup + bench.steps + 1):
        stamps.append(time.perf_counter())
        x, y = bench.checked(next(stream))
        loss = bench.loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), bench.cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    accelerator.free_memory()
    return bench.per_step(stamps)


RUNNERS = {
    "bare": run_bare,
    "generated": run_generated,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps a round (default: 200)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first (default: 30)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--skip",
        nargs="+",
        choices=("lightning", "accelerate"),
        default=[],
        help="frameworks to leave out (bare and generated alone need no bench extra)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error("--rounds must be >= 2 (the spread needs two) and --steps >= 1")
    loops = tuple(name for name in LOOPS if name not in args.skip)
    try:
        for name in ("lightning", "accelerate"):
            if name in loops:
                importlib.import_module(name)
    except ImportError as error:
        print(f"error: {error.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and logging
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        import logging

        logging.getLogger(name).setLevel(logging.ERROR)

    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(render_default(Path(tmp)), Path(tmp), args.warmup, args.steps)
        cfg = bench.cfg
        print(
            f"model: the default project's MLP ({bench.splits.n_features}-"
            f"{'-'.join([str(cfg.hidden_dim)] * cfg.n_layers)}-{bench.splits.n_classes}, "
            f"dropout {cfg.dropout}); batch {cfg.batch_size}; fp32; {args.threads} CPU threads; "
            f"torch {torch.__version__}"
        )
        print(
            f"{args.rounds} rounds of {args.steps} timed steps after {args.warmup} warm-up steps, "
            "after one warm-up round; loop order rotated each round"
        )
        for name in loops:  # the warm-up round: imports, first allocations, thread pools
            RUNNERS[name](bench)
        times: dict[str, list[float]] = {name: [] for name in loops}
        for r in range(args.rounds):
            order = loops[r % len(loops) :] + loops[: r % len(loops)]
            for name in order:
                times[name].append(RUNNERS[name](bench))
            print(
                f"  round {r + 1}/{args.rounds}: "
                + "  ".join(f"{n} {times[n][-1] * 1e3:.3f} ms" for n in loops),
                flush=True,
            )

    print()
    print("| loop | ms per step (median) | ratio to bare: median | IQR of the ratio |")
    print("| --- | ---: | ---: | ---: |")
    medians = {}
    for name in loops:
        ratios = [t / b for t, b in zip(times[name], times["bare"], strict=True)]
        q1, q2, q3 = quartiles(ratios)
        medians[name] = q2
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.3f} | {q2:.3f} | "
            f"{q1:.3f}-{q3:.3f} |"
        )
    print()
    ratios = [t / b for t, b in zip(times["generated"], times["bare"], strict=True)]
    q1, q2, q3 = quartiles(ratios)
    print(
        f"generated against bare: median {q2:.3f} (IQR {q1:.3f}-{q3:.3f}) over {args.rounds}"
        f" rounds; target {TARGET:.2f}: {'met' if q2 <= TARGET else 'MISSED'}"
    )
    for name in loops[2:]:
        ahead = medians["generated"] < medians[name]
        print(f"generated ahead of {name} ({medians[name]:.3f}): {'yes' if ahead else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
