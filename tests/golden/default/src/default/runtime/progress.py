"""Machinery: what a run prints as it trains, on a terminal and in a log."""

import sys
import time

from tqdm import tqdm


class Progress:
    """A progress bar with loss, throughput and ETA on a terminal; plain lines when logged to a file."""

    def __init__(self, max_steps: int, step: int, examples_per_step: int, quiet: bool) -> None:
        self.max_steps, self.examples_per_step, self.quiet = max_steps, examples_per_step, quiet
        on_tty = not quiet and sys.stderr.isatty()
        self.bar = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, disable=not on_tty)
        self.clock, self.clock_step = time.perf_counter(), step

    def update(self) -> None:
        self.bar.update()

    def log(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        now = time.perf_counter()
        rate = (step - self.clock_step) * self.examples_per_step / (now - self.clock)
        self.clock, self.clock_step = now, step
        if not self.bar.disable:
            self.bar.set_postfix_str(f"loss {loss:.4f}  lr {lr:.2e}  {rate:,.0f} examples/s")
        elif not self.quiet:
            values = f"loss {loss:.4f}  lr {lr:.2e}  grad_norm {grad_norm:.3f}  {rate:,.0f} examples/s"
            print(f"step {step}/{self.max_steps}  {values}", flush=True)

    def close(self) -> None:
        self.bar.close()


def announced(batches, what: str, unit: str = "batch", every: float = 30.0, clock=time.perf_counter):
    """`batches` (or steps), passed through, saying where a long pass is: on a terminal a bar that
    appears after 2 s and goes when the pass ends; in a log a line on stderr every `every` seconds."""
    try:
        total = len(batches)
    except TypeError:  # an iterable without a length
        total = "?"
    if sys.stderr.isatty():
        yield from tqdm(batches, desc=what, unit=unit, leave=False, delay=2.0, dynamic_ncols=True)
        return
    start = last = clock()
    for done, batch in enumerate(batches, 1):
        yield batch  # the caller's work on it is timed too
        now = clock()
        if now - last >= every and done != total:
            units = "batches" if unit == "batch" else f"{unit}s"
            print(f"{what}: {done}/{total} {units}, {now - start:.0f} s", file=sys.stderr, flush=True)
            last = now
