"""Yours to extend: the command line: train, check, and the commands that inspect, diagnose,
profile and tune.

    python -m everything train [--data FILE] [--run-dir DIR] [--max-steps N] ...
    python -m everything check [all|overfit|batch|init|loader|resume] ...
    python -m everything inspect-data [--data FILE]
    python -m everything plot [RUN_DIR ...] [-o FILE.png]
    python -m everything report [RUN_DIR] [--since EARLIER_RUN_DIR]
    python -m everything diagnose [RUN_DIR ...] [--json]
    python -m everything profile [-o DIR] [train options]
    python -m everything find-lr [-o FILE.png] [train options]
    python -m everything find-batch-size [--global-batch N] [train options]
    python -m everything export [--checkpoint DIR] [--out FILE.pt]
    python -m everything prepare --data SOURCE --out DEST [--shard-mb 64]

Every field of config.Config is an option; `train --help` lists them.
"""

import argparse
import re
import sys
from pathlib import Path

from .config import ConfigError, add_config_arguments, config_from_args
from .data import DataError, summarize
from .data_shards import load_splits
from .prepare import add_prepare, prepare
from .runtime.checkpoint import CheckpointError, export
from .runtime.distributed import leave_with_the_group, lost_a_rank, report_failure, shutdown, tell_launcher
from .runtime.rundir import RunDirError, fetch_checkpoint, fetch_run
from .runtime.stopping import Aborted, RunFolderBusy
from .runtime.store import StoreError, is_url
from .tools.checks import CHECKS, run_checks
from .tools.diagnose import run_diagnose
from .tools.findings import DiagnoseError
from .tools.profiling import profile
from .tools.report import ReportError, plot, report
from .tools.tune import MEMORY_TARGET, RANGE_STEPS, find_batch_size, find_lr
from .train import TrainingError, train

# Errors a user can act on: one line and exit 2 (the input or the run folder) or 1 (what happened).
BAD_INPUT = (ConfigError, DataError, DiagnoseError, RunFolderBusy)
FAILURES = (*BAD_INPUT, CheckpointError, RunDirError, ReportError, StoreError, TrainingError)
NEWEST = "a checkpoint; default: the newest run's best (under runs/)"
URL_PATHS = ("run_dir", "run_dirs", "since", "checkpoint", "data", "dest")  # paths by name: a URL or local
LOCAL_PATHS = ("out", "output", "path", "paths", "sheet")  # local only


def build_parser() -> argparse.ArgumentParser:
    """Every command and its options; a new command needs a parser here and its call in run_command."""
    summary = __doc__.splitlines()[0] if __doc__ else None  # python -OO strips docstrings
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=summary)
    commands = parser.add_subparsers(dest="command", required=True)
    add_config_arguments(commands.add_parser("train", help="train, or resume the run in --run-dir"))
    check = commands.add_parser("check", help="prove the training code: overfit, batch, init, loader, resume")
    check.add_argument("which", nargs="?", default="all", choices=["all", *CHECKS])
    add_config_arguments(check)
    add_config_arguments(commands.add_parser("inspect-data", help="shapes, labels and examples of the data"))
    plotter = commands.add_parser("plot", help="loss and metric curves of runs, overlaid")
    plotter.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="default: the newest run")
    plotter.add_argument("-o", "--output", default="curves.png", metavar="FILE.png")
    reporter = commands.add_parser("report", help="the summary of a run")
    reporter.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="default: the newest run")
    reporter.add_argument("--since", metavar="RUN_DIR", help="an earlier run: the issues this one fixed")
    doctor = commands.add_parser("diagnose", help="what the loss curves say is wrong, with first checks")
    doctor.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="default: the newest run")
    doctor.add_argument("--json", action="store_true", help="the findings as JSON")
    profiler = commands.add_parser("profile", help="where a step's time goes: phases, operators, FLOP/s")
    profiler.add_argument("-o", "--output", default="runs/profile", metavar="DIR", help="for the trace")
    add_config_arguments(profiler)
    finder = commands.add_parser("find-lr", help="the learning-rate range test: a suggested --lr and a plot")
    finder.add_argument("-o", "--output", default="lr_range.png", metavar="FILE.png")
    finder.add_argument("--range-steps", type=int, default=RANGE_STEPS, help="steps of the sweep")
    add_config_arguments(finder)
    sizer = commands.add_parser("find-batch-size", help="the micro-batch that fills the device's memory")
    sizer.add_argument("--global-batch", type=int, metavar="N", help="examples a step, accumulation included")
    sizer.add_argument("--memory-target", type=float, default=MEMORY_TARGET, help="share of device memory")
    add_config_arguments(sizer)
    exporter = commands.add_parser("export", help="a checkpoint's model weights, whole, in one .pt file")
    exporter.add_argument("--checkpoint", help=NEWEST)
    exporter.add_argument("--out", metavar="FILE.pt", help="default: the checkpoint's path + .model.pt")
    add_prepare(commands)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Runs the command `args` names; one without its entry here fails (KeyError) rather than run another."""
    commands = {
        "train": lambda: train(config_from_args(args))["exit_status"],
        "check": lambda: run_checks(config_from_args(args), args.which),
        "inspect-data": lambda: print(summarize(load_splits(config_from_args(args)))),
        "plot": lambda: print("wrote", plot([fetch_run(r) for r in args.run_dirs or [None]], args.output)),
        "report": lambda: print(report(fetch_run(args.run_dir), args.since and fetch_run(args.since))),
        "diagnose": lambda: run_diagnose([fetch_run(r) for r in args.run_dirs or [None]], args.json),
        "profile": lambda: print(profile(config_from_args(args), args.output)),
        "find-lr": lambda: print(find_lr(config_from_args(args), args.output, args.range_steps)),
        "find-batch-size": lambda: print(
            find_batch_size(config_from_args(args), args.global_batch, args.memory_target)
        ),
        "export": lambda: export_weights(args.checkpoint, args.out),
        "prepare": lambda: print(prepare(config_from_args(args), args.dest, args.shard_mb)),
    }
    return commands[args.command]() or 0  # None from a command that printed its result: success


def check_paths(args: argparse.Namespace) -> None:
    """Refuses what only looks like a store URL (s3:/x, s3://, an unknown scheme) and a URL where a local
    path goes: either would become a local folder named "s3:". A new path joins URL_PATHS or LOCAL_PATHS."""
    for name in URL_PATHS + LOCAL_PATHS:
        given = getattr(args, name, None)
        for path in given if isinstance(given, list) else [given]:
            looks = re.match(r"[A-Za-z][\w+.-]+:/", str(path))  # a URL's start (C:/ is a drive)
            if looks and name in LOCAL_PATHS:
                raise ConfigError(f"{path}: {args.command} takes a local path here, not a URL")
            if looks and not is_url(path):
                raise ConfigError(f"{path} is not a store URL (s3://bucket/path, gs://..., file:///folder)")


def export_weights(checkpoint: str | None, out: str | None) -> None:
    local = fetch_checkpoint(checkpoint)
    default = Path(checkpoint).name if checkpoint and is_url(checkpoint) else local  # a URL's: written here
    written = export(Path(local), Path(out or f"{default}.model.pt"))
    print(f"wrote {written}: load it with torch.load(weights_only=True)")
    print(f"wrote {written.with_suffix('.safetensors')}: for train --init-from, and other tools")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        return run_command(args)
    except FAILURES as error:
        report_failure(f"error: {error}")  # rank 0 says it; the launcher names a failed rank
        return 2 if isinstance(error, BAD_INPUT) else 1
    except KeyboardInterrupt as error:  # before training started, or a second stop signal (Aborted)
        how = f"aborted by a second {error}" if isinstance(error, Aborted) else "interrupted"
        print(f"{how}: the newest checkpoint is intact; run the same command to resume", file=sys.stderr)
        return error.status if isinstance(error, Aborted) else 130
    except Exception as error:  # a crash: its traceback here, its last line for the launcher
        if lost_a_rank(error):  # a collective's, as another rank ended
            return leave_with_the_group()
        tell_launcher(f"{type(error).__name__}: {error}".splitlines()[0])
        raise
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
