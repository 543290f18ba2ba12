"""TensorBoard: event files under <run dir>/tensorboard (`tensorboard --logdir <run dir>`).

Scalars: `train/<field>` for each numeric field of a metrics record, `eval/<field>` for each
periodic evaluation, `events/<kind>` (how many of that kind so far) for each event, at the
record's step; each event's message is also text under `events`. The resolved config is
logged once, as hyper-parameters (the HPARAMS tab) and as text (`config`). After a rollback
or resume the curves show the one trajectory that metrics.jsonl holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from leantune.layout import RunPaths
from leantune.monitor.events import read_events
from leantune.monitor.records import EventCounts, Record, flat_config, numeric_fields, outcome


@dataclass
class _Logged:
    """An event of the run, its count among its kind, and whether the open writer has it."""

    event: Record
    count: int
    written: bool


class TensorBoardSink:
    """Writes the run's records as TensorBoard scalars and text."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.log_dir = RunPaths(run_dir).tensorboard
        self.config = config
        counts = EventCounts()
        # Every event of the run with its count, and whether this writer has it: a purge at a
        # restart also removes the events beyond it, which (unlike the metrics) still stand.
        events = read_events(RunPaths(run_dir).events)
        self._events = [_Logged(e, counts.add(e), True) for e in events]
        self._counts = counts
        self._writer: SummaryWriter | None = None
        self._closed = False

    def start(self, step: int) -> None:
        first = self._writer is None
        if self._writer is not None:
            self._writer.close()
        # A rollback or resume opens a new event file with a purge at step + 1: TensorBoard then
        # drops what the earlier attempt wrote beyond `step`. A fresh run's first start has
        # nothing to purge; any later start does, even back to step 0.
        purge = step + 1 if step or not first else None
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge)
        if first:
            self._log_config()
        # Events the purge just removed are written again: unlike metrics, they still stand.
        for item in self._events:
            if not item.written or (purge is not None and int(item.event.get("step", 0)) >= purge):
                self._write_event(item.event, item.count)
                item.written = True

    def _log_config(self) -> None:
        assert self._writer is not None and self._writer.file_writer is not None
        # Through the file writer: SummaryWriter.add_hparams would put them in a sub-run of
        # their own, apart from this run's scalars.
        for summary in hparams(flat_config(self.config), {}):
            self._writer.file_writer.add_summary(summary)
        text = yaml.safe_dump(self.config, sort_keys=False)
        # Text is rendered as Markdown: the fence keeps the YAML's indentation.
        self._writer.add_text("config", "```\n" + text + "```")

    def metrics(self, record: Record) -> None:
        assert self._writer is not None, "start() first"
        step = int(record["step"])
        for key, value in numeric_fields(record).items():
            self._writer.add_scalar(f"train/{key}", value, step)

    def eval(self, row: Record) -> None:
        assert self._writer is not None, "start() first"
        step = int(row["step"])
        for key, value in numeric_fields(row).items():
            # `eval/loss`, not `eval/eval_loss`: the section already says it.
            self._writer.add_scalar(f"eval/{key.removeprefix('eval_')}", value, step)

    def event(self, event: Record) -> None:
        if self._closed:
            return  # the closing evaluation's events: the loop's records have ended
        count = self._counts.add(event)
        # One before the first start() is written when that opens the writer.
        self._events.append(_Logged(event, count, self._writer is not None))
        if self._writer is not None:
            self._write_event(event, count)

    def _write_event(self, event: Record, count: int) -> None:
        assert self._writer is not None
        step, kind = int(event.get("step", 0)), str(event.get("kind"))
        self._writer.add_scalar(f"events/{kind}", count, step)
        self._writer.add_text("events", f"**{kind}** (step {step}): {event.get('message')}", step)

    def close(self) -> None:
        name, code = outcome()
        if self._writer is not None:
            self._writer.add_text("outcome", f"{name} (exit code {code})")
            self._writer.close()  # flushes
        self._closed = True
