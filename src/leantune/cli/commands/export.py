"""`leantune export`: a run or model written in another format, then checked against it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from leantune.export.parity import ParityError
from leantune.export.run import export_model
from leantune.models.quiet import quiet_libraries


def cmd_export(args: argparse.Namespace) -> int:
    quiet_libraries()
    data = Path(args.data) if args.data else None
    try:
        report = export_model(
            args.model,
            args.format,
            Path(args.out),
            args.gguf_type,
            data,
            args.samples,
            args.attn_implementation,
        )
    except ParityError as e:  # the export was written but does not reproduce the source
        # 1, not a UserError's 2: the input was fine, the result failed its check.
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0
