"""Training configuration: one dataclass of defaults; every field is a command-line option.

Change a default here, or override it for one run:

    python -m everything train --lr 1e-3 --batch-size 128 --run-dir runs/lr1e-3
"""

import argparse
import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A setting that cannot work, explained in one line."""


@dataclass
class Config:
    # data
    data: str | None = None  # a .npz with arrays x (inputs) and y (targets); None: the example
    val_fraction: float = 0.1  # share held out for validation, the same examples for every seed
    max_train_examples: int = 0  # train on only this many examples (0: all); debug small first
    # Loader processes. In-memory features index in microseconds, and a worker only adds the cost of
    # shipping each batch between processes; raise it when loading a batch does real work.
    num_workers: int = 0
    # model
    hidden_dim: int = 128  # width of each hidden layer
    n_layers: int = 2  # hidden layers
    dropout: float = 0.1  # regularisation; 0 turns it off
    # optimisation
    max_steps: int = 2000  # optimizer steps, each over grad_accum_steps micro-batches
    batch_size: int = 256  # examples per micro-batch
    grad_accum_steps: int = 4  # micro-batches per optimizer step
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 100  # linear warmup: large early updates are the usual cause of spikes
    weight_decay: float = 0.1  # AdamW decay, on weight matrices only (not biases or norms)
    grad_clip: float = 1.0  # max global gradient norm: exploding gradients stay silent until NaN
    # validation and early stopping
    eval_every: int = 200  # steps between validations on the held-out split
    patience: int = 0  # validations without improvement before stopping; 0: never stop early
    # bookkeeping
    run_dir: str = "runs/default"  # run.json, metrics.jsonl and checkpoints/; reused to resume
    log_every: int = 10  # steps between logged train records (the only host syncs in the loop)
    ckpt_every: int = 500  # steps between checkpoints
    keep_last: int = 3  # step checkpoints kept; best.pt is kept besides them
    tracking_uri: str | None = None  # an MLflow server or database; None: a file store in run_dir/mlruns
    seed: int = 0  # seeds Python, NumPy and torch; with the epoch, fixes the sample order
    device: str = "cuda"  # --device cpu runs this project on a machine without the cuda device
    compile: bool = True  # torch.compile the model (the first steps are slow while it compiles)
    deterministic: bool = False  # bit-exact runs: deterministic kernels and one CPU thread

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum_steps", "eval_every", "log_every"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ckpt_every", "keep_last", "hidden_dim", "n_layers"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_workers", "patience", "warmup_steps", "max_train_examples"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _require(0 < self.val_fraction < 1, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _require(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr], got {self.min_lr}")
        _require(self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(
            self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            f"device must be cpu, cuda or mps (optionally with an index), got {self.device!r}",
        )


# Fields that define the model or the data a run sees: a resumed run must keep them.
RESUME_FIXED = (
    "data",
    "val_fraction",
    "max_train_examples",
    "hidden_dim",
    "n_layers",
    "dropout",
    "batch_size",
    "grad_accum_steps",
    "seed",
)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one --option per Config field, defaulting to the dataclass's value."""
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = str if field.type == str | None else field.type
            parser.add_argument(flag, type=kind, default=field.default, help=f"default: {field.default}")


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Config)})
