"""How much of this process's CPUs other processes are using: the busy time of those CPUs in
/proc/stat minus this process's own CPU time, over a window.

Not the load average: it lags by a minute, counts this process's own threads, and counts
processes waiting on the disk. Torch-free and cheap (two small file reads): the training loop
re-measures every few seconds (`core.threads.ThreadGovernor`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

STAT = Path("/proc/stat")
# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal (guest time is
# already in user). Idle and iowait are free for this process; steal (the hypervisor ran
# someone else) is not.
_IDLE_COLUMNS = (3, 4)
_COLUMNS = 8


@dataclass(frozen=True)
class CpuSample:
    """Counters at one instant: ticks (1/USER_HZ s) the CPUs were busy and in all, summed over
    the CPUs sampled, and this process's own CPU seconds (all its threads)."""

    busy_ticks: int
    total_ticks: int
    own_s: float
    cpus: int


def cpu_ticks(text: str, cpus: set[int] | None) -> tuple[int, int, int]:
    """(busy, total, CPUs counted) from /proc/stat's text, over `cpus` (None: all of them)."""
    busy = total = counted = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        # "cpu" alone is the sum of all; "cpu3" is one CPU.
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()[:_COLUMNS]]
        all_ticks = sum(fields)
        total += all_ticks
        busy += all_ticks - sum(fields[i] for i in _IDLE_COLUMNS if i < len(fields))
        counted += 1
    return busy, total, counted


def sample(stat: Path = STAT, cpus: set[int] | None = None) -> CpuSample | None:
    """The counters now; None where /proc/stat cannot be read (not Linux)."""
    if cpus is None and hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)  # the CPUs this process may run on, not all of them
    try:
        busy, total, counted = cpu_ticks(stat.read_text(), cpus)
    except (OSError, ValueError):
        return None
    times = os.times()
    return CpuSample(busy, total, times.user + times.system, counted)


def others_busy(before: CpuSample, after: CpuSample) -> float | None:
    """CPUs' worth of time other processes used between the samples (0.0 to the CPUs sampled);
    None when the window is too short to tell (under 2 ticks a CPU)."""
    ticks = after.total_ticks - before.total_ticks
    if after.cpus < 1 or ticks < 2 * after.cpus:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    elapsed = ticks / after.cpus / hz  # wall seconds, from the CPUs' own clocks
    busy = (after.busy_ticks - before.busy_ticks) / hz
    others = (busy - (after.own_s - before.own_s)) / elapsed
    return min(float(after.cpus), max(0.0, others))


def measure_others(window_s: float, stat: Path = STAT) -> float | None:
    """Other processes' CPU use over the next `window_s` seconds (this thread sleeps)."""
    before = sample(stat)
    if before is None:
        return None
    time.sleep(window_s)
    after = sample(stat)
    return None if after is None else others_busy(before, after)


CONTENDED_CPUS = 0.5
"""Other processes' CPU use from which a start counts as contended (half a CPU or more)."""


def machine_contended(window_s: float = 0.25) -> bool:
    """Whether other processes use `CONTENDED_CPUS` or more of this process's CPUs now
    (measured over `window_s`; a single CPU, OMP_NUM_THREADS=1 or no /proc/stat: not)."""
    # One CPU, or one thread asked for: no thread waits for another at a barrier.
    if len(os.sched_getaffinity(0)) < 2 or os.environ.get("OMP_NUM_THREADS") == "1":
        return False
    others = measure_others(window_s)
    return others is not None and others >= CONTENDED_CPUS
