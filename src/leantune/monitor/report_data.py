"""What the run report shows, read from the run directory's files only.

Nothing here imports torch or the training code: a run copied from another machine, or one
that is still going, paused or stopped, reads the same way. Files that are missing (a run that
has not logged a step yet) or torn (a kill mid-write) give empty parts, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantune.config.parse import ParseError, load_yaml, memory_size
from leantune.errors import UserError
from leantune.layout import PreparedPaths, RunPaths
from leantune.monitor.summary import read_summary

BAD_LINES_SHOWN = 20  # enough to see the pattern; the full list is in the prepared folder


class NotARun(UserError):
    """The directory is not a leantune run directory."""


class DamagedRun(UserError):
    """A run file the report needs is damaged (its config)."""


_RESTORE = (
    "the run's config.yaml is damaged: restore it (`leantune train` wrote it from the config and "
    "overrides it was given) or remove it to report without the settings"
)


@dataclass
class DataReport:
    """One data file's preparation: its prepare_report.json and first rejected lines."""

    role: str
    """train or eval."""
    report: dict[str, Any]
    rejected: list[dict[str, Any]]


@dataclass
class RunData:
    """Everything the report shows."""

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    record: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    paused: dict[str, Any] | None = None
    data: list[DataReport] = field(default_factory=list)
    planned_peak_bytes: int | None = None
    budget_bytes: int | None = None

    def setting(self, dotted: str) -> Any:
        """A value of the resolved config (`train.max_steps`), None when absent."""
        value: Any = self.config
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value


def is_run_dir(path: Path) -> bool:
    """A leantune run: its record (written once set-up is done), or checkpoints of an older
    leantune (`RunPaths.is_run`)."""
    return RunPaths(path).is_run()


def read_run(run_dir: Path) -> RunData:
    """Read the run directory's files for the report.

    Raises:
        NotARun: `run_dir` is not a leantune run directory (exit 2).
    """
    if not run_dir.is_dir() or not is_run_dir(run_dir):
        what = "does not exist" if not run_dir.exists() else f"holds no {RunPaths.record}"
        raise NotARun(f"{run_dir}: not a leantune run directory ({what})")
    data = RunData(run_dir)
    paths = RunPaths(run_dir)
    if paths.config.is_file():
        data.config_text, data.config = _config(paths.config)
    data.record = _json(paths.record) or {}
    data.summary = read_summary(run_dir)
    # A row is a step only with an integer step (a hand-edited or foreign row is left out).
    metrics = _jsonl(paths.metrics)
    data.metrics = [m for m in metrics if type(m.get("step")) is int]
    data.evals = _jsonl(paths.eval)
    data.events = _jsonl(paths.events)
    data.paused = _json(paths.paused) if paths.paused.exists() else None
    # A marker that cannot be read still means paused: `leantune train` would resume it.
    if paths.paused.exists() and data.paused is None:
        data.paused = {"reason": "unknown"}
    data.data = _data_reports(data)
    data.planned_peak_bytes = _planned_peak(run_dir)
    budget = data.setting("train.memory_budget")
    try:
        data.budget_bytes = memory_size(str(budget)) if budget else None
    except ParseError:  # a hand-edited budget only costs the memory chart its budget line
        data.budget_bytes = None
    return data


def status(data: RunData) -> str:
    """finished, paused, stopped by the guard, interrupted, out of memory, or in progress."""
    last_step = data.metrics[-1]["step"] if data.metrics else 0
    if data.paused is not None:
        p = data.paused
        return (
            f"paused by the guard at step {p.get('step')} ({p.get('detector')}): {p.get('reason')}"
        )
    # A summary from an earlier finish is stale once a resumed attempt logged further steps.
    if data.summary is not None and data.summary.get("steps") == last_step:
        return "finished"
    ends = [e for e in data.events if e.get("kind") in ("stop", "signal", "oom", "pause")]
    if ends:
        last = ends[-1]
        kind = last.get("kind")
        if kind == "stop":
            return f"stopped by the guard at step {last.get('step')}"
        if kind == "signal":
            return f"interrupted by a signal at step {last.get('step')}"
        # Only the final OOM (micro-batch 1) saves a checkpoint and says so; the ones the run
        # recovered from (micro-batch halved) are no end.
        if kind == "oom" and "Checkpoint" in str(last.get("message")):
            return f"out of memory at step {last.get('step')} (micro-batch 1)"
    return "in progress, or ended without a summary"


def _config(path: Path) -> tuple[str, dict[str, Any]]:
    """The run's resolved config (text, mapping).

    Raises:
        DamagedRun: it cannot be read, or is not a YAML mapping of sections.
    """
    try:
        text = path.read_text(encoding="utf-8")
        # The loader train uses: aliases that expand past a bound are refused, not expanded.
        loaded, _ = load_yaml(text, str(path))
    except (OSError, ValueError, ParseError, RecursionError) as e:  # not UTF-8, not YAML
        raise DamagedRun(f"{path}: {_RESTORE} ({' '.join(str(e).split())})") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
        raise DamagedRun(f"{path}: not a mapping of config sections; {_RESTORE}")
    # These become paths (`_data_reports`), where another type would fail with a traceback.
    for key in ("data.train", "data.eval", "data.cache_dir"):
        section, name = key.split(".")
        value = loaded.get(section, {}).get(name)
        if value is not None and not isinstance(value, str):
            raise DamagedRun(f"{path}: {key} is {value!r}, not a path; {_RESTORE}")
    return text, loaded


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested thousands deep
        return None
    return value if isinstance(value, dict) else None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file; a torn last line (a kill mid-write) is left out."""
    try:
        # Bytes that are not UTF-8 spoil their own line only (it no longer parses as JSON).
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _data_reports(data: RunData) -> list[DataReport]:
    """The preparation report of data.train and data.eval: in the prepared directory given as
    the data, or the newest matching one in the cache (data.cache_dir, else <run>/prepared)."""
    cache = data.setting("data.cache_dir")
    caches = [Path(cache)] if cache else []
    caches.append(RunPaths(data.run_dir).prepared)
    found = []
    for role in ("train", "eval"):
        source = data.setting(f"data.{role}")
        if not source:
            continue
        report_dir = _prepared_dir(Path(source), caches)
        if report_dir is None:
            continue
        prepared = PreparedPaths(report_dir)
        report = _json(prepared.report) or {}
        rejected = _jsonl(prepared.rejected)[:BAD_LINES_SHOWN]
        found.append(DataReport(role, report, rejected))
    return found


def _prepared_dir(source: Path, caches: list[Path]) -> Path | None:
    if PreparedPaths(source).report.is_file():  # a directory from `leantune prepare`
        return source
    wanted = str(source.resolve())
    matches = []
    for cache in caches:
        for report in cache.glob(f"*/{PreparedPaths.report}"):
            files = (_json(report) or {}).get("files") or []
            # The report may record the file resolved or as it was given.
            if wanted in files or str(source) in files:
                matches.append(report)
    if not matches:
        return None
    # The newest is the one this run most likely used; the name breaks ties deterministically.
    return max(matches, key=lambda p: (p.stat().st_mtime, str(p))).parent


def _planned_peak(run_dir: Path) -> int | None:
    """The memory planner's predicted peak, when the run recorded one."""
    value = (_json(RunPaths(run_dir).memory_plan) or {}).get("peak_bytes")
    return value if isinstance(value, int) and value > 0 else None
