"""Machinery: torchrun, ending a job with an exit status a scheduler can read. The launch scripts
run it with torchrun's own arguments:

    python -m everything.runtime.launch --nnodes 1 --nproc-per-node 2 \\
        -m everything train ...

It runs torchrun's agent unchanged, restarts (--max-restarts) included; only the end differs:

- a stop signal (SIGTERM from SLURM or Kubernetes, SIGINT from Ctrl-C) ends the job with 128 plus
  its number (143, 130), after the workers' own line, where torchrun raises a traceback and exits 1;
  so does one sent to a single worker: every rank stops at its step and exits so, and the group is
  neither ended early nor restarted, where torchrun would restart it and train on;
- a worker that refuses its input (exit 2: a changed option on resume, a run folder in use), or
  fails on a full or read-only disk, is not restarted, since it would fail again: the job ends at
  once, with 2 or 1;
- a failed job ends with one line that names the rank that failed first and its own last line,
  where torchrun prints a traceback and a table of every rank; so does a lost rendezvous (the node
  that held it ended).
"""

import logging
import os
import signal
import sys
import time

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as processes
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher import api as launcher

REFUSED = 2  # a worker's exit status for bad input (see __main__)
STOPPED = {128 + signum for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}  # stopping.py's
STOPPING_SECONDS = 60  # the most the ranks may take to finish a stop once one has


class _Agent(LocalElasticAgent):
    """torchrun's agent, which restarts a group for any failed worker and ends the others as soon
    as one has exited; this one restarts none for a refusal, a lasting failure or a stop signal,
    and lets the ranks of a stop finish it: one that exits first would otherwise have the agent
    SIGTERM the rest, a second signal to a rank that got the first, aborting its checkpoint."""

    _stop_began = None  # when the first rank exited from a stop signal

    def _monitor_workers(self, worker_group):
        statuses = [handler.proc.poll() for handler in self._pcontext.subprocess_handlers.values()]
        exits = [status for status in statuses if status is not None]  # of the workers that ended
        stopping = bool(exits) and set(exits) <= STOPPED
        self._stop_began = (self._stop_began or time.monotonic()) if stopping else None
        logging.getLogger(processes.__name__).disabled = stopping  # its "failed (exitcode: 143)"
        if stopping and len(exits) < len(statuses) and time.monotonic() - self._stop_began < STOPPING_SECONDS:
            return RunResult(state=WorkerState.HEALTHY)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and (stopping or any(map(_for_good, result.failures.values()))):
            self._remaining_restarts = 0  # read by the agent's loop right after this returns
        return result


def _for_good(failure) -> bool:
    """A worker's failure that a restart would meet again: a refusal, or a full or read-only disk
    (its record says so: runtime/distributed.py's tell_launcher)."""
    return failure.exitcode == REFUSED or failure.error_file_data.get("lasting", False)


def _first_failure(failed: ChildFailedError):
    """The rank that failed first, and its failure. Failure times are whole seconds, and two
    kinds of failure follow from another's: a rank that only lost the others (its collective
    failed as they ended) and a rank ended by the SIGTERM the agent sends the rest once one has
    failed. Both count after the others, whatever their times."""

    def order(item):
        rank, failure = item
        follows = failure.error_file_data.get("lost_a_rank", False) or failure.exitcode == -signal.SIGTERM
        return follows, failure.timestamp, rank

    return min(failed.failures.items(), key=order)


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv)
    launcher.LocalElasticAgent = _Agent  # the class torchrun's launch_agent makes its agent of
    try:
        torchrun.run(args)
    except SignalException as stop:  # the workers stopped with their checkpoint and said so
        return 128 + stop.sigval
    except ChildFailedError as failed:
        rank, failure = _first_failure(failed)
        if failure.exitcode in STOPPED:  # a stop signal to a worker: the workers said where they stopped
            return failure.exitcode
        status = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode  # -9: SIGKILL
        why = failure.message if os.path.isfile(failure.error_file) else f"exit status {status}"
        print(f"{failed.name}: rank {rank} ended the job: {why}", file=sys.stderr)
        return status
    except RendezvousError as error:  # a node that ended (a refusal there) takes the rendezvous along
        print(f"error: the nodes' rendezvous failed ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
