"""The report's charts: PNG images drawn with matplotlib's Agg renderer.

Figures are made with `matplotlib.figure.Figure`, never pyplot: no global state, no GUI
backend, nothing left open; the same data draws the same bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from leantune.monitor.report_data import RunData

GIB = 2**30
EVENT_COLORS = {"rollback": "tab:red", "oom": "tab:purple", "oom_eval": "tab:purple"}
GUARD_COLOR = "tab:orange"
"""Loss spikes, gradient-norm anomalies, non-finite steps, pauses and stops."""
# Small images: every chart is inlined as base64 in one self-contained HTML file.
SIZE = (6.0, 3.0)
DPI = 80


@dataclass(frozen=True)
class Plot:
    """One chart: its title and PNG bytes."""

    title: str
    png: bytes


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [
        (int(r["step"]), float(r[key]))
        for r in rows
        if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), int)
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _png(title: str, draw: Callable[[Axes], None], ylabel: str) -> bytes:
    fig = Figure(figsize=SIZE, dpi=DPI)
    # Fixed margins: a layout engine would draw every figure twice (half the report's time).
    fig.subplots_adjust(left=0.13, right=0.98, top=0.9, bottom=0.15)
    ax = fig.add_subplot()
    draw(ax)
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")
    buf = io.BytesIO()
    # Without matplotlib's version stamp, the same data draws the same bytes on any install.
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _mark_events(ax: Axes, data: RunData) -> None:
    """A vertical line at each guard, OOM and rollback event's step (one legend entry each)."""
    labelled: set[str] = set()
    for event in data.events:
        kind, step = str(event.get("kind")), event.get("step")
        # A resume or a signal marks where a process started or stopped, not a training anomaly.
        if kind in ("resume", "signal") or not isinstance(step, int):
            continue
        color = EVENT_COLORS.get(kind, GUARD_COLOR)
        label = kind if kind not in labelled else None  # a legend entry per kind, not per line
        labelled.add(kind)
        ax.axvline(step, color=color, linestyle=":", linewidth=1.2, label=label)


def _loss(data: RunData) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        ax.plot(*_series(data.metrics, "loss"), label="train loss", linewidth=1.2)
        steps, values = _series(data.evals, "eval_loss")
        if steps:
            ax.plot(steps, values, "o-", label="eval loss", markersize=3)
        _mark_events(ax, data)

    return draw


def _line(data: RunData, key: str, log: bool = False) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        steps, values = _series(data.metrics, key)
        ax.plot(steps, values, linewidth=1.0)
        # Log scale only over a wide positive range: one gradient-norm spike would otherwise
        # flatten every other step into the axis.
        if log and values and min(values) > 0 and max(values) / min(values) > 100:
            ax.set_yscale("log")

    return draw


def _lines(data: RunData, keys: tuple[tuple[str, str], ...]) -> Callable[[Axes], None]:
    """One line per (field, label) the run logged, on shared axes."""

    def draw(ax: Axes) -> None:
        for key, label in keys:
            steps, values = _series(data.metrics, key)
            if steps:
                ax.plot(steps, values, label=label, linewidth=1.0)

    return draw


# A preference run's reward metrics (TRL's names, as metrics.jsonl holds them).
REWARDS = (
    ("rewards/chosen", "chosen"),
    ("rewards/rejected", "rejected"),
    ("rewards/margins", "margin (chosen - rejected)"),
)
LOGPS = (("logps/chosen", "chosen"), ("logps/rejected", "rejected"))


def _memory(data: RunData) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        for key, label in (
            ("peak_mem_bytes", "peak"),
            ("rss_bytes", "resident (RSS)"),
            ("mem_allocated_bytes", "allocated"),
            ("mem_reserved_bytes", "reserved"),
        ):
            steps, values = _series(data.metrics, key)
            if steps:
                ax.plot(steps, [v / GIB for v in values], label=label, linewidth=1.0)
        if data.planned_peak_bytes is not None:
            ax.axhline(data.planned_peak_bytes / GIB, color="black", linestyle="--",
                       label="planned peak")  # fmt: skip
        if data.budget_bytes is not None:
            ax.axhline(data.budget_bytes / GIB, color="tab:red", linestyle="-.", label="budget")

    return draw


@dataclass(frozen=True)
class Chart:
    """One chart before it is drawn: its title, y-axis label and what it draws."""

    title: str
    ylabel: str
    draw: Callable[[Axes], None]


def charts(data: RunData) -> list[Chart]:
    """The charts the metrics allow (none before the first step)."""
    if not data.metrics:
        return []
    planned = " vs plan" if data.planned_peak_bytes is not None else ""
    found: list[tuple[str, str, str, Callable[[Axes], None]]] = [
        ("Loss", "loss", "loss", _loss(data)),
        ("Learning rate", "lr", "lr", _line(data, "lr")),
        ("Gradient norm (before clipping)", "grad_norm", "norm", _line(data, "grad_norm", True)),
        ("Throughput", "tokens_per_s", "tokens/s", _line(data, "tokens_per_s")),
        (f"Memory{planned}", "peak_mem_bytes", "GiB", _memory(data)),
        # Preference objectives only (train.objective=dpo, ...): an SFT run logs none of these.
        ("Reward accuracy", "rewards/accuracies", "accuracy", _line(data, "rewards/accuracies")),
        ("Rewards", "rewards/margins", "reward", _lines(data, REWARDS)),
        ("Log-probs of the answers", "logps/chosen", "log-prob", _lines(data, LOGPS)),
    ]
    return [
        Chart(title, ylabel, draw)
        for title, key, ylabel, draw in found
        if _series(data.metrics, key)[0]  # no empty axes for a field this run never logged
    ]


def plots(data: RunData) -> list[Plot]:
    """The charts the metrics allow, drawn (none before the first step)."""
    return [Plot(c.title, _png(c.title, c.draw, c.ylabel)) for c in charts(data)]
