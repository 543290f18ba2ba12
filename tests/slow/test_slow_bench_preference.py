"""`leantune bench preference` in full on the demo model (marker `slow`: about an hour on 2 CPU
cores): leantune's DPO against TRL's DPOTrainer, 256 pairs, 3 alternating repetitions. Its
timings mean something only on an otherwise idle machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_leantune_dpo_meets_the_targets_against_trl(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "leantune", "bench", "preference", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3 * 3600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    table = result["results"]
    assert table["trl_dpo"]["reps"] == table["leantune"]["reps"] == 3
    # Both learn the preference: above the untrained model's held-out accuracy.
    for system in ("trl_dpo", "leantune"):
        assert table[system]["preference_accuracy"] > result["base_preference_accuracy"], system
    # Issue 34's targets: >= 2x TRL's useful tokens/s, <= 0.6x its peak RSS, accuracy within
    # 2 points.
    assert table["targets_met"] == {
        "useful_tokens_per_s": True,
        "peak_rss": True,
        "accuracy_points": True,
    }, table["ratios"]
