"""CPU threads: one per usable physical core that other processes leave free, re-checked during
the run, unless OMP_NUM_THREADS says otherwise; the load read from fake /proc/stat counters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from leantune.core import threads
from leantune.core.cpu_load import CpuSample


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cgroup_quota_is_read(tmp_path: Path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert threads._quota_cpus(f) == 1.5
    f.write_text("max 100000\n")
    assert threads._quota_cpus(f) is None
    assert threads._quota_cpus(tmp_path / "missing") is None


def test_usable_cores_follow_affinity_quota_and_hyperthreads(monkeypatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(threads, "_quota_cpus", lambda: None)
    monkeypatch.setattr(threads, "_threads_per_core", lambda: 2)
    assert threads.usable_physical_cores() == 4
    monkeypatch.setattr(threads, "_quota_cpus", lambda: 3.0)  # docker --cpus=3
    assert threads.usable_physical_cores() == 1
    monkeypatch.setattr(threads, "_threads_per_core", lambda: 1)
    assert threads.usable_physical_cores() == 3
    monkeypatch.setattr(threads, "_quota_cpus", lambda: 0.5)
    assert threads.usable_physical_cores() == 1


def test_configure_threads_sets_torch_and_respects_omp(monkeypatch) -> None:
    monkeypatch.setattr(threads, "usable_physical_cores", lambda: 1)
    torch.set_num_threads(2)
    line = threads.configure_threads({}, measure=_never_measured)
    assert torch.get_num_threads() == 1
    assert line == (
        "threads: 1, one per physical core this process may use; OpenMP waits spinning "
        "(libgomp's default; OMP_WAIT_POLICY=PASSIVE before torch loads)"
    )
    torch.set_num_threads(2)
    line = threads.configure_threads({"OMP_NUM_THREADS": "2"}, measure=_never_measured)
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS=2" in line


def _never_measured(window_s: float) -> float | None:
    raise AssertionError("the load is not measured where there is nothing to choose")


def _two_cores(monkeypatch, quota: float | None = None) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_quota_cpus", lambda: quota)
    monkeypatch.setattr(threads, "_threads_per_core", lambda: 1)


@pytest.mark.parametrize(
    ("cores", "free", "current", "chosen"),
    [
        (2, 2.0, None, 2),  # idle
        (2, 1.0, None, 1),  # beside one busy core
        (2, 1.6, None, 2),  # light load: half a core free is worth a thread
        (2, 1.3, None, 1),
        (2, 0.0, None, 1),  # never none
        (4, 9.0, None, 4),  # never more than the cores
        (2, 1.33, 2, 1),  # 2 threads beside a busy core measure it at 2/3 of a core: lower
        (2, 1.5, 2, 2),  # within the hysteresis of the current count: kept
        (2, 1.5, 1, 1),
        (2, 1.7, 1, 2),  # the other process is gone: raised again
        (8, 3.9, 6, 4),
    ],
)
def test_the_count_follows_the_free_cores(
    cores: int, free: float, current: int | None, chosen: int
) -> None:
    assert threads.choose_threads(cores, free, current) == chosen


def test_the_free_cores_count_affinity_quota_hyperthreads_and_others() -> None:
    assert threads.CpuBudget(8, None, 2).physical_cores(2.0) == 3.0
    # A quota is the cgroup's own: busy processes elsewhere on the machine leave it whole.
    assert threads.CpuBudget(16, 2.0, 1).physical_cores(8.0) == 2.0
    assert threads.CpuBudget(2, None, 1).physical_cores(3.0) == 0.0


def test_a_contended_start_takes_fewer_threads_and_says_so(monkeypatch) -> None:
    _two_cores(monkeypatch)
    windows: list[float] = []

    def beside_one_busy_core(window_s: float) -> float:
        windows.append(window_s)
        return 1.0

    torch.set_num_threads(2)
    line = threads.configure_threads({}, measure=beside_one_busy_core)
    assert torch.get_num_threads() == 1 and windows == [threads.START_WINDOW_S]
    assert line.startswith(
        "threads: 1 of 2 physical cores: the machine is contended (other processes use 1.0 of "
        "2 CPUs; re-checked every 10 s); OpenMP waits"
    )
    line = threads.configure_threads({}, measure=lambda s: 0.2)
    assert torch.get_num_threads() == 2
    assert line.startswith("threads: 2, one per physical core this process may use")
    line = threads.configure_threads({}, measure=lambda s: None)  # no /proc/stat
    assert torch.get_num_threads() == 2 and "contended" not in line


def test_passive_waits_keep_one_thread_per_core_when_contended(monkeypatch) -> None:
    """Measured beside busy cores, 2 passive threads beat 1 by 1.4-2.2x: a thread whose core is
    taken sleeps at the barrier instead of stalling the others, so the count is not lowered."""
    _two_cores(monkeypatch)
    torch.set_num_threads(1)
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    line = threads.configure_threads(passive, measure=lambda s: 1.0)
    assert torch.get_num_threads() == 2
    assert line.startswith(
        "threads: 2, one per physical core: the machine is contended (other processes use 1.0 "
        "of 2 CPUs), and OpenMP waits as you set (OMP_WAIT_POLICY=PASSIVE)"
    )
    assert threads.ThreadGovernor.for_process(passive) is None  # nothing to move with the load
    line = threads.configure_threads({"OMP_WAIT_POLICY": "ACTIVE"}, measure=lambda s: 1.0)
    assert torch.get_num_threads() == 1 and "1 of 2 physical cores" in line  # spinning: fewer


class _FakeMachine:
    """/proc/stat and the clock of a 2-CPU machine: `run(seconds, others, own)` advances them
    as if other processes kept `others` CPUs busy and this one used `own` CPUs."""

    def __init__(self) -> None:
        self.now, self.busy, self.total, self.own = 0.0, 0, 0, 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        self.now += seconds
        self.total += round(2 * seconds * hz)
        self.busy += round((others + own) * seconds * hz)
        self.own += own * seconds

    def read(self) -> CpuSample:
        return CpuSample(self.busy, self.total, self.own, 2)


def test_the_governor_follows_the_load_during_the_run(monkeypatch) -> None:
    _two_cores(monkeypatch)
    machine = _FakeMachine()
    torch.set_num_threads(2)
    gov = threads.ThreadGovernor(
        2, threads.cpu_budget(), read=machine.read, clock=lambda: machine.now
    )
    machine.run(5, others=0.0, own=2.0)
    assert gov.check() is None  # not due: nothing read
    machine.run(6, others=0.0, own=2.0)
    assert gov.check() is None and torch.get_num_threads() == 2  # due, idle: kept
    # A busy process starts: beside 2 threads it gets 2/3 of a core.
    machine.run(11, others=0.67, own=1.33)
    line = gov.check()
    assert torch.get_num_threads() == 1
    assert line == (
        "threads: 2 -> 1 of 2 physical cores: the machine is contended (other processes use "
        "0.7 of 2 CPUs)"
    )
    machine.run(11, others=1.0, own=1.0)
    assert gov.check() is None and torch.get_num_threads() == 1  # stays: no flapping
    machine.run(11, others=0.05, own=1.0)
    assert gov.check() == (
        "threads: 1 -> 2 of 2 physical cores: the machine is free again (other processes use "
        "0.1 of 2 CPUs)"
    )
    assert torch.get_num_threads() == 2


def test_no_governor_where_the_count_is_the_users(monkeypatch) -> None:
    _two_cores(monkeypatch)
    assert threads.ThreadGovernor.for_process({"OMP_NUM_THREADS": "2"}) is None
    assert threads.ThreadGovernor.for_process({}) is not None
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0})
    assert threads.ThreadGovernor.for_process({}) is None  # one core: nothing to choose
