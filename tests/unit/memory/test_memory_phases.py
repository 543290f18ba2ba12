"""Training memory is reported as training's: the checkpoint's file pages that loading left in
the process's resident set are the load phase's peak, reported apart, never as the peak of every
training step."""

from __future__ import annotations

import json
import mmap
import sys
from pathlib import Path

import pytest
import torch
from support import make_config

from leantune.monitor.metrics import memory_stats, read_metrics, start_training_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads and resets /proc/self's VmHWM"
)
PAGES = 256 * 2**20
"""A mapped file this large stands for a checkpoint's page cache."""


def _map_and_read(path: Path) -> None:
    """What loading from safetensors does to RSS: map the file, read every page, unmap."""
    path.write_bytes(b"\1" * PAGES)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, PAGES, 4096)) == PAGES // 4096


def test_the_training_peak_leaves_out_the_load_phase(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    _map_and_read(tmp_path / "weights.bin")
    before = memory_stats(cpu)["peak_mem_bytes"]
    load_peak = start_training_memory()
    assert load_peak is not None and load_peak >= before - 4096
    after = memory_stats(cpu)
    # The file's pages are gone from RSS: they do not count in the peak.
    assert after["peak_mem_bytes"] <= load_peak - PAGES // 2
    assert 0 < after["rss_anon_bytes"] <= after["rss_bytes"] <= after["peak_mem_bytes"]


def test_summary_reports_the_load_peak_apart(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path, monkeypatch
) -> None:
    import leantune.training.recipe as recipe

    real = recipe.load_base  # the base model's load (and a 4-bit base's cost)

    def loading_with_pages(*args: object, **kwargs: object) -> torch.nn.Module:
        _map_and_read(tmp_path / "weights.bin")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(recipe, "load_base", loading_with_pages)
    run_dir = tmp_path / "run"
    cfg = make_config(tiny_llama_dir, chat_files[0], run_dir, "train.max_steps=2")
    summary = recipe.train(cfg, log=lambda _: None)
    steps = read_metrics(run_dir / "metrics.jsonl")
    load_peak = summary["load_peak_mem_bytes"]
    assert json.loads((run_dir / "summary.json").read_text())["load_peak_mem_bytes"] == load_peak
    # Each step's peak is training's: the mapped file's pages are not in it (the steps' own
    # tensors and heap take up to ~80 MB above the loaded model on this tiny run).
    assert all(r["peak_mem_bytes"] <= load_peak - PAGES // 4 for r in steps), (
        load_peak,
        [(r["peak_mem_bytes"], r["rss_bytes"], r["rss_anon_bytes"]) for r in steps],
    )
    assert summary["train_peak_mem_bytes"] >= max(r["peak_mem_bytes"] for r in steps)


def test_the_cpu_peak_never_falls_below_an_rss_already_reported(monkeypatch) -> None:
    """The kernel updates VmHWM lazily: a row may report RSS above it as the peak; a later
    reading, with RSS down and VmHWM not yet caught up, must not report a lower peak (the
    summary's training peak read at the end fell 8 KiB below a step's in one CI run)."""
    import leantune.monitor.metrics as metrics

    readings = iter([(200, 100), (150, 180), (120, 190)])  # (RSS, VmHWM) per reading
    now = {"rss": 0, "hwm": 0}

    def step() -> dict[str, int]:
        now["rss"], now["hwm"] = next(readings)
        return memory_stats(torch.device("cpu"))

    monkeypatch.setattr(metrics, "current_rss_bytes", lambda: now["rss"])
    monkeypatch.setattr(metrics, "status_bytes", lambda key: now["hwm"] if key == "VmHWM" else None)
    start_training_memory()  # training's peak starts here (the readings above are training's)
    assert [step()["peak_mem_bytes"] for _ in range(3)] == [200, 200, 200]
