"""`python -m scaffold` is the `scaffold` command."""

import signal
import sys

from scaffold.interrupts import signals_deferred


def main() -> None:
    """Runs the command line, a Ctrl-C while it loads included: one line, never a traceback."""
    try:
        with signals_deferred():  # a Ctrl-C inside an import can surface as another error
            from scaffold._cli import run
        status = run()
    except KeyboardInterrupt:  # while the command line loaded: nothing had begun
        print("error: interrupted", file=sys.stderr, flush=True)
        status = 130
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # done: a Ctrl-C now would make `status` -2
    # Under `python -m`, CPython exits -2 whenever a KeyboardInterrupt ended a string exec
    # (dataclasses make their methods so), caught or not; each string exec clears that.
    exec("")
    sys.exit(status)


if __name__ == "__main__":
    main()
