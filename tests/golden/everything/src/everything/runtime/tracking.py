"""Machinery: the MLflow tracker, a local file store in <run_dir>/mlruns, or the server given by
--tracking-uri.

    mlflow ui --backend-store-uri runs/default/mlruns

MLflow keeps every value it is sent, so records reach it once a checkpoint covers them: a run
resumed after a crash continues the same MLflow run (its id is saved in every checkpoint) with
one value per step, sent from metrics.jsonl where the stopped process had not sent them. A start
killed before its first checkpoint leaves its MLflow run open: the next start closes it as
KILLED. Charts lag by at most --ckpt-every steps; metrics.jsonl has every record at once.
MLflow 3 has put its file store in maintenance mode; pass a database or server URI with
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
    PURGES = False  # MLflow keeps every value it is sent: none is sent twice

    def __init__(self, run_dir: Path, record: dict, resume: dict | None, earlier: dict | None = None) -> None:
        uri = record["config"]["tracking_uri"]
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        # A resumed run continues its MLflow run. So does a new start after one killed before its
        # first checkpoint (`earlier`: it sent MLflow its settings, no metrics) if they are the same;
        # if not, that run is closed as KILLED beside a new one.
        state = resume["state"] if resume else earlier or {}
        self.run_id = state.get("mlflow_run_id")
        if self.run_id is not None and not self._has_run(self.run_id):
            if resume:
                print(f"warning: MLflow run {self.run_id} is not in {uri}: continuing in a new MLflow run")
            self.run_id = None
        if resume is None and self.run_id is not None and not self._log_params(record):
            self.client.set_terminated(self.run_id, status=RunStatus.to_string(RunStatus.KILLED))
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
            self._log_params(record)
        self.pending: list[Metric] = []

    def _log_params(self, record: dict) -> bool:
        """Logs the run's settings; False where the MLflow run holds other values for them."""
        logged = {**record["config"], **{k: record[k] for k in ("seed", "git", "versions", "precision")}}
        params = [Param(k, json.dumps(v)[:6000]) for k, v in logged.items()]  # MLflow's length limit
        try:
            self.client.log_batch(self.run_id, params=params)
        except MlflowException:  # MLflow refuses to change a parameter
            return False
        return True

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
