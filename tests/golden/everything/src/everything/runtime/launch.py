"""Machinery: torchrun, ending a job with an exit status a scheduler can read. The launch scripts
run it with torchrun's own arguments:

    python -m everything.runtime.launch --nnodes 1 --nproc-per-node 2 \\
        -m everything train ...

It runs torchrun's agent unchanged, restarts (--max-restarts) included; only the end differs:

- a stop signal (SIGTERM from SLURM or Kubernetes, SIGINT from Ctrl-C) ends the job with 128 plus
  its number (143, 130), after the workers' own line, where torchrun raises a traceback and exits 1;
- a worker that refuses its input (exit 2: a changed option on resume, a run folder in use) is not
  restarted, since it would refuse again: the job ends at once with 2;
- a failed job ends with one line that names the rank that failed first and its own last line,
  where torchrun prints a traceback and a table of every rank; so does a lost rendezvous (the node
  that held it ended).
"""

import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher import api as launcher

REFUSED = 2  # a worker's exit status for bad input (see __main__)


class _Agent(LocalElasticAgent):
    """torchrun's agent, which restarts a group for any failed worker; this one not for a refusal."""

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and any(
            failure.exitcode == REFUSED for failure in result.failures.values()
        ):
            self._remaining_restarts = 0  # read by the agent's loop right after this returns
        return result


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
