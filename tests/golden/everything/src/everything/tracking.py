"""MLflow: a local file store in <run_dir>/mlruns, or the server given by --tracking-uri.

    mlflow ui --backend-store-uri runs/default/mlruns

MLflow keeps every value it is sent, so records reach it once a checkpoint covers them: a run
resumed after a crash continues the same MLflow run (its id is saved in every checkpoint) with
one value per step. Charts lag by at most --ckpt-every steps; metrics.jsonl has every record at
once. MLflow 3 has put its file store in maintenance mode; pass a database or server URI with
--tracking-uri (for example sqlite:///mlflow.db) to use its newest features.
"""

import json
import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient


class Tracker:
    def __init__(self, run_dir: Path, record: dict, resume: dict | None) -> None:
        uri = record["config"]["tracking_uri"]
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = resume["state"]["mlflow_run_id"] if resume else None
        if self.run_id is not None and not self._has_run(self.run_id):
            print(f"warning: MLflow run {self.run_id} is not in {uri}: continuing in a new MLflow run")
            self.run_id = None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = self.client.get_experiment_by_name(record["project"])
            if experiment is None:
                experiment_id = self.client.create_experiment(record["project"])
            else:
                experiment_id = experiment.experiment_id
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            logged = {**record["config"], **{k: record[k] for k in ("seed", "git", "versions", "precision")}}
            params = [Param(k, json.dumps(v)[:6000]) for k, v in logged.items()]  # MLflow's length limit
            self.client.log_batch(self.run_id, params=params)
        self.pending: list[Metric] = []

    def _has_run(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log(self, record: dict) -> None:
        now = int(time.time() * 1000)
        for name, value in record.items():
            if name not in ("step", "split"):
                self.pending.append(Metric(f"{record['split']}/{name}", value, now, record["step"]))

    def checkpointed(self, step: int) -> None:
        for start in range(0, len(self.pending), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=self.pending[start : start + 1000])
        self.pending.clear()

    def state(self) -> dict:
        return {"mlflow_run_id": self.run_id}

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
