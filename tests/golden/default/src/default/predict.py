"""Yours to edit: a prediction for each row of a table, from a trained checkpoint (by default the
newest run's best):

    python -m default predict new_rows.csv -o predictions.csv

Each row is encoded as training encoded its rows, with the statistics the checkpoint holds (fitted
on the training split): no row of the run's data is read. The output keeps the rows' order and
their id columns, then the likeliest class and each class's probability.
"""

from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.csv as pa_csv
import torch

from .columns import DataError, encode, read_table, table_columns
from .config import Config
from .model import build_model
from .runtime.checkpoint import load

BATCH = 8192  # rows a forward pass


def predict(path: str, output: str, checkpoint: str, device: str) -> None:
    """Writes `output` (CSV) with a row of predictions a row of `path`, and says so in a line."""
    saved = load(checkpoint)
    cfg = Config(**{**saved["config"], "device": device})
    data = saved["data"]
    model = build_model(cfg, SimpleNamespace(**data))
    model.load_state_dict(saved["model"])
    model.to(cfg.device).eval()
    source, out = Path(path), Path(output)
    if source.resolve() == out.resolve():
        raise DataError(f"{out}: the rows to predict: write the predictions elsewhere")
    table = read_table(source, {spec["name"]: spec["type"] for spec in data["columns"]})
    needed = {spec["name"] for spec in data["columns"]}
    x = torch.from_numpy(encode(source, table_columns(source, table, needed), data["columns"]))
    with torch.no_grad():
        outputs = torch.cat([model(batch.to(cfg.device)).float().cpu() for batch in x.split(BATCH)])
    columns = {name: table[name] for name in data["ids"] if name in table.column_names}
    probs = outputs.softmax(dim=-1).numpy()
    columns[data["label"]] = pa.array(data["classes"]).take(probs.argmax(axis=1))
    for i, name in enumerate(data["classes"]):
        columns[f"p_{name}"] = pa.array(probs[:, i].round(6))
    out.parent.mkdir(parents=True, exist_ok=True)
    pa_csv.write_csv(pa.table(columns), out)
    print(f"wrote {out}: {len(x):,} rows predicted by {checkpoint}")
