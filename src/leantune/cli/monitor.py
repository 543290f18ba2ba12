"""The flags of `leantune dashboard` and `report`, which show runs (they run in
`monitor.dashboard.command` and `cli.commands.monitor`)."""

from __future__ import annotations

from typing import Any

from leantune.cli.args import runs
from leantune.monitor.dashboard.command import add_arguments as dashboard_arguments


def add_parsers(sub: Any) -> None:
    """`dashboard` and `report`."""
    d = sub.add_parser("dashboard", help="serve live charts of the runs in a folder (local only)")
    dashboard_arguments(d)
    runs(d, "leantune.monitor.dashboard.command:run")
    r = sub.add_parser("report", help="(re)build a run's report.html from its run directory")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (finished or not)")
    r.add_argument("--out", default=None, help="where to write it (default: RUN_DIR/report.html)")
    runs(r, "leantune.cli.commands.monitor:cmd_report")
