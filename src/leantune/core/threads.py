"""CPU threads for the training step, chosen rather than inherited: one per physical core the
process may run on and other processes leave free, unless the user set OMP_NUM_THREADS.

A core that another busy process also wants is not worth a thread of its own: that thread runs
at half speed and every operator's barrier waits for it. So the count follows the load this
process finds (other processes' CPU use, `core.cpu_load`), measured at the start and re-measured
during the run (`ThreadGovernor`), and the threads wait passively (`core.openmp`).

The data path does not compete for them: rows are tokenized and packed before the first step,
and a step's batch is collated in the loop's own thread (`data_wait_s` in metrics.jsonl
measures it).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leantune.core.cpu_load import CpuSample, measure_others, others_busy, sample
from leantune.core.openmp import wait_policy_note, waits_passive

START_WINDOW_S = 0.25
"""How long the start measures other processes' CPU use (25 ticks a CPU at USER_HZ 100)."""
RECHECK_S = 10.0
"""How often the training loop re-measures it: long enough to average over a few steps."""
HYSTERESIS = 0.6
"""How far (in cores) the free CPUs must move from the current thread count to change it: a
load that hovers at a rounding boundary does not switch the count back and forth."""


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


@dataclass(frozen=True)
class CpuBudget:
    """What this process may use: logical CPUs in its affinity mask, a cgroup quota (CPUs, or
    None), and logical CPUs per physical core."""

    logical: int
    quota: float | None
    per_core: int

    def physical_cores(self, others: float = 0.0) -> float:
        """Physical cores' worth free for this process when other processes use `others` of
        its logical CPUs."""
        free = self.logical - others
        if self.quota is not None:  # a quota is this cgroup's own: others do not take from it
            free = min(free, self.quota)
        return max(0.0, free) / self.per_core


def cpu_budget() -> CpuBudget:
    """This process's `CpuBudget`, read now."""
    # The affinity mask, not os.cpu_count(): taskset and container cpusets narrow it.
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuBudget(logical or 1, _quota_cpus(), _threads_per_core())


def usable_physical_cores() -> int:
    """Physical cores this process may run on: its affinity mask, a cgroup CPU quota, and
    hyper-threads (two logical CPUs of one core share its matmul units) taken into account."""
    # Rounded down: a fractional core given a thread of its own oversubscribes.
    return max(1, math.floor(cpu_budget().physical_cores()))


def choose_threads(cores: int, free: float, current: int | None = None) -> int:
    """Threads for `cores` usable physical cores of which `free` are left by other processes:
    the free cores rounded (half a core free is worth a thread; a third is not), at least 1,
    at most `cores`. A `current` count is kept while `free` stays within `HYSTERESIS` of it."""
    if current is not None and abs(free - current) <= HYSTERESIS:
        return max(1, min(cores, current))
    return max(1, min(cores, math.floor(free + 0.5)))


def _contended(others: float | None, budget: CpuBudget, cores: int) -> bool:
    return others is not None and round(budget.physical_cores(others)) < cores


def configure_threads(
    environ: dict[str, str] | None = None,
    measure: Callable[[float], float | None] = measure_others,
) -> str:
    """Set torch's intra-op threads for a CPU run; the line that says how many and why
    (`measure(window_s)`: other processes' CPU use, `core.cpu_load.measure_others`)."""
    env = os.environ if environ is None else environ
    waits = wait_policy_note(env)
    # The user's (or torchrun's, which sets 1 per process when it starts several) count wins.
    if env.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        return f"threads: {n} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']}); OpenMP {waits}"
    # torch's default is the machine's CPU count, which under a quota or an affinity mask can be
    # far more than the process may use: threads then take turns on the cores and every OpenMP
    # barrier waits for one that is not running (a probe here ran 6x slower oversubscribed).
    budget = cpu_budget()
    cores = usable_physical_cores()
    others = measure(START_WINDOW_S) if cores > 1 else None  # one core: nothing to choose
    passive = waits_passive(env)
    # Passive waits: a thread whose core is taken sleeps at the barrier instead of holding the
    # others up, and what it does get adds up; measured beside busy cores, 2 passive threads
    # beat 1 by 1.4-2.2x (benchmarks/results/wait-policy-loaded-cpu.json). Spinning threads
    # stall every operator when one is descheduled: fewer of them, then.
    if others is None or passive:
        chosen = cores
    else:
        chosen = choose_threads(cores, budget.physical_cores(others))
    if torch.get_num_threads() != chosen:
        torch.set_num_threads(chosen)
    if _contended(others, budget, cores) and passive:
        return (
            f"threads: {chosen}, one per physical core: the machine is contended (other "
            f"processes use {others:.1f} of {budget.logical} CPUs), and OpenMP {waits}, so a "
            "thread whose core is taken yields it rather than stalling the others"
        )
    if _contended(others, budget, cores):
        return (
            f"threads: {chosen} of {cores} physical cores: the machine is contended (other "
            f"processes use {others:.1f} of {budget.logical} CPUs; re-checked every "
            f"{RECHECK_S:.0f} s); OpenMP {waits}"
        )
    return f"threads: {chosen}, one per physical core this process may use; OpenMP {waits}"


@dataclass
class ThreadGovernor:
    """Re-measures the load every `interval_s` during training and moves torch's thread count
    with it (`choose_threads`); `check()` after each step, a clock read until it is due."""

    cores: int
    budget: CpuBudget
    interval_s: float = RECHECK_S
    read: Callable[[], CpuSample | None] = sample
    clock: Callable[[], float] = time.monotonic
    _last: CpuSample | None = field(default=None, init=False)
    _at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._last, self._at = self.read(), self.clock()

    @classmethod
    def for_process(cls, environ: dict[str, str] | None = None) -> ThreadGovernor | None:
        """A governor for this process's CPU run; None when the count is not leantune's to
        change (OMP_NUM_THREADS set, torchrun included), there is one core, or the threads
        wait passively (their count then stays one per core)."""
        env = os.environ if environ is None else environ
        cores = usable_physical_cores()
        # Passive waits keep one thread per core whatever the load (`configure_threads`).
        if env.get("OMP_NUM_THREADS") or cores < 2 or waits_passive(env):
            return None
        return cls(cores, cpu_budget())

    def check(self) -> str | None:
        """Re-measure if due; the line that says what changed, or None."""
        now = self.clock()
        if now - self._at < self.interval_s:
            return None
        current_sample = self.read()
        before, self._last, self._at = self._last, current_sample, now
        if before is None or current_sample is None:
            return None
        others = others_busy(before, current_sample)
        if others is None:
            return None
        current = torch.get_num_threads()
        chosen = choose_threads(self.cores, self.budget.physical_cores(others), current)
        if chosen == current:
            return None
        torch.set_num_threads(chosen)
        state = "contended" if _contended(others, self.budget, self.cores) else "free again"
        return (
            f"threads: {current} -> {chosen} of {self.cores} physical cores: the machine is "
            f"{state} (other processes use {others:.1f} of {self.budget.logical} CPUs)"
        )
