"""The run report: <run dir>/report.html, one self-contained file that opens from disk.

Written at the end of every run (`monitor.report`, on by default) and rebuilt by
`leantune report RUN_DIR`. It reads only the run directory (`monitor.report_data`), so it works
for finished, paused and stopped runs, for runs still going and for runs copied from elsewhere.
The charts are PNG images inside the file (base64); there is no script, stylesheet or image
from anywhere else. Two builds of the same files differ only in the generation time.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leantune.core.writes import WriteRefused, check_target, write_file
from leantune.errors import UserError
from leantune.layout import RunPaths
from leantune.monitor.report_data import RunData, read_run, status

if TYPE_CHECKING:
    from leantune.monitor.report_plots import Plot


class ReportNotWritten(UserError):
    """The report cannot be written where it goes (a read-only run, a full disk)."""


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 64em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(28em, 1fr)); gap: 0.5em; }
.charts img { width: 100%; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.status { font-weight: bold; } .muted { color: #777; }
"""


def write_report(
    run_dir: Path, out: Path | None = None, generated: dt.datetime | None = None
) -> Path:
    """Build <run_dir>/report.html (or `out`) from the run directory's files; returns its path.

    Raises:
        NotARun: `run_dir` is not a leantune run directory (exit 2).
        DamagedRun: its config.yaml is damaged (exit 2).
        OutputError: the path is not a regular file (a link, FIFO, device: never written
            through or replaced); ReportNotWritten: the disk refused the write. An earlier
            report is kept.
    """
    from leantune.monitor.report_plots import plots  # matplotlib: only when a report is made

    path = out if out is not None else RunPaths(run_dir).report
    check_target(path)  # before the work of rendering
    data = read_run(run_dir)
    # UTC, as every time in the report: a run copied elsewhere reads the same.
    text = render(data, plots(data), generated or dt.datetime.now(dt.UTC))
    try:
        write_file(path, text)
    except WriteRefused as e:  # a read-only copy of a run, a full disk
        raise ReportNotWritten(f"{e}; or give --out FILE in a writable folder") from None
    return path


def report_at_end(run_dir: Path, log: Callable[[str], None]) -> Path | None:
    """`write_report` for the end of a run: a report that cannot be written is a warning, not
    a failed run (its weights and summary are already saved)."""
    try:
        path = write_report(run_dir)
    except Exception as e:  # the run itself succeeded; say so and how to retry
        log(f"warning: {RunPaths(run_dir).report} not written ({e}); `leantune report {run_dir}`")
        return None
    log(f"report: {path}")
    return path


def render(data: RunData, charts: list[Plot], generated: dt.datetime) -> str:
    """The report's HTML."""
    # Resolved: a run given as "." or "runs/x/" still shows its folder's name.
    name = html.escape(data.run_dir.resolve().name)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>leantune report: {name}</title><style>{STYLE}</style></head><body>",
        f"<h1>leantune run report: {name}</h1>",
        f'<p class="status">Status: {html.escape(status(data))}</p>',
        f'<p class="muted" id="generated">Generated {generated.strftime("%Y-%m-%d %H:%M:%S")}'
        " UTC</p>",
        _overview(data),
        _results(data),
        _charts(charts),
        _events(data),
        _data(data),
        _times(data),
        "<h2>Config</h2>",
        f"<pre>{html.escape(data.config_text) or 'no config.yaml'}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _fmt(value: Any) -> str:
    # bool first: it is an int, and True would otherwise print as 1.
    if isinstance(value, bool) or value is None:
        return html.escape(str(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def _cell(value: Any) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f'<td class="num">{_fmt(value)}</td>' if number else f"<td>{_fmt(value)}</td>"


def _table(rows: Iterable[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th>{_cell(v)}</tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _grid(header: list[str], rows: Iterable[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _overview(data: RunData) -> str:
    s = data.summary or {}
    # The last row of the one trajectory metrics.jsonl holds, also for an unfinished run.
    steps = data.metrics[-1]["step"] if data.metrics else 0
    rows: list[tuple[str, Any]] = [
        ("method", data.setting("method.name")),
        ("model", data.setting("model.path")),
        ("steps", f"{steps:,} of {_fmt(data.setting('train.max_steps'))}"),
        ("precision", data.setting("train.precision")),
        (
            "global batch (rows per step)",
            data.record.get("fingerprint", {}).get("train.global_batch"),
        ),
        ("max_seq_len", data.setting("data.max_seq_len")),
    ]
    trainable, total = s.get("trainable_params"), s.get("total_params")
    if isinstance(trainable, int) and isinstance(total, int) and total:
        share = f"{trainable:,} of {total:,} parameters ({100 * trainable / total:.3f}%)"
        rows.append(("trainable", share))
    return "<h2>Run</h2>" + _table(rows)


def _results(data: RunData) -> str:
    s = data.summary
    if s is None:
        last = data.metrics[-1] if data.metrics else None
        text = "<p>No summary.json yet (the run has not finished)."
        if last is not None:
            text += f" Last step {last['step']}: loss {_fmt(last.get('loss'))}."
        return "<h2>Final metrics</h2>" + text + "</p>"
    # Scalars only: a table cell cannot show a nested entry.
    out = "<h2>Final metrics</h2>" + _table(
        (k, v) for k, v in s.items() if isinstance(v, (int, float)) or v is None
    )
    before, after = s.get("base_exact_match"), s.get("eval_exact_match")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        out += (
            f"<p>Exact match on the held-out set: before {before:.1%} &rarr; after {after:.1%}</p>"
        )
    elif isinstance(after, (int, float)):
        out += f"<p>Exact match on the held-out set after training: {after:.1%}</p>"
    return out


def _charts(charts: list[Plot]) -> str:
    if not charts:
        return "<h2>Charts</h2><p>No metrics yet: the run has not applied a step.</p>"
    figures = "".join(
        f'<img alt="{html.escape(p.title)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}">'
        for p in charts
    )
    return f'<h2>Charts</h2><div class="charts">{figures}</div>'


def _events(data: RunData) -> str:
    if not data.events:
        return "<h2>Guard and OOM events</h2><p>None: no step was flagged or replayed.</p>"
    rows = [
        [
            e.get("step"),
            _time(e.get("time")),
            e.get("kind"),
            e.get("action", ""),
            e.get("message", ""),
        ]
        for e in data.events
    ]
    table = _grid(["step", "time (UTC)", "kind", "action", "message"], rows)
    return "<h2>Guard and OOM events</h2>" + table


def _time(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return ""
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _data(data: RunData) -> str:
    out = ["<h2>Data</h2>"]
    for d in data.data:
        r = d.report
        dropped = r.get("dropped") or {}
        rows: list[tuple[str, Any]] = [
            ("records in", r.get("rows_in")),
            ("kept", r.get("rows_out")),
            # Only counts: a hand-edited report must not break the sum.
            ("bad lines", sum(v for v in dropped.values() if isinstance(v, int))),
            *((f"  dropped: {k}", v) for k, v in dropped.items()),
            ("rows", r.get("packed_rows")),
            ("tokens", r.get("tokens")),
            ("supervised tokens", r.get("supervised_tokens")),
        ]
        if (r.get("settings") or {}).get("pack"):
            rows.append(
                ("packing efficiency (tokens / rows x max_seq_len)", r.get("packing_efficiency"))
            )
        out.append(f"<h3>{html.escape(d.role)}</h3>" + _table(rows))
        if d.rejected:
            bad = [
                [f"{b.get('file')}:{b.get('line')}", b.get("kind"), b.get("reason")]
                for b in d.rejected
            ]
            out.append("<p>First bad lines:</p>" + _grid(["where", "kind", "reason"], bad))
    fill = _row_fill(data)
    if fill is not None:
        out.append(
            f"<p>Rows trained: {fill:.1%} of their max_seq_len tokens were real tokens "
            "(the trained steps' tokens / (rows per step x max_seq_len)).</p>"
        )
    if len(out) == 1:
        out.append("<p>No preparation report found for this run's data.</p>")
    return "".join(out)


def _row_fill(data: RunData) -> float | None:
    """Packing efficiency of the rows actually trained, from the metrics."""
    rows = data.record.get("fingerprint", {}).get("train.global_batch")
    length = data.setting("data.max_seq_len")
    tokens = [m["tokens"] for m in data.metrics if isinstance(m.get("tokens"), int)]
    # Any figure missing or zero (an older run, a hand-edited config): no fill rather than an error.
    if not (isinstance(rows, int) and isinstance(length, int) and tokens and rows and length):
        return None
    return sum(tokens) / (len(tokens) * rows * length)


def _times(data: RunData) -> str:
    s = data.summary or {}
    # Only this trajectory's steps: a rolled-back attempt's rows left metrics.jsonl.
    step_times = [m["step_time_s"] for m in data.metrics if isinstance(m.get("step_time_s"), float)]
    rows: list[tuple[str, Any]] = [
        ("wall time of the last invocation (s)", s.get("wall_time_s")),
        ("training time, all attempts (s)", s.get("train_time_s")),
        ("steps of this trajectory (s)", round(sum(step_times), 2) if step_times else None),
        ("mean step (s)", sum(step_times) / len(step_times) if step_times else None),
    ]
    for d in data.data:
        total = (d.report.get("timings") or {}).get("total_s")
        rows.append((f"data preparation, {d.role} (s)", total))
    return "<h2>Wall times</h2>" + _table(rows)
