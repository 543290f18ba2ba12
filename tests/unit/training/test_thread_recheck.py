"""The loop's re-check of the CPU load: a change of thread count is one line in the log and one
event in events.jsonl; no change, no line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from leantune.monitor.events import EventLog
from leantune.training import recipe


class _Governor:
    def __init__(self, notes: list[str | None]) -> None:
        self.notes = notes

    def check(self) -> str | None:
        return self.notes.pop(0)


def test_a_change_of_threads_is_one_logged_event(tmp_path: Path) -> None:
    lines: list[str] = []
    events = EventLog(tmp_path / "events.jsonl", lines.append)
    note = "threads: 2 -> 1 of 2 physical cores: the machine is contended (...)"
    tr = SimpleNamespace(
        threads=_Governor([None, note, None]), events=events, state=SimpleNamespace(step=3)
    )
    for _ in range(3):
        recipe._recheck_threads(tr)  # type: ignore[arg-type]
    assert lines == [f"[threads] step 3: {note}"]
    recorded = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["message"]) for e in recorded] == [("threads", note)]
    recipe._recheck_threads(SimpleNamespace(threads=None))  # type: ignore[arg-type]
