"""What the guard and the OOM recovery decided: ``events.jsonl``, the console, and exit codes.

Every decision is one JSON object appended to ``run_dir/events.jsonl`` and one line on the
console. A run that has to stop raises a :class:`TrainingHalted` subclass whose
``exit_code`` the CLI returns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantune.core.writes import append_text

EXIT_PAUSED = 3
"""The guard paused the run (``PAUSED`` marker in the run dir); ``leantune train`` resumes it."""
EXIT_GUARD_STOPPED = 4
"""The guard stopped the run: too many consecutive skips or rollbacks (a checkpoint was saved)."""
EXIT_OUT_OF_MEMORY = 5
"""Out of memory at micro-batch size 1: the run needs another lever (see the message)."""
EXIT_SIGINT = 130
"""SIGINT (Ctrl-C); during training after a checkpoint of the last applied step."""
EXIT_SIGTERM = 143
"""SIGTERM; during training after a checkpoint of the last applied step."""
EXIT_SIGHUP = 129
"""SIGHUP (the terminal hung up, e.g. a dropped ssh session); as SIGTERM."""


class TrainingHalted(RuntimeError):
    """Training stopped on purpose; the message says why and what to do next."""

    exit_code = 1


class TrainingPaused(TrainingHalted):
    """The guard paused the run after saving a checkpoint."""

    exit_code = EXIT_PAUSED


class TrainingStopped(TrainingHalted):
    """The guard gave up on the run after saving a checkpoint."""

    exit_code = EXIT_GUARD_STOPPED


class OutOfMemoryAtMinimum(TrainingHalted):
    """A micro-batch of one sequence does not fit."""

    exit_code = EXIT_OUT_OF_MEMORY


class EventLog:
    """Appends events to ``events.jsonl`` and echoes them to the console (`path` None: echoes
    only, as on the ranks of a distributed run other than the main one, which owns the file)."""

    def __init__(self, path: Path | None, log: Callable[[str], None]):
        self.path = path
        self.log = log
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each event after it is written (the run's sinks)."""

    def emit(self, kind: str, step: int, message: str, **fields: Any) -> dict[str, Any]:
        """Record one event.

        Args:
            kind: What happened (``nonfinite``, ``loss_spike``, ``grad_norm``, ``oom``,
                ``oom_eval``, ``rollback``, ``pause``, ``stop``, ``resume``, ``threads``).
            step: The optimizer step it concerns (1-based; the step being computed).
            message: One sentence for the console.
            **fields: JSON-serialisable details.
        """
        event = {"time": round(time.time(), 3), "step": step, "kind": kind, "message": message}
        event.update(fields)
        if self.path is not None:
            # Appended, never truncated (unlike metrics.jsonl on resume): the file also keeps
            # the decisions of attempts that were later rolled back or resumed over.
            append_text(self.path, json.dumps(event) + "\n")
        self.log(f"[{kind}] step {step}: {message}")
        # Listeners last: a sink that fails cannot cost the event its line in the file.
        for listener in self.listeners:
            listener(event)
        return event


def lift_pause(marker: Path, events: EventLog, step: int, log: Callable[[str], None]) -> None:
    """Resume a paused run: record why it was paused (a ``resume`` event), remove the marker.

    A marker that is not a JSON object (hand-edited, truncated) is reported and removed.
    """
    if not marker.is_file():
        return
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = None
    if isinstance(info, dict):
        reason = str(info.get("reason", ""))
    else:
        # Resumed anyway: the checkpoint, not the marker, holds the run's state.
        reason = "unknown"
        log(f"warning: {marker} is not a pause record (a JSON object); resuming anyway")
    marker.unlink(missing_ok=True)
    # `step` is the checkpoint's last applied step; events name the step being computed.
    events.emit("resume", step + 1, f"resuming a paused run (paused for: {reason})")


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of an ``events.jsonl`` (none when the file does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
