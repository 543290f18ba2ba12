"""Weights & Biases: one W&B run per leantune run; its files live under <run dir>/wandb.

Each metrics record is logged as `train/<field>`, each periodic evaluation as
`eval/<field>`, each event as the counter `events/<kind>` (how many of that kind so far), all
against the step metric `train/step`; the events also go, as a table, into the run's history
when it closes. The resolved config is the W&B run's config. The W&B run id is kept in
<run dir>/monitor_runs.json, so a resumed run goes on logging to the same W&B run.

After a rollback (`start(step)` with a smaller step) the steps after `step` are logged again;
the rolled-back attempt's points stay, and the `events/rollback` counter marks where it
happened. metrics.jsonl holds the one trajectory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wandb

from leantune.layout import RunPaths
from leantune.monitor.events import read_events
from leantune.monitor.records import (
    EventCounts,
    Record,
    numeric_fields,
    outcome,
    remember_id,
    remembered_id,
)

STEP = "train/step"
EVENT_COLUMNS: list[str | int] = ["time", "step", "kind", "message"]


class WandbSink:
    """Logs the run's records to one W&B run, opened at the first `start()`."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        project: str,
        name: str,
        entity: str | None = None,
        mode: str | None = None,
    ):
        self.run_dir = run_dir
        self.config = config
        self.project, self.name, self.entity, self.mode = project, name, entity, mode
        self.counts = EventCounts(read_events(RunPaths(run_dir).events))
        self.events: list[Record] = []
        self._run: Any = None
        self._closed = False

    def start(self, step: int) -> None:
        if self._run is None:
            self._run = self._open()
            for event in self.events:  # those emitted before the loop began
                self._log_event(event)

    def _open(self) -> Any:
        run_id = remembered_id(self.run_dir, "wandb")
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name,
            mode=self.mode,  # type: ignore[arg-type]
            dir=str(self.run_dir),
            config=self.config,
            id=run_id,
            # "allow": continue the remembered run if W&B still has it, else start that id anew.
            resume="allow" if run_id else None,
            # Never hand back (or finish) another W&B run this process has open.
            settings=wandb.Settings(reinit="create_new"),
        )
        # A disabled run's id is a stand-in with nothing behind it to continue.
        if self.mode != "disabled" and run.id and run.id != run_id:  # no run to continue
            remember_id(self.run_dir, "wandb", run.id)
        # W&B's own `_step` must only increase, so a rollback's repeated steps cannot reuse it:
        # everything is plotted against train/step instead.
        run.define_metric(STEP)
        for prefix in ("train", "eval", "events"):
            run.define_metric(f"{prefix}/*", step_metric=STEP)
        return run

    def metrics(self, record: Record) -> None:
        assert self._run is not None, "start() first"
        values = {f"train/{k}": v for k, v in numeric_fields(record).items()}
        self._run.log({**values, STEP: int(record["step"])})

    def eval(self, row: Record) -> None:
        assert self._run is not None, "start() first"
        values = {f"eval/{k.removeprefix('eval_')}": v for k, v in numeric_fields(row).items()}
        self._run.log({**values, STEP: int(row["step"])})

    def event(self, event: Record) -> None:
        if self._closed:
            return  # the closing evaluation's events: the loop's records have ended
        self.events.append(event)
        if self._run is not None:
            self._log_event(event)

    def _log_event(self, event: Record) -> None:
        kind = str(event.get("kind"))
        # The count since the run began (earlier attempts' events included), so the counter
        # goes on where a resumed W&B run left it.
        self._run.log({f"events/{kind}": self.counts.add(event), STEP: int(event.get("step", 0))})

    def close(self) -> None:
        name, code = outcome()
        self._closed = True
        if self._run is None:
            return
        if self.events:
            rows = [
                [e.get("time"), e.get("step"), str(e.get("kind")), str(e.get("message"))]
                for e in self.events
            ]
            self._run.log({"events/table": wandb.Table(columns=EVENT_COLUMNS, data=rows)})
        self._run.summary["outcome"] = name
        self._run.finish(exit_code=code)
        self._run = None
