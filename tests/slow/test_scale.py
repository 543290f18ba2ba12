"""The sizes people bring, end to end at the smallest of them: benchmarks/scale.py
builds a random-weight Qwen2.5-0.5B-shaped model from config (no download), plans, trains 3
steps with the defaults and exports to HF with the parity check, in fresh processes. The plan's
"needed" figure must hold the process's whole peak (load and training), and its live-tensor
peak must not be far above what training used. Minutes, so `slow`; the 1.5B and 7B shapes are
the benchmark's (benchmarks/results/scale-cpu.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCALE = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


@pytest.mark.slow
def test_a_half_billion_shape_plans_trains_and_exports_within_its_plan(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCALE), "--cases", "0.5b-full", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert row["exit"] == 0, row
    assert row["export"]["exit"] == 0 and row["export"]["parity"] is True, row
    assert row["plan_fits"] is True
    assert row["peak_rss_gib"] <= row["planned_needed_gib"], row  # "fits" held
    assert row["train_peak_gib"] >= 0.8 * row["planned_peak_gib"], row  # and is not far off
    assert row["s_per_step"] > 0 and row["tok_per_s"] > 0
