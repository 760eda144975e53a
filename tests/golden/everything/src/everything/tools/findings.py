"""Tool: what diagnose reads and reports: a finished run read back from its folder, and a finding with the
first checks the training rules give for it; the rules are in loss_findings.py and loop_findings.py."""

from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.records import RunRecordError, read_checks, read_metrics, read_record

MIN_TRAIN_RECORDS = 5  # fewer logged train steps than this say nothing about a curve

CHECKS = {  # the first checks the training rules give, by finding
    "nan": "learning rate too high; fp16 overflow (switch to bf16 or check the scaler); "
    "log of zero or division by zero in a custom loss",
    "flat": "gradients not flowing (requires_grad, detached tensors); learning rate far too low; "
    "labels misaligned",
    "overfitting": "more data or augmentation; regularisation (--dropout, --weight-decay); "
    "early stopping (--patience) and best",
    "val-better-than-train": "dropout or augmentation only in train (normal), or leakage between splits",
    "split-leak": "the same examples in both splits (duplicated rows?): deduplicate before splitting",
    "spiky": "learning rate too high or no warmup (--warmup-steps); bad samples (inspect-data); "
    "batch too small",
    "loader-bound": "raise --num-workers; move decoding out of the main process; profile one window",
    "lr-in-warmup": "the run ended inside its warmup: more --max-steps or fewer --warmup-steps",
    "lr-jump": "the schedule restarted without warmup, a cause of spikes: keep --max-steps when resuming, "
    "or start a new run",
    "schedule-ended-early": "the schedule is built for fewer steps than the run trained (an edited "
    "lr_factor?): build it for max_steps",
    "grad-norm-pinned": "every update is clipped far below its norm: --grad-clip too low for this "
    "model, or gradients growing (learning rate too high)",
    "near-chance": "the data (inspect-data: labels, classes too alike or too small to see); the learning "
    "rate (find-lr) and --warmup-steps against --max-steps; labels misaligned",
    "stopped-early": "validation too noisy for --patience (a larger --val-fraction, a higher --patience); "
    "the learning rate (find-lr)",
}


class DiagnoseError(RuntimeError):
    """A run folder that cannot be read."""


@dataclass
class Finding:
    name: str
    evidence: str  # what the records show, with steps and values
    step: int | None = None  # where it starts, when it has a start
    checks: str = field(init=False)

    def __post_init__(self) -> None:
        self.checks = CHECKS[self.name]

    def line(self) -> str:
        return f"{self.name}: {self.evidence}; first checks: {self.checks}"


@dataclass
class Run:
    dir: Path
    record: dict  # run.json
    train: list[dict]  # metrics.jsonl's train records, in step order
    val: list[dict]
    summary: dict | None  # the check summary beside the run, if `check all` checked this run's code and data
    other_checks: str | None  # else what the last checks there ran on, if they ran

    @property
    def config(self) -> dict:
        return self.record.get("config", {})

    @property
    def name(self) -> str:  # a store's URL (its records were copied to `dir`), or the folder
        url = str(self.config.get("run_dir", "")).rstrip("/")
        return url if "://" in url else str(self.dir)


def load_run(run_dir: str) -> Run:
    path = Path(run_dir)
    try:
        record, metrics = read_record(path), read_metrics(path)
    except RunRecordError as error:
        raise DiagnoseError(str(error)) from None
    train, val = ([r for r in metrics if r["split"] == split] for split in ("train", "val"))
    return Run(path, record, train, val, *read_checks(path, record))
