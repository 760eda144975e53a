"""Machinery: where a run is (what a checkpoint saves of the loop), and the stream of training
batches that keeps that position current."""

import math
import time
from dataclasses import dataclass

from .loader import EpochBatches, epoch_batches


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    best_val_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for early stopping
    schedule_steps: int = 0  # the cosine decay's horizon: --max-steps when the run started

    def reshard(self, saved_world: int, world_size: int) -> None:
        """The epoch's position in global batches of world_size processes, for a run saved by
        saved_world: the first global batch with an example not trained on (the examples before
        it in this epoch are not seen again). The same position when the two are equal."""
        self.batch_in_epoch = self.batch_in_epoch * saved_world // world_size


def micro_batches(loader, sampler: EpochBatches, state: TrainState):
    """Training batches without end; keeps state.epoch and state.batch_in_epoch current."""
    while True:
        sampler.set_epoch(state.epoch, start=state.batch_in_epoch)
        for batch in epoch_batches(loader):
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def waited(batches, waits: list[float]):
    """Passes batches through, adding the seconds each took to arrive to waits[0]; closing it
    closes `batches` (and so ends the loader's workers)."""
    try:
        while True:
            start = time.perf_counter()
            batch = next(batches)
            waits[0] += time.perf_counter() - start
            yield batch
    finally:
        batches.close()
