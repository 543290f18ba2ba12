"""`leantune bench methods --sweep`: a short learning-rate sweep per method, by held-out loss.

Each method trains once per rate of a small log-spaced grid (by default 3 rates, a factor of
~3.2 apart, centred on its default), each run the library's `train` on the same data for the
same steps with the stability guard as configured (on by default), all in this process. The
rate with the lowest held-out loss (`data.eval`: give it a validation file, not the one the
benchmark scores on) wins; a failed run (the guard stopped it, a NaN) never does.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from leantune.bench.methods import Log, MethodResult, refusals, run_overrides
from leantune.core.writes import write_file
from leantune.layout import RunPaths
from leantune.monitor.metrics import read_metrics
from leantune.monitor.summary import finished_summary
from leantune.training.checks import load_config
from leantune.training.recipe import train

TABLE_FILE, JSON_FILE = "sweep.md", "sweep.json"
"""What `write_sweep` writes into the benchmark's --out folder."""
# No exact match: it costs generation, and the loss is the quantity training optimises.
SWEEP_OVERRIDES = ("train.eval_exact_match=false", "train.save_every=0")
"""Appended to every sweep run: loss only (no generation), no checkpoints in between."""


@dataclass
class SweepPoint:
    """One run of the sweep."""

    lr: float
    status: str  # "ok" or "failed"
    eval_loss: float | None = None
    last_train_loss: float | None = None
    train_time_s: float | None = None
    error: str | None = None


@dataclass
class MethodSweep:
    """One method's sweep: its grid, each run, and the chosen rate."""

    method: str
    default_lr: float
    points: list[SweepPoint] = field(default_factory=list)
    chosen_lr: float | None = None
    status: str = "ok"  # "skipped" (an optional package is missing) or "refused": never ran
    error: str | None = None
    """Why a skipped or refused method never ran."""
    install: str | None = None
    """A skipped method's install line: what installs the package it needs."""

    def choose(self) -> None:
        """The rate of the lowest finite held-out loss among the runs that finished."""
        ok = [p for p in self.points if p.eval_loss is not None and math.isfinite(p.eval_loss)]
        self.chosen_lr = min(ok, key=lambda p: p.eval_loss or 0.0).lr if ok else None


def lr_grid(center: float, points: int, factor: float) -> list[float]:
    """`points` rates, `factor` apart and centred on `center` (log-spaced), rounded to 3
    significant digits and kept below 1."""
    # Exponents centred on 0, so the grid is symmetric around `center` in log space.
    grid = [center * factor ** (k - (points - 1) / 2) for k in range(points)]
    # Rounded for the table and the run folders' names; train.lr must stay below 1.
    return [float(f"{lr:.3g}") for lr in grid if lr < 1]


def parse_grids(text: str | None, methods: list[str]) -> dict[str, list[float]]:
    """`--grid ia3=3e-3:3e-2:3e-1,freeze=1e-5:1e-4`: explicit rates per method.

    Raises:
        ValueError: an unknown method or a rate that is not a finite number in (0, 1).
    """
    grids: dict[str, list[float]] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, values = item.partition("=")
        name = name.strip()
        if name not in methods:
            raise ValueError(f"--grid {item!r}: unknown method {name!r}; choose from {methods}")
        try:
            rates = [float(v) for v in values.split(":") if v.strip()]
        except ValueError:
            raise ValueError(
                f"--grid {item!r}: expected method=rate:rate:..., e.g. ia3=1e-2:1e-1"
            ) from None
        if not rates or not all(math.isfinite(r) and 0 < r < 1 for r in rates):
            raise ValueError(f"--grid {item!r}: every rate must be a finite number in (0, 1)")
        grids[name] = sorted(set(rates))  # each rate once (one folder per rate), ascending
    return grids


Runner = Callable[[str | None, list[str], Path], str | None]
"""(config file, overrides, log file) -> None when the run finished, else why it failed."""


def train_in_process(config: str | None, overrides: list[str], log_file: Path) -> str | None:
    """One `leantune train` run in this process, its log into `log_file`; None when it finished,
    else the error (a run stopped by the guard, a bad setting: a row of the sweep, not its end)."""

    # In this process, not a `leantune train` child: a short run would otherwise spend a third
    # of its time importing torch, transformers and peft, and the sweep reports no memory.
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w", encoding="utf-8") as f:

        def log(message: str) -> None:
            f.write(message + "\n")
            f.flush()  # a sweep that is stopped or crashes keeps its runs' logs to that line

        try:  # Ctrl-C (`Interrupted`, a BaseException) still ends the sweep
            train(load_config(config, overrides), log=log)
        except Exception as e:
            f.write(traceback.format_exc())
            return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _read_point(lr: float, run_dir: Path) -> SweepPoint:
    summary = finished_summary(run_dir)
    rows = read_metrics(RunPaths(run_dir).metrics)
    return SweepPoint(
        lr=lr,
        status="ok",
        eval_loss=summary.get("eval_loss"),
        last_train_loss=rows[-1]["loss"] if rows else None,
        train_time_s=summary.get("train_time_s"),
    )


def run_dir_for(out_dir: Path, method: str, lr: float) -> Path:
    """Where one sweep run lives: `<out>/<method>/lr-<rate>`."""
    return out_dir / method / f"lr-{lr:g}"


def sweep_refusals(
    config: str | None,
    grids: dict[str, list[float]],
    default_lrs: dict[str, float],
    out_dir: Path,
    overrides: list[str],
) -> dict[str, MethodResult]:
    """`bench.methods.refusals` of each method's sweep runs, with the sweep's own settings: the
    methods that must not start (a missing optional package, a refused setting), by name."""
    # One check per method, at its default rate: a rate in (0, 1) is never what a check refuses.
    lrs = {m: default_lrs[m] for m in grids}
    return refusals(config, list(grids), lrs, out_dir, [*overrides, *SWEEP_OVERRIDES])


def run_sweep(
    config: str | None,
    grids: dict[str, list[float]],
    default_lrs: dict[str, float],
    out_dir: Path,
    overrides: list[str],
    log: Log = print,
    reuse: bool = False,
    runner: Runner | None = None,
    refused: dict[str, MethodResult] | None = None,
) -> list[MethodSweep]:
    """Train every (method, rate) of `grids` in turn and choose each method's rate.

    With `reuse`, a run whose folder already holds summary.json is read back, not trained again
    (the caller answers for its settings being the same). `runner` trains one run
    (default: `train_in_process`). `refused` (default: `sweep_refusals`) are the methods that
    never run: their sweeps say why, with no points.
    """
    run = runner or train_in_process
    if refused is None:
        refused = sweep_refusals(config, grids, default_lrs, out_dir, overrides)
    sweeps = []
    total = sum(len(g) for g in grids.values())
    done = 0
    for method, grid in grids.items():
        sweep = MethodSweep(method, default_lrs[method])
        if method in refused:
            r = refused[method]
            sweep.status = "skipped" if r.status == "skipped" else "refused"
            sweep.error, sweep.install = r.error, r.install
            done += len(grid)
            sweeps.append(sweep)
            continue
        for lr in grid:
            done += 1
            run_dir = run_dir_for(out_dir, method, lr)
            if reuse and RunPaths(run_dir).summary.is_file():
                log(f"[{done}/{total}] {method} lr {lr:g}: reusing {run_dir}")
                sweep.points.append(_read_point(lr, run_dir))
                continue
            log(f"[{done}/{total}] {method} lr {lr:g} -> {run_dir}")
            # No base-model evaluation (False): the sweep compares rates with each other.
            extra = run_overrides(method, lr, run_dir, [*overrides, *SWEEP_OVERRIDES], False)
            reason = run(config, extra, out_dir / method / f"lr-{lr:g}.log")
            if reason is not None:
                log(f"    failed: {reason}")
                sweep.points.append(SweepPoint(lr, "failed", error=reason))
                continue
            point = _read_point(lr, run_dir)
            log(f"    held-out loss {point.eval_loss}")
            sweep.points.append(point)
        sweep.choose()
        sweeps.append(sweep)
    return sweeps


def sweep_table(sweeps: list[MethodSweep]) -> str:
    """The sweep as Markdown: one row per run, the chosen rate marked."""
    lines = [
        "| method | default lr | lr | held-out loss | last train loss | train time (s) | chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sweeps:
        if s.status != "ok":
            error = (s.error or "").replace("|", "/")
            lines.append(f"| {s.method} | {s.default_lr:g} | | {s.status}: {error} | | | |")
        for p in s.points:
            if p.status != "ok":
                error = (p.error or "").replace("|", "/")
                lines.append(
                    f"| {s.method} | {s.default_lr:g} | {p.lr:g} | failed: {error} | | | |"
                )
                continue
            mark = "**yes**" if p.lr == s.chosen_lr else ""
            loss = "n/a" if p.eval_loss is None else f"{p.eval_loss:.4f}"
            last = "n/a" if p.last_train_loss is None else f"{p.last_train_loss:.4f}"
            time_s = "n/a" if p.train_time_s is None else f"{p.train_time_s:.1f}"
            lines.append(
                f"| {s.method} | {s.default_lr:g} | {p.lr:g} | {loss} | {last} | {time_s} "
                f"| {mark} |"
            )
    chosen = ", ".join(f"{s.method}={s.chosen_lr:g}" for s in sweeps if s.chosen_lr is not None)
    return "\n".join(lines) + f"\n\nChosen rates: {chosen or 'none'}.\n"


def write_sweep(sweeps: list[MethodSweep], meta: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write sweep.md and sweep.json under `out`; returns the JSON payload."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "chosen_lr": {s.method: s.chosen_lr for s in sweeps},
        "sweeps": [asdict(s) for s in sweeps],
    }
    write_file(out / TABLE_FILE, sweep_table(sweeps))
    write_file(out / JSON_FILE, json.dumps(payload, indent=2) + "\n")
    return payload
