"""Yours to edit: how a table's columns become features, with statistics of the training split only.

A column is typed by its content. Numbers are standardised, gaps filled with the training median
plus a missing-indicator feature; dates and times (ISO text, or Parquet's) are days since 1970 beside
their DATE_PARTS; text is one-hot over its MAX_LEVELS commonest training values and OTHER. An id
(unique on every row) is left out of the features and kept beside `predict`'s outputs. The fitted
encoding is plain data: every checkpoint holds it, `inspect-data` shows it, `predict` applies it.
"""

import contextlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

# One-hot features a text column has at most, besides "(other)". Against one number a column (the
# level's rank), one-hot scored R^2 0.981 against 0.938 on a diamonds price table, but less on two
# others (0.753 against 0.776 accuracy, R^2 0.870 against 0.907), and it keeps levels apart without
# inventing an order. A column of thousands of levels (a city, a product) wants an embedding.
MAX_LEVELS = 32
OTHER = "(other)"
NEAR_UNIQUE = 0.9  # text distinct on this share of rows names them (a comment, a timestamp): left out
SEPARATORS = ",;\t|"  # a CSV's is the commonest of these in its header row
# A date's parts beside its day count, from days since 1970 (a Thursday), each scaled to about [-1, 1]:
# seasons, weekly cycles and hours of the day that a single day count cannot show an MLP.
DATE_PARTS = {
    "month": lambda days: (np.floor(days).astype("M8[D]").astype("M8[M]").astype(int) % 12 - 5.5) / 5.5,
    "weekday": lambda days: ((np.floor(days) + 3) % 7 - 3) / 3,
    "hour": lambda days: (days % 1 * 24 - 11.5) / 11.5,
}
SUFFIXES = (".csv", ".parquet")
# Values beyond this magnitude are refused: float32 statistics of them (sums of squares over a
# million examples) overflow, and a loss over them is NaN from the first step.
LARGEST_VALUE = 1e15
_NOTED: set[str] = set()  # the notes printed so far


class DataError(ValueError):
    """Input data that cannot be used, naming the file and the offending line or field."""


@dataclass
class Column:
    """One column as read: numbers (NaN where missing) or text (codes into `names`, -1 where missing)."""

    name: str
    values: np.ndarray  # (N,) float64 numbers, or int64 codes of text
    names: list[str] | None = None  # text only: the distinct values
    whole: bool = False  # numbers only: read as integers
    date: bool = False  # numbers only: days since 1970-01-01, the time of day their fraction

    def missing(self) -> np.ndarray:
        return np.isnan(self.values) if self.names is None else self.values < 0

    def is_id(self) -> bool:
        """Unique on every row, and text or whole numbers: a key, which no row shares."""
        if self.names is not None:
            return len(self.names) == len(self.values) and not self.missing().any()
        return self.whole and len(np.unique(self.values)) == len(self.values)

    def near_unique(self) -> bool:
        """Text distinct on nearly every row: one-hot, each level a row or two, nothing to learn from."""
        return self.names is not None and len(self.names) >= NEAR_UNIQUE * len(self.values)


def check_file(path: Path, suffixes: tuple[str, ...]) -> None:
    expected = f"expected a {', '.join(suffixes[:-1])} or {suffixes[-1]} file"
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file: {expected}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix not in suffixes:
        raise DataError(f"{path}: {expected}")


def read_table(path: Path, types: dict[str, str] | None = None) -> pa.Table:
    """A .csv (with a header row) or .parquet file, columns typed by their content or `types` (training's)."""
    check_file(path, SUFFIXES)
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        else:  # "", "NA", "null", "nan" and the like are gaps, in text columns too
            sep, point = _sniff(path)
            convert = pa_csv.ConvertOptions(strings_can_be_null=True, decimal_point=point)
            table = pa_csv.read_csv(path, pa_csv.ReadOptions(), pa_csv.ParseOptions(delimiter=sep), convert)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: {_reading_error(path, error)}") from None
    names = table.column_names
    if path.suffix == ".csv" and all(_is_number(name) for name in names):
        raise DataError(f"{path}:1: every field is a number: the file needs a header row naming its columns")
    if (twice := next((name for name in names if names.count(name) > 1), None)) is not None:
        raise DataError(f"{path}: column {twice!r} appears twice in the header")
    if table.num_rows == 0:
        raise DataError(f"{path}: need a header row and at least one example")
    for name, kind in (types or {}).items():
        if name in names:
            table = table.set_column(names.index(name), name, _cast(path, table[name], name, kind))
    return table


def _sniff(path: Path) -> tuple[str, str]:
    """The separator (SEPARATORS' commonest in the header) and decimal point (a comma if 1,5 beats 1.5)."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
    if head.startswith((b"\x1f\x8b", b"PK\x03\x04")):  # what pyarrow reads as text, and fails on
        raise DataError(f"{path}: a compressed file (gzip or zip), not CSV text: decompress it first")
    head = head.decode("utf-8", "replace")
    sep = max(SEPARATORS, key=re.sub(r'"[^"]*"', "", head.split("\n", 1)[0]).count)
    fields = [field.strip() for field in re.split(f"[{re.escape(sep)}\n]", head)]
    commas, points = (sum(bool(re.fullmatch(rf"-?\d+{p}\d+", f)) for f in fields) for p in (",", r"\."))
    point = "," if sep != "," and commas > points else "."
    if sep != ",":
        note(f"{path}: fields separated by {sep!r}" + (", decimal comma" if point == "," else ""))
    return sep, point


def _reading_error(path: Path, error: Exception) -> str:
    message = str(error).splitlines()[0]
    if path.suffix == ".parquet":
        return f"not a readable Parquet file ({message})"
    if message == "Empty CSV file":
        return "need a header row and at least one example"
    if "invalid UTF8" in message:
        return f"not UTF-8 text ({message})"
    return message


def _cast(path: Path, column: pa.ChunkedArray, name: str, kind: str) -> pa.ChunkedArray:
    types = {"number": pa.float64(), "date": pa.timestamp("ms"), "text": pa.string()}
    try:
        return pc.cast(column, types[kind], safe=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise DataError(f"{path}: column {name!r} was {kind} in training: {error}") from None


def _is_number(cell: str) -> bool:
    with contextlib.suppress(ValueError):
        float(cell)
        return True
    return False


def table_columns(path: Path, table: pa.Table, only: set[str] | None = None) -> list[Column]:
    """Every column (or those in `only`: rows to predict, typed as in training) as numbers, dates or text."""
    columns = []
    for name, chunked in zip(table.column_names, table.columns, strict=True):
        if only is not None and name not in only:
            continue
        if only is None and pa.types.is_string(chunked.type):  # text of ISO dates or times: dates
            with contextlib.suppress(pa.ArrowInvalid):
                chunked = pc.cast(chunked, pa.timestamp("ms"), safe=False)
        kind = chunked.type
        if pa.types.is_timestamp(kind) or pa.types.is_date(kind):  # milliseconds since 1970, as days
            stamps = pc.cast(pc.cast(chunked, pa.timestamp("ms"), safe=False), pa.int64())
            column = Column(name, pc.cast(stamps, pa.float64()).to_numpy() / 86_400_000, date=True)
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or kind in (pa.bool_(), pa.null()):
            values = pc.cast(chunked, pa.float64()).to_numpy()  # nulls become NaN
            column = Column(name, values, whole=pa.types.is_integer(kind))
        elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):  # how CSV reads bad UTF-8
            raise DataError(f"{path}: not UTF-8 text (column {name!r})")
        else:  # text, times of day: their text is their level
            encoded = pc.dictionary_encode(pc.cast(chunked, pa.string())).combine_chunks()
            codes = pc.fill_null(encoded.indices, -1).to_numpy().astype(np.int64)
            column = Column(name, codes, encoded.dictionary.to_pylist())
        check_numbers(path, column)
        columns.append(column)
    return columns


def check_numbers(path: Path, column: Column) -> None:
    """A DataError naming the first example of a numeric column that is infinite or beyond ±LARGEST_VALUE."""
    if column.names is not None:
        return
    with np.errstate(invalid="ignore"):
        bad = np.abs(column.values) > LARGEST_VALUE  # NaN compares False: a gap, not an error
    if bad.any():
        row = int(np.argmax(bad))
        raise DataError(
            f"{path}: example {row} has {column.name} {column.values[row]:g}; numbers must be"
            f" finite and within ±{LARGEST_VALUE:g}"
        )


def note(message: str) -> None:
    """One line on stderr, once a process (the checks load the data several times), from one rank."""
    if message not in _NOTED and os.environ.get("RANK", "0") == "0":
        _NOTED.add(message)
        print(f"note: {message}", file=sys.stderr)


def read_npz(path: Path, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Arrays x (N, F) and y (N,) of a .npz file, and those of `optional` it holds, or a DataError."""
    try:
        with np.load(path, allow_pickle=False) as arrays:  # never unpickle data
            if missing := [key for key in ("x", "y") if key not in arrays.files]:
                found = ", ".join(arrays.files[:10]) or "none"
                raise DataError(f"{path}: missing array(s) {', '.join(missing)}; found {found}")
            found = {key: arrays[key] for key in ("x", "y", *optional) if key in arrays.files}
    except DataError:
        raise
    except Exception as error:  # not a zip, a truncated one, or object arrays (refused unread)
        raise DataError(f"{path}: not a readable .npz file of numeric arrays ({error})") from None
    x, y = found["x"], found["y"]
    if x.ndim != 2 or y.ndim != 1 or (len(found) == 2 and len(y) != len(x)):  # else its caller checks
        raise DataError(f"{path}: need x of shape (N, F) and y of shape (N,), got {x.shape} and {y.shape}")
    return found


def fit(columns: list[Column], rows: np.ndarray) -> list[dict]:
    """Each column's encoding, from the training `rows` alone: type, missing share, and statistics."""
    specs = []
    for column in columns:
        values, missing = column.values[rows], column.missing()[rows]
        spec = {"name": column.name, "missing": float(missing.mean()), "indicator": bool(missing.any())}
        if column.names is None:
            if missing.all():
                raise DataError(f"column {column.name!r} has no values in the training split")
            median = float(np.median(values[~missing]))
            filled = np.where(missing, median, values)
            kind = "date" if column.date else "number"
            spec |= {"type": kind, "median": median, "mean": float(filled.mean())}
            spec["std"] = float(filled.std()) or 1.0  # a constant column: left at 0
            if column.date:  # the hour only where some value has a time of day
                spec["parts"] = [part for part in DATE_PARTS if part != "hour" or (filled % 1).any()]
        else:
            counts = np.bincount(values[~missing], minlength=len(column.names))
            order = sorted(np.nonzero(counts)[0], key=lambda i: (-counts[i], column.names[i]))
            spec |= {"type": "text", "levels": [column.names[i] for i in order[:MAX_LEVELS]]}
            spec["counts"] = [int(counts[i]) for i in order[:MAX_LEVELS]]
            if counts.sum() > 2 * sum(spec["counts"]):  # most of it one feature
                rare = 1 - sum(spec["counts"]) / counts.sum()
                note(
                    f"column {column.name!r}: {rare:.0%} of its values are rarer than its {MAX_LEVELS}"
                    f" commonest, one {OTHER} feature: group them, or raise MAX_LEVELS in columns.py"
                )
        specs.append(spec)
    return specs


def feature_names(specs: list[dict]) -> list[str]:
    """The name of each encoded feature, in the order of encode's columns."""
    names = []
    for spec in specs:
        if spec["type"] != "text":
            names += [spec["name"], *(f"{spec['name']} {part}" for part in spec.get("parts", []))]
        else:
            names += [f"{spec['name']}={level}" for level in [*spec["levels"], OTHER]]
        if spec["indicator"]:
            names.append(f"{spec['name']} missing")
    return names


def encode(path: Path, columns: list[Column], specs: list[dict]) -> np.ndarray:
    """The features (N, F) float32 of `columns`, encoded as `specs` say, in feature_names' order (a million
    rows of 111 features: 0.4 GB, about a second, most of it the memory's first touch)."""
    by_name = {column.name: column for column in columns}
    n_rows = len(columns[0].values) if columns else 0
    out = np.zeros((n_rows, len(feature_names(specs))), dtype=np.float32)
    rows, at = np.arange(n_rows), 0
    for spec in specs:
        if (column := by_name.get(spec["name"])) is None:
            raise DataError(f"{path}: no column {spec['name']!r}, which the model was trained on")
        missing = column.missing()
        if spec["type"] != "text":
            filled = np.where(missing, spec["median"], column.values)
            out[:, at] = (filled - spec["mean"]) / spec["std"]
            for part in spec.get("parts", []):
                at += 1
                out[:, at] = DATE_PARTS[part](filled)
            at += 1
        else:  # one-hot: a 1 at the row's level, or at OTHER (the last) if rare, unseen or missing
            levels = spec["levels"]
            index = {level: i for i, level in enumerate(levels)}
            lookup = np.array([index.get(name, len(levels)) for name in column.names] + [len(levels)])
            out[rows, at + lookup[column.values]] = 1  # code -1 (missing) reads lookup[-1]
            at += len(levels) + 1
        if spec["indicator"]:
            out[:, at] = missing
            at += 1
    return out


def show(specs: list[dict], n_levels: int = 6) -> list[str]:
    """A line a column: its type, missing share (of the training split), and statistics."""
    lines = []
    for spec in specs:
        gaps = f"{spec['missing']:.1%} missing" + (" (an indicator feature)" if spec["indicator"] else "")
        if spec["type"] == "number":
            stats = f"median {spec['median']:.4g}, mean {spec['mean']:.4g}, std {spec['std']:.4g}"
        elif spec["type"] == "date":
            day = np.datetime64(round(spec["median"] * 86_400), "s")
            day = day if "hour" in spec["parts"] else day.astype("M8[D]")
            stats = f"median {day}, std {spec['std']:.4g} days; parts {', '.join(spec['parts'])}"
        else:
            pairs = list(zip(spec["levels"], spec["counts"], strict=True))
            shown = ", ".join(f"{level} {count:,}" for level, count in pairs[:n_levels])
            more = f", ... ({len(pairs)} kept, the rest {OTHER})" if len(pairs) > n_levels else ""
            stats = f"{len(pairs)} levels: {shown}{more}"
        lines.append(f"  {spec['name']}: {spec['type']}, {gaps}; {stats}")
    return lines
