"""CPU threads: one per usable physical core unless OMP_NUM_THREADS says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantune.core import threads


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
    line = threads.configure_threads({})
    assert torch.get_num_threads() == 1
    assert line == "threads: 1, one per physical core this process may use"
    torch.set_num_threads(2)
    line = threads.configure_threads({"OMP_NUM_THREADS": "2"})
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS=2" in line
