"""What every monitoring backend does alike: numeric fields, a flat config, event counts, the
run's outcome, and the backend run ids a resume continues."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from leantune.core.signals import SIGNALS
from leantune.core.writes import write_file
from leantune.layout import RunPaths
from leantune.monitor.events import EXIT_GUARD_STOPPED, EXIT_OUT_OF_MEMORY, EXIT_PAUSED

Record = dict[str, Any]

# The CLI's exit codes as the names the backends show; anything else failed. Built from the
# codes' owners, so a stop signal `train` learns to handle is never reported as a failure.
OUTCOMES = {
    0: "finished",
    EXIT_PAUSED: "paused",
    EXIT_GUARD_STOPPED: "stopped",
    EXIT_OUT_OF_MEMORY: "out_of_memory",
    **{128 + int(signum): "interrupted" for signum in SIGNALS},  # the shell's 128 + signal
}


def numeric_fields(record: Record, skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The record's numbers (booleans as 0/1); strings, lists and `skip` are left out."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in skip and isinstance(v, (int, float))  # bool is an int
    }


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """`section.field` -> value, nested sections flattened; None and lists as text."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:  # the backends take only scalars as parameters
            flat[name] = json.dumps(value)
    return flat


class EventCounts:
    """Events by kind since the run began: those given (events.jsonl, which a resume keeps),
    then each one added."""

    def __init__(self, events: Iterable[Record] = ()) -> None:
        self.counts: Counter[str] = Counter()
        for event in events:
            self.add(event)

    def add(self, event: Record) -> int:
        """Count `event`; returns how many of its kind there have been."""
        kind = str(event.get("kind"))
        self.counts[kind] += 1
        return self.counts[kind]


def outcome() -> tuple[str, int]:
    """How the run's loop ended, for a sink's `close()`: (name, exit code).

    Only meaningful when called from the loop's `finally`.
    """
    # `close()` runs in the loop's `finally`, so the exception on its way out (a guard pause or
    # stop, a signal, a crash), if any, is the one sys.exc_info holds; its exit_code is the CLI's.
    exc = sys.exc_info()[1]
    if exc is None:
        return "finished", 0
    # An exception without an int exit_code (a crash) exits 1, as the CLI does.
    code = getattr(exc, "exit_code", 1)
    code = code if isinstance(code, int) else 1
    return OUTCOMES.get(code, "failed"), code


def remembered_id(run_dir: Path, backend: str) -> str | None:
    """The backend's run id recorded by an earlier attempt of this run, if any."""
    try:
        ids = json.loads(RunPaths(run_dir).monitor_ids.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = ids.get(backend) if isinstance(ids, dict) else None
    return value if isinstance(value, str) else None


def remember_id(run_dir: Path, backend: str, run_id: str) -> None:
    """Record the backend's run id for the next attempt (resume) of this run."""
    path = RunPaths(run_dir).monitor_ids
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: the other backends' ids are lost
        ids = {}
    ids = ids if isinstance(ids, dict) else {}
    ids[backend] = run_id
    write_file(path, json.dumps(ids, indent=2) + "\n")
