"""CPU threads for the training step, chosen rather than inherited: one per physical core the
process may run on, unless the user set OMP_NUM_THREADS.

The data path does not compete for them: rows are tokenized and packed before the first step,
and a step's batch is collated in the loop's own thread (`data_wait_s` in metrics.jsonl
measures it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def _quota_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs allowed by a cgroup v2 quota ("max" or unreadable: no quota)."""
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)  # fractional: 150000/100000 allows 1.5 CPUs


def _threads_per_core() -> int:
    try:
        import psutil

        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    except ImportError:  # optional: without it, every logical CPU counts as a core
        return 1
    if not logical or not physical:  # psutil answers None where it cannot tell
        return 1
    return max(1, logical // physical)


def usable_physical_cores() -> int:
    """Physical cores this process may run on: its affinity mask, a cgroup CPU quota, and
    hyper-threads (two logical CPUs of one core share its matmul units) taken into account."""
    # The affinity mask, not os.cpu_count(): taskset and container cpusets narrow it.
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    usable = float(logical or 1)
    quota = _quota_cpus()
    if quota is not None:
        usable = min(usable, quota)
    # Rounded down: a fractional core given a thread of its own oversubscribes.
    return max(1, math.floor(usable / _threads_per_core()))


def configure_threads(environ: dict[str, str] | None = None) -> str:
    """Set torch's intra-op threads for a CPU run; the line that says how many and why."""
    env = os.environ if environ is None else environ
    # The user's (or torchrun's, which sets 1 per process when it starts several) count wins.
    if env.get("OMP_NUM_THREADS"):
        return f"threads: {torch.get_num_threads()} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})"
    # torch's default is the machine's CPU count, which under a quota or an affinity mask can be
    # far more than the process may use: threads then take turns on the cores and every OpenMP
    # barrier waits for one that is not running (a probe here ran 6x slower oversubscribed).
    cores = usable_physical_cores()
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return f"threads: {cores}, one per physical core this process may use"
