"""Where a run stands, from its directory alone: running, paused, stopped, finished.

- running: a process holds the run's lock (`training.run.rundir`: an flock on `.leantune.lock`),
  read from `/proc/locks` on Linux, else by trying a non-blocking shared lock.
- paused: the guard's `PAUSED` marker (its reason is the marker's).
- stopped (the guard, or weights gone NaN/inf), interrupted (SIGTERM/SIGINT) or out of memory
  (at micro-batch 1): the last `stop`/`signal`/`oom` event of `events.jsonl`, its message the
  exit reason, unless the run wrote later steps since (it was resumed).
- finished: `summary.json` covers the last step (a run resumed after it is judged by the rest).
- incomplete: steps but none of the above: killed (SIGKILL, a crash), or copied while it ran.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.layout import RunPaths

PROC_LOCKS = Path("/proc/locks")
# Events after which the process ended; an `oom` event with a new micro-batch size is a
# recovery, not an end.
ENDING_KINDS = {"stop": "stopped", "signal": "interrupted", "oom": "out_of_memory"}


@dataclass(frozen=True)
class RunStatus:
    """A run's state and why it is in it."""

    state: str
    """running, paused, stopped, interrupted, out_of_memory, finished, incomplete or new."""
    reason: str
    """The exit reason (the event's or marker's message), or what the state means."""
    pid: int | None = None
    """The process that holds the lock, while running."""


def lock_holder(run_dir: Path) -> int | None:
    """The pid holding the run's lock (0 when held by a process whose pid is unknown), or None
    when no process holds it."""
    lock = RunPaths(run_dir).lock
    try:
        st = lock.stat()
    except OSError:
        return None
    # The kernel's table of locks says who holds it without touching the lock, so the dashboard
    # can never make a starting `leantune train` believe the directory is in use.
    try:
        table = PROC_LOCKS.read_text(encoding="ascii", errors="replace")
    except OSError:
        return _probe_lock(lock)
    # /proc/locks names a file as major:minor (hex) and inode (decimal).
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146746 0 EOF" (a blocked waiter adds "->")
        fields = line.split()
        if "->" not in fields and len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == dev:
            return int(fields[4]) if fields[4].isdigit() else 0
    return None


def _probe_lock(lock: Path) -> int | None:
    """Without /proc/locks: try a shared lock and let it go at once."""
    # Non-blocking, so a running run never stalls the poll; a train starting in the instant the
    # probe holds its lock would find the directory in use, hence /proc/locks first.
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        # The holder wrote its pid into the lock file (`training.run.rundir`).
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else 0
    finally:
        os.close(fd)  # also releases the probe's lock
    return None


def run_status(
    run_dir: Path,
    events: list[dict[str, Any]],
    last_step: int | None,
    summary: dict[str, Any] | None,
) -> RunStatus:
    """The state of the run in `run_dir`.

    Args:
        run_dir: The run directory.
        events: Its `events.jsonl` rows, in order.
        last_step: The last step of its `metrics.jsonl` (None: none yet).
        summary: Its `summary.json`, when there is one.
    """
    # The lock first: a running process outranks every file a previous attempt left behind.
    pid = lock_holder(run_dir)
    if pid is not None:
        return RunStatus("running", "training" + (f" (pid {pid})" if pid else ""), pid)
    marker = _paused(RunPaths(run_dir).paused)
    if marker is not None:
        return RunStatus("paused", marker)
    done = last_step or 0
    ending = _last_ending(events)
    summary_steps = summary.get("steps") if summary else None
    finished_at = summary_steps if isinstance(summary_steps, int) else None
    at = ending["step"] if ending is not None and isinstance(ending.get("step"), int) else 0
    # An ending counts unless the run wrote steps after it, or finished after it.
    if ending is not None and at >= done and (finished_at is None or at > finished_at):
        kind = str(ending["kind"])
        return RunStatus(ENDING_KINDS[kind], str(ending.get("message", kind)))
    if finished_at is not None and finished_at >= done:
        return RunStatus("finished", f"finished after {finished_at} steps")
    if last_step is None:
        return RunStatus("new", "no step recorded yet")
    return RunStatus(
        "incomplete", "not running and no exit recorded (killed, crashed, or copied mid-run)"
    )


def _paused(marker: Path) -> str | None:
    """The pause reason of a `PAUSED` marker, or None without one."""
    try:
        text = marker.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:  # it exists, so the run is paused even if its reason cannot be read
        return "paused (the PAUSED marker cannot be read)"
    with contextlib.suppress(ValueError):
        info = json.loads(text)
        if isinstance(info, dict) and info.get("reason"):
            return f"paused at step {info.get('step', '?')}: {info['reason']}"
    return "paused (the PAUSED marker holds no reason)"


def _last_ending(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last event that ended the process, unless a `resume` event follows it."""
    for event in reversed(events):
        kind = event.get("kind")
        if not isinstance(kind, str):  # a damaged row (events.jsonl is not the user's file)
            continue
        if kind == "resume":
            return None
        if kind in ENDING_KINDS and not (kind == "oom" and "micro_batch_size" in event):
            return event
    return None
