"""`leantune report`: a run's report.html, (re)built from its run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from leantune.monitor.report import write_report


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    print(f"report: {write_report(Path(args.run_dir), out=out)}")
    return 0
