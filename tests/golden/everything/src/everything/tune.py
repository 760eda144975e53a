"""The learning-rate range test (`find-lr`): a fresh copy of the model trained for a few hundred
steps while the learning rate grows exponentially; the loss against the rate says where to train.

    python -m everything find-lr  # the default model and data
    python -m everything find-lr --data FILE -o lr.png  # any train option

It builds its own model, optimizer and loader from the options, as `train` would, and writes
only the plot: no run folder, no checkpoint.
"""

import math

from .config import Config
from .data import load_splits
from .engine import Engine, setup, train_step
from .loader import build_loaders
from .train import TrainState, micro_batches

LR_START = 1e-7  # far below any useful rate: the curve starts flat
LR_END = 10.0  # far above: AdamW diverges well before it
RANGE_STEPS = 200  # optimizer steps of the sweep: 25 a decade, enough for a smooth curve
SMOOTHING = 0.9  # exponential moving average of the loss: one batch is noisy
DIVERGED = 4.0  # stop once the smoothed loss is 4x its best: past there the curve says nothing
SUGGEST_DIVISOR = 10  # the rule (Smith 2017, fastai): a tenth of the rate at the lowest loss


def lr_range(cfg: Config, steps: int = RANGE_STEPS) -> list[tuple[float, float]]:
    """(learning rate, smoothed loss) for each step of the sweep, until the loss diverges."""
    device = setup(cfg)
    splits = load_splits(cfg)
    engine = Engine(cfg, splits, device)
    loader, _, sampler = build_loaders(splits, cfg, device)
    batches = micro_batches(loader, sampler, TrainState())
    engine.model.train()
    points, average, best = [], 0.0, math.inf
    for i in range(steps):
        lr = LR_START * (LR_END / LR_START) ** (i / (steps - 1))
        for group in engine.optimizer.param_groups:
            group["lr"] = lr  # the sweep replaces the warmup and decay
        loss, _ = train_step(engine, batches, cfg, device)
        loss = loss.item()
        if not math.isfinite(loss):
            break
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed = average / (1 - SMOOTHING ** (i + 1))  # bias-corrected: the average starts at 0
        points.append((lr, smoothed))
        best = min(best, smoothed)
        if smoothed > DIVERGED * best:
            break
    return points


def suggest(points: list[tuple[float, float]]) -> tuple[float, str]:
    """The suggested --lr and the rule that gave it."""
    lowest_lr, lowest = min(points, key=lambda p: p[1])
    rule = f"{1 / SUGGEST_DIVISOR:g} x the lr of the lowest smoothed loss, {lowest:.4g} at lr {lowest_lr:.3g}"
    return lowest_lr / SUGGEST_DIVISOR, rule


def find_lr(cfg: Config, output: str, steps: int = RANGE_STEPS) -> str:
    """Runs the sweep, plots it when matplotlib is there, and says what --lr to use."""
    points = lr_range(cfg, steps)
    if len(points) < 2:
        return f"the loss was not finite from the first steps of the sweep at lr {LR_START:g}: check the data"
    lr, rule = suggest(points)
    lines = [
        f"swept lr {points[0][0]:.3g} -> {points[-1][0]:.3g} over {len(points)} steps",
        f"suggested --lr {lr:.3g} ({rule}); now --lr {cfg.lr:g}",
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return "\n".join([*lines, 'no plot: pip install -e ".[plot]" for matplotlib'])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points, strict=True))
    ax.axvline(lr, color="C1", linestyle="--", label=f"suggested {lr:.3g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="smoothed train loss", title="lr range test")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    return "\n".join([*lines, f"wrote {output}"])
