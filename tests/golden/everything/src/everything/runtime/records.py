"""Machinery: reading a run folder's records back: run.json and metrics.jsonl, as report, diagnose and a
resumed run read them. A record that is missing, torn by a crash or of the wrong shape is named in
one line (RunRecordError, or a warning counting the damaged metrics lines), never a traceback."""

import json
import sys
from pathlib import Path

from ..config import RESUME_FIXED


class RunRecordError(RuntimeError):
    """run.json is missing or is not a run record, or metrics.jsonl cannot be read."""


NUMBER = int | float
# What report, diagnose and resumes read from run.json, and its type ("?": may be absent; [x]: a list of x).
RECORD_SHAPE = {
    "project": str,
    "seed": int,
    "config": {"max_steps": int, "lr": NUMBER, "warmup_steps": int, "patience": int, "dropout": NUMBER},
    "git": {"commit": str | None, "dirty": bool},
    "versions": {"torch": str},
    "resumed?": [{"at_step": int}],
    "finished?": {"step": int, "examples_per_s": NUMBER, "data_wait_share?": NUMBER},
    "tracker?": {"logged_through": int},
}


def read_record(run_dir: Path) -> dict:
    """The run's run.json, or RunRecordError saying in one line why it cannot be."""
    path = run_dir / "run.json"
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RunRecordError(f"{path} is missing") from None
    except OSError as error:
        raise RunRecordError(f"cannot read {path}: {error.strerror}") from None
    except ValueError:  # not JSON, or not UTF-8
        raise RunRecordError(f"{path} is damaged (not JSON)") from None
    if not isinstance(record, dict):
        raise RunRecordError(f"{path} is damaged (not a run record)")
    if wrong := _misshapen(record, RECORD_SHAPE):
        shown = ", ".join(wrong[:5]) + (", ..." if len(wrong) > 5 else "")
        raise RunRecordError(f"{path} is damaged (no valid {shown})")
    return record


def _misshapen(value, shape, name: str = "") -> list[str]:
    """The names of the parts of `value` (itself `name`) that do not have `shape`."""
    if isinstance(shape, dict | list) and not isinstance(value, type(shape)):
        return [name]
    if isinstance(shape, dict):
        return [
            wrong
            for key, part in shape.items()
            if not key.endswith("?") or key[:-1] in value
            for wrong in _misshapen(value.get(key.rstrip("?")), part, f"{name}.{key.rstrip('?')}".lstrip("."))
        ]
    if isinstance(shape, list):
        return [wrong for i, item in enumerate(value) for wrong in _misshapen(item, shape[0], f"{name}[{i}]")]
    is_bool = isinstance(value, bool)  # a bool is an int to isinstance
    return [] if isinstance(value, shape) and (is_bool == (shape is bool)) else [name]


# What report and diagnose read from the latest `check all`'s summary.json ("?": may be absent).
SUMMARY_SHAPE = {"overfit_loss": NUMBER, "resume_matched": bool, "loader_share": NUMBER, "checks?": dict}


def commit_label(git: dict) -> str:
    """A git_state() as the Run lines show it: the commit's first 12 digits, -dirty with uncommitted edits."""
    return (git.get("commit") or "none")[:12] + ("-dirty" if git.get("dirty") else "")


def checks_mismatch(summary: dict, record: dict) -> str | None:
    """What `summary`'s checks ran that `record`'s run did not (other code, data or settings), else None."""
    latest = [record, *record.get("resumed", [])][-1]
    if summary.get("source_digest") is None or summary["source_digest"] != latest.get("source_digest"):
        return "other code"
    ran, checked = record.get("data", {}), summary.get("data", {})
    if any(ran.get(key) != checked.get(key) for key in ("source", "digest")):
        return "other data"
    config = record.get("config", {})
    if differ := [name for name in RESUME_FIXED if summary.get("config", {}).get(name) != config.get(name)]:
        return "other settings (" + ", ".join("--" + name.replace("_", "-") for name in differ) + ")"
    return None


def check_summary_path(run_dir: Path) -> Path:
    return run_dir.parent / "check" / "summary.json"  # beside the run: runs/check/


def read_checks(run_dir: Path, record: dict) -> tuple[dict | None, str | None]:
    """The `check all` summary beside the run if it checked `record`'s run; else None and what it ran on."""
    path = check_summary_path(run_dir)
    try:
        summary = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as error:  # unreadable, not JSON, or not UTF-8
        print(f"warning: {path}: cannot be read ({error.__class__.__name__}); left out", file=sys.stderr)
        return None, None
    if _misshapen(summary, SUMMARY_SHAPE):
        print(f"warning: {path} is damaged (not a check summary); left out", file=sys.stderr)
        return None, None
    if (mismatch := checks_mismatch(summary, record)) is None:
        return summary, None
    when, commit = summary.get("finished", "at an unknown time"), commit_label(summary.get("git", {}))
    return None, f"the last checks ({path}, {when}, commit {commit}) ran on {mismatch}"


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records; lines that are not records are skipped, with a warning."""
    path = run_dir / "metrics.jsonl"
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RunRecordError(f"cannot read {path}: {error.strerror}") from None
    return parse_metrics(data, path, "skipped")


def parse_metrics(data: bytes, path: Path, dropped: str) -> list[dict]:
    """The records in metrics.jsonl's bytes, read from `path`; a warning names the other lines (`dropped`)."""
    records, damaged = [], []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # torn by a crash, or not UTF-8
            record = None
        if _is_record(record):
            records.append(record)
        else:
            damaged.append(number)
    if damaged == [len(data.splitlines())] and not data.endswith(b"\n"):  # a last line with no newline
        print(f"warning: {path}: its last line ({damaged[0]}), cut off mid-write, {dropped}", file=sys.stderr)
    elif damaged:
        shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        what = f"{len(damaged)} damaged line{'s' if len(damaged) > 1 else ''} ({shown})"
        print(f"warning: {path}: {what} {dropped}", file=sys.stderr)
    return records


def _is_record(record) -> bool:
    """A step, a split and numbers: the loss, and a train record's lr and grad_norm among them."""
    return (
        isinstance(record, dict)
        and type(record.get("step")) is int
        and record.get("split") in ("train", "val")
        and {"loss", *(("lr", "grad_norm") if record["split"] == "train" else ())} <= record.keys()
        and all(isinstance(v, NUMBER) and not isinstance(v, bool) for k, v in record.items() if k != "split")
    )
