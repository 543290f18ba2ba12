"""``summary.json``: what a finished run achieved, written once at the end of training.

The one writer and the one reader of the file (the training decides what goes in it:
`leantune.training.run.summary`). Torch-free, so the report and the benchmarks read it without
the training code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from leantune.core.writes import write_file
from leantune.layout import RunPaths


def write_summary_file(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Replace `run_dir`'s summary.json with `summary` atomically; returns its path.

    Raises:
        OutputError: the disk refused the write, or the path is not a regular file.
    """
    path = RunPaths(run_dir).summary
    write_file(path, json.dumps(dict(summary), indent=2) + "\n")
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """`run_dir`'s summary; None when there is none (the run has not finished) or it cannot be
    read as a JSON object (torn by a kill, damaged by hand)."""
    try:
        value = json.loads(RunPaths(run_dir).summary.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested thousands deep
        return None
    return value if isinstance(value, dict) else None  # valid JSON, but no summary: damaged


def finished_summary(run_dir: Path) -> dict[str, Any]:
    """`read_summary` of a run that finished (its `leantune train` exited 0).

    Raises:
        FileNotFoundError: it has no summary, or a damaged one.
    """
    summary = read_summary(run_dir)
    if summary is None:
        raise FileNotFoundError(f"{RunPaths(run_dir).summary}: missing or damaged")
    return summary
