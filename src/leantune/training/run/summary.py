"""What a finished run achieved: the summary's contents (`leantune.monitor.summary` owns the
file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantune.monitor.summary import write_summary_file
from leantune.training.state.checkpoint import TrainingState
from leantune.training.state.progress import RunProgress


def write_summary(
    run_dir: Path,
    state: TrainingState,
    progress: RunProgress,
    trainable_params: int,
    total_params: int,
    results: dict[str, Any],
    log: Callable[[str], None] = print,
    adapted: dict[str, Any] | None = None,
    started_from: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write run_dir/summary.json and print the headline numbers.

    `adapted` (what the method adapts, `methods.coverage.Coverage.as_dict`) is written, not
    printed, nor is `started_from` (the run model.path named), said as the run started."""
    summary: dict[str, Any] = {
        "steps": state.step,
        "train_time_s": round(progress.train_time_s, 2),
        "trainable_params": trainable_params,
        "total_params": total_params,
        "base_exact_match": progress.base_exact_match,
        **results,
    }
    # Kept out of the printed line: the run's log said it once when the method was applied.
    written = summary | ({"adapted": adapted} if adapted is not None else {})
    written |= {"started_from": started_from} if started_from is not None else {}
    write_summary_file(run_dir, written)
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()]
    log("summary: " + ", ".join(parts))
    if summary.get("base_exact_match") is not None and "eval_exact_match" in summary:
        log(
            f"exact match on held-out set: before {summary['base_exact_match']:.1%} -> "
            f"after {summary['eval_exact_match']:.1%}"
        )
    return written
