"""Yours to edit: the training configuration, one dataclass of defaults; each field is an option.

Change a default here, or override it for one run:

    python -m everything train --lr 1e-3 --batch-size 128 --run-dir runs/lr1e-3
"""

import argparse
import dataclasses
import inspect
import math
import re
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A setting that cannot work, explained in one line."""


def fixed(default):
    """A field a resumed run must keep (it defines the model, data or optimisation): a resume refuses another
    value, naming it. The others apply as given. A raised --max-steps trains on at min_lr past the planned
    cosine horizon (TrainState.schedule_steps), never jumping up; a lowered one re-plans the decay to end
    there, as if the run had started with it, and says so; one below the step reached is refused."""
    return field(default=default, metadata={"resume": "fixed"})


@dataclass
class Config:
    # data
    data: str | None = fixed(None)  # a .npz of x and y or prepare's shards (folder or URL); None: the example
    val_fraction: float = fixed(0.1)  # share held out for validation, the same examples for every seed
    max_train_examples: int = fixed(0)  # train on only the first this many examples (0: all); debug small
    input_noise: float = fixed(0.0)  # std of Gaussian noise added to training inputs (augmentation)
    # Loader processes. In-memory pairs index in microseconds, and a worker only adds the cost of
    # shipping each batch between processes; raise it when loading a batch does real work.
    num_workers: int = 0
    # model
    hidden_dim: int = fixed(128)  # width of each hidden layer
    n_layers: int = fixed(2)  # hidden layers
    dropout: float = fixed(0.1)  # regularisation; 0 turns it off
    # optimisation
    max_steps: int = 2000  # optimizer steps, each over grad_accum_steps micro-batches
    batch_size: int = fixed(256)  # examples per micro-batch
    grad_accum_steps: int = fixed(4)  # micro-batches per optimizer step
    lr: float = fixed(3e-3)  # peak learning rate, reached after the warmup
    min_lr: float = fixed(3e-4)  # floor of the cosine decay
    # Linear warmup steps: large early updates are the usual cause of spikes. A --warmup-steps given
    # must be below --max-steps; the default may outlast a short trial run, which ends in its warmup.
    warmup_steps: int = fixed(100)
    weight_decay: float = fixed(0.1)  # AdamW decay, on weight matrices only (not biases or norms)
    grad_clip: float = fixed(1.0)  # max global gradient norm: exploding gradients stay silent until NaN
    # Every Nth of model.repeated_blocks recomputes its activations in the backward pass rather than
    # keep them (1: all, 0: off): less memory, more step time, the same results (a resume may change it).
    activation_checkpointing: int = 0
    # fine-tuning (runtime/finetune.py)
    freeze: str = fixed("")  # module-name prefixes, comma-separated, whose weights do not train ("": none)
    unfreeze_at: int = fixed(0)  # steps after which the --freeze modules train too (0: frozen to the end)
    ema: float = fixed(0.0)  # decay of the weights' average that validates and exports (0: off)
    # validation and early stopping
    eval_every: int = 0  # steps between validations; 0: every epoch, 10 to 200 apart (EVAL_EVERY_MIN/MAX)
    patience: int = 10  # validations without improvement before stopping early (best is kept); 0: never
    # bookkeeping
    run_dir: str = "runs/default"  # run.json, metrics.jsonl and checkpoints/; reused to resume
    log_every: int = 10  # steps between logged train records (the only host syncs in the loop)
    ckpt_every: int = 500  # steps between checkpoints
    ckpt_minutes: float = 5.0  # minutes between checkpoints at most: a kill loses no more; 0: steps alone
    keep_last: int = 3  # step checkpoints kept; best is kept besides them
    upload_retry_minutes: float = 5.0  # a URL --run-dir whose store is away this long stops at a checkpoint
    # streamed data (a --data URL or shard folder: runtime/shards.py)
    cache_size: str = "20GB"  # local disk for a URL's shards, fetched ahead and deleted once read
    shuffle_window: int = fixed(8)  # shards whose examples are shuffled together (defines the order)
    fetch_retry_minutes: float = 5.0  # a --data store away this long stops the run at a checkpoint
    tracking_uri: str | None = None  # an MLflow server or database; None: a file store in run_dir/mlruns
    seed: int = fixed(0)  # seeds Python, NumPy and torch; with the epoch, fixes the sample order
    # Weights to start from: a checkpoint (a run's best or step-N, local or RUN_URL/checkpoints/NAME),
    # a state_dict .pt (what `export` writes) or a .safetensors file. Read at a fresh start only: a
    # resume takes its own checkpoint (give the same --init-from: a resume keeps it).
    init_from: str | None = fixed(None)
    device: str = "cuda"  # where training runs (--device overrides it: --device cpu runs anywhere)
    compile: bool = True  # torch.compile the model (the first steps are slow while it compiles)
    deterministic: bool = False  # bit-exact runs: deterministic kernels and one CPU thread

    def __post_init__(self) -> None:
        positive = ("max_steps", "batch_size", "grad_accum_steps", "log_every", "ckpt_every", "keep_last")
        for name in (*positive, "hidden_dim", "n_layers"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        counts = "num_workers patience warmup_steps max_train_examples eval_every activation_checkpointing"
        for name in counts.split():
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("ckpt_minutes", "upload_retry_minutes", "fetch_retry_minutes"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _require(self.shuffle_window >= 1, f"shuffle_window must be >= 1, got {self.shuffle_window}")
        _require(0 < self.val_fraction < 1, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _require(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        _require(self.input_noise >= 0, f"input_noise must be >= 0, got {self.input_noise}")
        _require(0 < self.lr < math.inf, f"lr must be a finite number > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr], got {self.min_lr}")
        _require(0 <= self.ema < 1, f"ema must be in [0, 1), got {self.ema}")
        _require(self.unfreeze_at >= 0, f"unfreeze_at must be >= 0, got {self.unfreeze_at}")
        _require(not self.unfreeze_at or self.freeze, "--unfreeze-at needs --freeze: nothing is frozen")
        _require(self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}")
        decay = self.weight_decay
        _require(0 <= decay < math.inf, f"weight_decay must be a finite number >= 0, got {decay}")
        _require(0 <= self.seed < 2**32, f"seed must be in [0, 2**32) (NumPy's range), got {self.seed}")
        valid = re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", self.device) is not None
        _require(valid, f"device must be cpu, cuda or mps (optionally with an index), got {self.device!r}")


RESUME_FIXED = tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("resume") == "fixed")
EVAL_EVERY_MIN = 10  # validation steps apart at least when --eval-every is 0 (small tables: a step an epoch)
EVAL_EVERY_MAX = 200  # validation steps apart at most when --eval-every is 0 (epochs can be long)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one --option per Config field, its comment as help, left out of the parsed ones if not given."""
    comments = _field_comments()
    for f in dataclasses.fields(Config):
        text = f"{comments.get(f.name, '')} (default: {f.default})".replace("%", "%%")
        parsed = {"type": str if f.type == str | None else f.type}
        if f.type is bool:
            parsed = {"action": argparse.BooleanOptionalAction}
        parser.add_argument("--" + f.name.replace("_", "-"), **parsed, default=argparse.SUPPRESS, help=text)


def _field_comments() -> dict[str, str]:
    """Each field's comment in the Config source: on its line, else the comment lines above it."""
    comments, above = {}, []
    for line in inspect.getsource(Config).splitlines():
        line = line.strip()
        if line.startswith("#"):
            above.append(line.lstrip("# "))
            continue
        if match := re.match(r"(\w+): [^=]+=[^#]*(?:#\s*(.*))?$", line):
            comments[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return comments


def config_from_args(args: argparse.Namespace) -> Config:
    """The options given, defaults for the rest; only an asked-for warmup outlasting the run is refused."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)}
    cfg = Config(**given)
    if "warmup_steps" in given and cfg.warmup_steps >= cfg.max_steps:
        raise ConfigError(
            f"--warmup-steps {cfg.warmup_steps} must be below --max-steps {cfg.max_steps},"
            " or the run ends inside its warmup"
        )
    return cfg
