"""MLflow: one MLflow run per leantune run, in `experiment` at the tracking URI.

Each metrics record is logged as the metrics `train/<field>`, each periodic evaluation as
`eval/<field>`, each event as the counter `events/<kind>` (how many of that kind so far), at
the record's step; the resolved config is the run's parameters (`section.field`), and the
events are the artifact `events.jsonl` when the run ends. The run ends FINISHED, or KILLED
after a guard pause or stop or a signal, or FAILED, with the tag `leantune.outcome`. The
MLflow run id is kept in <run dir>/monitor_runs.json, so a resumed run goes on logging to the
same MLflow run.

After a rollback (`start(step)` with a smaller step) the steps after `step` are logged again:
MLflow keeps every value of a metric, so its history holds both attempts at those steps (in
the order logged); metrics.jsonl holds the one trajectory.

A `file:` URI (or a plain path) is a local store that needs no server.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from leantune.layout import RunPaths
from leantune.monitor.events import read_events
from leantune.monitor.records import (
    EventCounts,
    Record,
    flat_config,
    numeric_fields,
    outcome,
    remember_id,
    remembered_id,
)

PARAM_LIMIT = 6000
"""Longest parameter value MLflow stores (characters)."""
BATCH = 100
"""Most parameters MLflow takes in one log_batch call."""


def _is_file_store(uri: str) -> bool:
    # A plain path has no scheme; "databricks" (or "databricks-uc") has none either, but is remote.
    return uri.startswith("file:") or ("://" not in uri and not uri.startswith("databricks"))


class MlflowSink:
    """Logs the run's records to one MLflow run, opened at the first `start()`."""

    def __init__(
        self, run_dir: Path, config: dict[str, Any], *, uri: str, experiment: str, name: str
    ):
        self.run_dir = run_dir
        self.config = config
        self.uri, self.experiment, self.name = uri, experiment, name
        self.counts = EventCounts(read_events(RunPaths(run_dir).events))
        self.events: list[Record] = []
        self._client: MlflowClient | None = None
        self._run_id: str | None = None
        self._closed = False

    def start(self, step: int) -> None:
        if self._run_id is None:
            self._open()
            for event in self.events:  # those emitted before the loop began
                self._log_event(event)

    def _open(self) -> None:
        if _is_file_store(self.uri):
            # MLflow 3 refuses a file store unless this is set; a user's own setting wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=self.uri)
        run_id = remembered_id(self.run_dir, "mlflow")
        logged: dict[str, str] = {}
        if run_id is not None:
            run = client.get_run(run_id)
            logged = dict(run.data.params)
            # The earlier attempt's close() ended it (KILLED or FAILED); it runs again.
            client.update_run(run_id, status="RUNNING")
        else:
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment)
            )
            run_id = client.create_run(experiment_id, run_name=self.name).info.run_id
            remember_id(self.run_dir, "mlflow", run_id)
        self._client, self._run_id = client, run_id
        self._log_params(logged)

    def _log_params(self, logged: dict[str, str]) -> None:
        """The config as parameters; on a resume only new ones (MLflow refuses a changed
        value), and a changed one as the tag `changed.<key>`."""
        assert self._client is not None and self._run_id is not None
        params, tags = [], []
        for key, value in flat_config(self.config).items():
            # Cut rather than refused: one value too long would fail the whole batch.
            text = str(value)[:PARAM_LIMIT]
            if key not in logged:
                params.append(Param(key, text))
            elif logged[key] != text:
                tags.append(RunTag(f"changed.{key}", text))
        # One loop for both lists: a slice past a list's end is empty.
        for i in range(0, max(len(params), len(tags)), BATCH):
            batch = slice(i, i + BATCH)
            self._client.log_batch(self._run_id, params=params[batch], tags=tags[batch])

    def _log(self, values: dict[str, float], step: int) -> None:
        assert self._client is not None and self._run_id is not None, "start() first"
        now = int(time.time() * 1000)  # MLflow timestamps are milliseconds
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def metrics(self, record: Record) -> None:
        values = {f"train/{k}": v for k, v in numeric_fields(record).items()}
        self._log(values, int(record["step"]))

    def eval(self, row: Record) -> None:
        values = {f"eval/{k.removeprefix('eval_')}": v for k, v in numeric_fields(row).items()}
        self._log(values, int(row["step"]))

    def event(self, event: Record) -> None:
        if self._closed:
            return  # the closing evaluation's events: the loop's records have ended
        self.events.append(event)
        if self._run_id is not None:
            self._log_event(event)

    def _log_event(self, event: Record) -> None:
        kind = str(event.get("kind"))
        self._log({f"events/{kind}": float(self.counts.add(event))}, int(event.get("step", 0)))

    def close(self) -> None:
        name, code = outcome()
        self._closed = True
        if self._client is None or self._run_id is None:
            return
        client, run_id = self._client, self._run_id
        events = RunPaths(self.run_dir).events
        if events.is_file():  # every event of the run, also those of earlier attempts
            client.log_artifact(run_id, str(events))
        client.set_tag(run_id, "leantune.outcome", name)
        # KILLED for every outcome OUTCOMES names (a pause, a guard stop, out of memory at the
        # minimum, a signal): stopped on purpose, with a message; FAILED for the rest, a crash.
        status = "FINISHED" if code == 0 else "FAILED" if name == "failed" else "KILLED"
        client.set_terminated(run_id, status)
        self._client = self._run_id = None
