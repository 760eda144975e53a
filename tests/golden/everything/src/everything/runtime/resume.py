"""Machinery: whether a run folder can resume, and how: its checkpoints kept, its settings and data
unchanged, and the learning-rate schedule's horizon when --max-steps changes."""

import math
from pathlib import Path

from ..config import RESUME_FIXED, Config, ConfigError
from ..data import Splits
from .records import RunRecordError, read_metrics, read_record


def check_resumable(checkpoint: dict, cfg: Config, splits: Splits) -> None:
    """Refuses a checkpoint of other settings: the run would not go on as it started."""
    saved = checkpoint["config"]
    changed = [
        f"{k} {saved.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in RESUME_FIXED
        if saved.get(k) != getattr(cfg, k)
    ]
    changed += [
        f"data {k} {checkpoint['data'].get(k)!r} -> {v!r}"
        for k, v in splits.describe().items()
        if checkpoint["data"].get(k) != v
    ]
    if changed:
        raise ConfigError(
            f"{cfg.run_dir} holds a run with other settings ({'; '.join(changed)}): "
            "resume with its settings, or start a new --run-dir"
        )


def check_checkpoints_kept(run_dir: Path) -> None:
    """Refuses a run folder whose checkpoints/ or step checkpoints were deleted: starting again at
    step 0 would overwrite its records. A start makes checkpoints/ before it writes run.json, so a
    run killed before its first checkpoint has the folder (empty) and starts again; a run whose
    records go past its first checkpoint's step (or that finished) had one."""
    if not (run_dir / "run.json").exists():
        return
    if not (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"{run_dir / 'checkpoints'} is missing, so the run in {run_dir} cannot resume:"
            " start over in a new --run-dir"
        )
    if any((run_dir / "checkpoints").glob("step-*")) or not (run_dir / "metrics.jsonl").exists():
        return
    try:
        record = read_record(run_dir)
    except RunRecordError:
        return  # rebuilt on resume, with a warning
    reached = max((r["step"] for r in read_metrics(run_dir) if r["split"] == "train"), default=0)
    if record.get("finished") or reached > record["config"].get("ckpt_every", math.inf):
        raise ConfigError(
            f"{run_dir / 'checkpoints'} holds no step checkpoint, though the run in {run_dir} reached"
            f" step {reached} and saved them: it cannot resume: start over in a new --run-dir"
        )


def schedule_horizon(cfg: Config, step: int, planned: int) -> int:
    """The cosine decay's horizon for a run resumed at `step` that was planned for `planned` steps
    (see config.fixed): a raised --max-steps keeps the plan, a lowered one re-plans it, and one
    below `step` is refused."""
    if cfg.max_steps < step:
        raise ConfigError(
            f"{cfg.run_dir} is at step {step} (of {planned} planned), past --max-steps {cfg.max_steps}:"
            f" give --max-steps {step} or more, or start over in a new --run-dir"
        )
    return cfg.max_steps if step < cfg.max_steps < planned else planned
