"""Other processes' CPU use, read from /proc/stat counters (fakes) minus this process's own."""

from __future__ import annotations

import os
from pathlib import Path

from leantune.core import cpu_load
from leantune.core.cpu_load import CpuSample, cpu_ticks, others_busy

STAT = """cpu  300 0 100 500 20 0 0 0 0 0
cpu0 100 0 50 300 10 0 0 0 0 0
cpu1 200 0 50 200 10 0 0 5 0 0
intr 12345 0 0
ctxt 999
"""


def test_the_busy_ticks_leave_out_idle_and_iowait_and_count_steal() -> None:
    # cpu0: 100+50 busy of 460; cpu1: 200+50+5 (steal) busy of 465.
    assert cpu_ticks(STAT, None) == (405, 925, 2)
    assert cpu_ticks(STAT, {1}) == (255, 465, 1)  # the affinity mask's CPUs only


def test_a_sample_reads_the_file_and_this_process_times(tmp_path: Path) -> None:
    f = tmp_path / "stat"
    f.write_text(STAT)
    s = cpu_load.sample(f, {0})
    assert s is not None and (s.busy_ticks, s.total_ticks, s.cpus) == (150, 460, 1)
    assert s.own_s > 0
    assert cpu_load.sample(tmp_path / "missing") is None


def test_others_are_the_busy_time_minus_this_process() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = CpuSample(0, 0, 10.0, 2)
    # 4 s on 2 CPUs: 6 CPU-seconds busy, 2 of them this process's: others kept 1 CPU busy.
    after = CpuSample(6 * hz, 8 * hz, 12.0, 2)
    assert others_busy(before, after) == 1.0
    # This process's time counted beyond the CPUs' (clock granularity): never below 0.
    assert others_busy(before, CpuSample(1 * hz, 8 * hz, 14.0, 2)) == 0.0
    assert others_busy(before, CpuSample(1, 3, 10.0, 2)) is None  # too short to tell
