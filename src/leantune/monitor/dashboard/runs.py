"""The runs under a folder, and what the dashboard shows of each, read from its files only.

A run is a directory holding `leantune_run.json`, `config.yaml` or `metrics.jsonl`, directly
under the runs folder or one level deeper (`runs/<group>/<run>`). Nothing outside the runs
folder is ever read. Hidden entries (a leading dot) are never runs.

Whatever is wrong with one run (a config that does not parse or expands past its bound, files
in shapes nothing expected) shows in that run's row as the status "error" with the reason, and
is logged once when it appears, changes or clears; every other run is listed as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.layout import RunPaths, checkpoint_step
from leantune.monitor.dashboard.parsed import Parsed, ParsedFiles, parse_config, parse_json
from leantune.monitor.dashboard.series import JsonlCache
from leantune.monitor.dashboard.status import run_status

MARKS = (RunPaths.record, RunPaths.config, RunPaths.metrics)
"""Any of these files makes a folder a run that the dashboard lists."""
Log = Callable[[str], None]


@dataclass(frozen=True)
class Run:
    """One run directory: its name under the runs folder (``a`` or ``group/a``), its path."""

    name: str
    path: Path


class RunsFolder:
    """The runs folder being served, and the cached reads of its runs' files."""

    def __init__(self, root: Path, log: Log):
        self.root = root.resolve()  # real, as `inside` compares real paths with it
        self.log = log
        """Where a run's problems go, one line when one appears, changes or clears."""
        self.cache = JsonlCache()
        self.files = ParsedFiles()
        self._problems: dict[str, str] = {}
        self._problems_lock = threading.Lock()

    # --- finding runs ----------------------------------------------------------------------

    def runs(self) -> list[Run]:
        """Every run under the folder, by name."""
        found: list[Run] = []
        for name, path in self._children(self.root, ""):
            if _is_run(path):
                found.append(Run(name, path))
            else:
                found.extend(Run(n, p) for n, p in self._children(path, name + "/") if _is_run(p))
        return sorted(found, key=lambda r: r.name)

    def find(self, name: str) -> Run | None:
        """The run called `name` (a name `runs()` lists), or None for any other string."""
        # A request's name is never joined to a path: it must equal a name that listing the
        # folder gives. The checks here only spare that listing for names it could never give.
        parts = name.split("/")
        if len(parts) > 2 or any(not p or p.startswith(".") or "\\" in p for p in parts):
            return None
        return next((r for r in self.runs() if r.name == name), None)

    def _children(self, folder: Path, prefix: str) -> list[tuple[str, Path]]:
        """Visible sub-directories of `folder` whose real path stays inside the runs folder."""
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return []
        out = []
        for e in entries:
            path = Path(e.path)
            # is_dir follows a link; `inside` then refuses one that leads out of the folder.
            if not e.name.startswith(".") and path.is_dir() and self.inside(path):
                out.append((prefix + e.name, path))
        return out

    def inside(self, path: Path) -> bool:
        """Whether `path`, symbolic links resolved, lies in the runs folder."""
        try:
            return Path(os.path.realpath(path)).is_relative_to(self.root)
        except (OSError, ValueError):
            return False

    def file(self, run: Run, name: str) -> Path | None:
        """`run`'s file `name` when it is a file inside the runs folder, else None."""
        path = run.path / name
        # A run file may be a link too (metrics.jsonl -> /etc/passwd): it must stay inside.
        return path if path.is_file() and self.inside(path) else None

    # --- reading a run ---------------------------------------------------------------------

    def jsonl(self, run: Run, name: str) -> Any:
        """The cached rows of one of `run`'s JSONL files (`series.Rows`)."""
        return self.cache.read(self.file(run, name))

    def events(self, run: Run) -> list[dict[str, Any]]:
        """`run`'s events, in order."""
        return [json.loads(x) for x in self.jsonl(run, RunPaths.events).lines]

    def overview(self, run: Run) -> dict[str, Any]:
        """One row of the run list: name, method, model, steps, last loss, status; the status
        "error" with its reason when the run's files cannot be read as a run's."""
        try:
            row = self._overview(run)
        except Exception as exc:  # one run's damage must never hide the others
            row = _broken(run.name, f"cannot read this run: {type(exc).__name__}: {exc}")
        self._note(run.name, row["reason"] if row["status"] == "error" else None)
        return row

    def _overview(self, run: Run) -> dict[str, Any]:
        config = self._parsed(run, RunPaths.config, parse_config)
        cfg = config.value or {}
        record = self._parsed(run, RunPaths.record, parse_json).value
        metrics = self.jsonl(run, RunPaths.metrics)
        last = json.loads(metrics.lines[-1]) if metrics.lines else {}
        # The last step that is an integer (a damaged row's step reads as -1).
        last_step = next((s for s in reversed(metrics.steps) if s >= 0), None)
        evals = self.jsonl(run, RunPaths.eval).lines
        last_eval = json.loads(evals[-1]) if evals else {}
        summary = self._parsed(run, RunPaths.summary, parse_json).value
        summary = summary if isinstance(summary, dict) else None
        status = run_status(run.path, self.events(run), last_step, summary)
        fingerprint = record.get("fingerprint") if isinstance(record, dict) else None
        fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
        state, reason = status.state, status.reason
        # Without its config a run's row would be mostly blanks: the reason says why.
        if config.error is not None:
            state, reason = "error", config.error
        return {
            "name": run.name,
            "method": _get(cfg, "method", "name") or fingerprint.get("method.name"),
            "model": _model_name(_get(cfg, "model", "path")),
            "steps_done": last_step or 0,
            "max_steps": _get(cfg, "train", "max_steps"),
            "last_loss": last.get("loss"),
            "last_eval_loss": last_eval.get("eval_loss"),
            "tokens_per_s": last.get("tokens_per_s"),
            "status": state,
            "reason": reason,
            "pid": status.pid,
            "updated": self._updated(run),
        }

    def detail(self, run: Run) -> dict[str, Any]:
        """Everything of `run` but its series: the overview, config, summary, checkpoints."""
        config = self._parsed(run, RunPaths.config, parse_config)
        plan = self._parsed(run, RunPaths.memory_plan, parse_json).value
        value = plan.get("peak_bytes") if isinstance(plan, dict) else None
        planned = value if isinstance(value, int | float) else None
        return {
            **self.overview(run),
            "config": config.value,
            "config_text": config.text,
            "config_error": config.error,
            "summary": self._parsed(run, RunPaths.summary, parse_json).value,
            "paused": self._parsed(run, RunPaths.paused, parse_json).value,
            "checkpoints": self._checkpoints(run),
            "has_final": self._is_dir(run, RunPaths.final),
            "planned_peak_bytes": planned,
        }

    def _parsed(self, run: Run, name: str, parse: Callable[[str, str], Any]) -> Parsed:
        return self.files.read(self.file(run, name), parse)

    def _note(self, name: str, problem: str | None) -> None:
        """Log a run's problem when it appears or changes, and when it clears: not per poll."""
        # The run list is polled every two seconds: a lasting problem is said once.
        with self._problems_lock:
            if self._problems.get(name) == problem:
                return
            if problem is None:
                del self._problems[name]
            else:
                self._problems[name] = problem
        self.log(f"dashboard: run {name}: {problem or 'readable again'}")

    def _is_dir(self, run: Run, name: str) -> bool:
        path = run.path / name
        return path.is_dir() and self.inside(path)

    def _checkpoints(self, run: Run) -> list[int]:
        """Steps of the checkpoints kept (`checkpoints/step-NNNNNN`; unfinished ones too)."""
        if not self._is_dir(run, RunPaths.checkpoints):
            return []
        found = (checkpoint_step(e.name) for e in os.scandir(RunPaths(run.path).checkpoints))
        return sorted(step for step in found if step is not None)

    def _updated(self, run: Run) -> float | None:
        """When the run last wrote a step, an eval or an event (seconds since the epoch)."""
        times = []
        for name in (RunPaths.metrics, RunPaths.eval, RunPaths.events, RunPaths.summary):
            path = self.file(run, name)
            if path is not None:
                with contextlib.suppress(OSError):
                    times.append(path.stat().st_mtime)
        return max(times, default=None)


def _is_run(path: Path) -> bool:
    return any((path / mark).is_file() for mark in MARKS)


def _broken(name: str, reason: str) -> dict[str, Any]:
    """The row of a run whose files could not be read."""
    row: dict[str, Any] = dict.fromkeys(
        ("method", "model", "max_steps", "last_loss", "last_eval_loss", "tokens_per_s", "pid",
         "updated")
    )  # fmt: skip
    return {**row, "name": name, "steps_done": 0, "status": "error", "reason": reason}


def _get(cfg: dict[str, Any], section: str, key: str) -> Any:
    part = cfg.get(section)
    return part.get(key) if isinstance(part, dict) else None


def _model_name(path: Any) -> str | None:
    """The model as a short name: the hub id as it is, a local path's last two parts."""
    if not isinstance(path, str):
        return None
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    if path.startswith(("/", ".", "~")) and len(parts) > 2:
        return "/".join(parts[-2:])
    return path
