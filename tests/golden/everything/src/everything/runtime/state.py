"""Machinery: where a run is (what a checkpoint saves of the loop), what the loop's functions
share, when it validates, and the stream of training batches that keeps its position current."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import EVAL_EVERY_MAX, EVAL_EVERY_MIN, Config
from ..data import Splits
from .checkpoint import CheckpointDir
from .distributed import Dist
from .engine import Engine
from .loader import EpochBatches, epoch_batches, micro_batch_seed
from .runlog import RunLog


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    best_val_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for early stopping
    schedule_steps: int = 0  # the cosine decay's horizon: --max-steps when the run started
    world_size: int = 1  # processes at the start: theirs is the global batch at any number (resume.py)
    skipped_steps: int = 0  # optimizer steps the GradScaler skipped: their gradients overflowed

    def reshard(self, saved_world: int, world_size: int) -> None:
        """The epoch's position in global batches of world_size processes for a run saved by saved_world:
        the first global batch with an example not trained on (those before it are not seen again)."""
        self.batch_in_epoch = self.batch_in_epoch * saved_world // world_size


@dataclass
class Waits:
    data: float = 0.0  # seconds the loop spent waiting for its next batch
    steps: float = 0.0  # and in its training steps in all


@dataclass
class Loop:
    """What the loop's functions share: the training objects, where the run is, where it reports."""

    cfg: Config
    engine: Engine
    splits: Splits
    device: torch.device
    group: Dist
    run: RunLog
    checkpoints: CheckpointDir
    say: Callable[[str], None]  # a line for the console; nothing on the ranks that stay quiet
    state: TrainState = field(default_factory=TrainState)  # set by resume.restore_run
    waits: Waits = field(default_factory=Waits)

    def examples_per_step(self) -> int:
        return self.cfg.grad_accum_steps * self.cfg.batch_size * self.group.world_size


def validation_schedule(cfg: Config, sampler: EpochBatches) -> tuple[int, str]:
    """Steps between validations, and a line saying why. A small data set can overfit before a fixed
    eval_every comes round: --eval-every 0 validates every epoch (at most EVAL_EVERY_MAX steps apart)
    yet at least EVAL_EVERY_MIN apart (a 333-row table's epoch is a step: --patience would go on noise).
    It depends only on the data's size and settings fixed on resume: a resume validates as before."""
    steps_per_epoch = max(1, sampler.batches_per_epoch() // cfg.grad_accum_steps)
    size = f"{sampler.n_examples:,} training examples make {steps_per_epoch:,} steps an epoch"
    if cfg.eval_every:
        every, why = cfg.eval_every, "as --eval-every asks"
    elif steps_per_epoch < EVAL_EVERY_MIN:
        every, why = EVAL_EVERY_MIN, f"at least {EVAL_EVERY_MIN} steps apart, as epochs are short"
    elif steps_per_epoch <= EVAL_EVERY_MAX:
        every, why = steps_per_epoch, "once an epoch"
    else:
        every, why = EVAL_EVERY_MAX, f"every {EVAL_EVERY_MAX} steps, as epochs are long"
    stop = f"early stop after {cfg.patience} without improvement" if cfg.patience else "no early stop"
    return every, f"plan: {size}: validating every {every} steps ({why}), {stop}, best kept"


def micro_batches(loader, sampler: EpochBatches, state: TrainState):
    """Training batches without end; keeps state.epoch and state.batch_in_epoch current. Each seeds
    the global RNG, which draws its dropout masks, from its place in the epoch's global batches: the
    same masks at any number of processes, and on resume."""
    while True:
        sampler.set_epoch(state.epoch, start=state.batch_in_epoch)
        for batch in epoch_batches(loader):
            place = state.batch_in_epoch * sampler.world_size + sampler.rank
            torch.manual_seed(micro_batch_seed(sampler.seed, state.epoch, place))
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def waited(batches, waits: Waits):
    """Passes batches through, adding each wait to waits.data; closing it closes `batches` (and workers)."""
    try:
        while True:
            start = time.perf_counter()
            batch = next(batches)
            waits.data += time.perf_counter() - start
            yield batch
    finally:
        batches.close()
