"""What a run prints keeps a readable cadence on small data: a 333-row table, one step an epoch,
validates every step (its records keep each) but prints a validation line at most once in
--log-every steps, with the early stop and the best always said."""

from __future__ import annotations

import json

import numpy as np
from test_project import render, run


def test_a_small_table_validates_every_step_but_prints_at_the_logs_cadence(tmp_path):
    project = render(tmp_path / "small")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(333, 5))
    labels = (features[:, 0] + features[:, 1] > 0).astype(int)
    rows = [
        ",".join(f"{v:.4f}" for v in row) + f",{label}"
        for row, label in zip(features, labels, strict=True)
    ]
    (project / "small.csv").write_text("a,b,c,d,e,label\n" + "\n".join(rows) + "\n")

    done = run(project, "train", "--data", "small.csv", "--run-dir", "runs/s", "--max-steps", "120")

    assert done.returncode == 0, done.stderr
    assert "validating every 1 steps (once an epoch)" in done.stdout
    records = [
        json.loads(line) for line in (project / "runs/s/metrics.jsonl").read_text().splitlines()
    ]
    validated = [r["step"] for r in records if r["split"] == "val"]
    last = validated[-1]
    assert validated == list(range(1, last + 1))  # every step validated and recorded
    printed = [line for line in done.stdout.splitlines() if "  val loss " in line]
    assert len(printed) <= last // 10 + 2, printed  # --log-every 10: one a 10 steps, and the last
    assert printed[-1].startswith(f"step {last}  val loss ")
    assert "best val loss " in done.stdout.splitlines()[-1]
