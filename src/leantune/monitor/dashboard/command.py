"""`leantune dashboard [RUNS_DIR] [--port N] [--host H]`: flags and the command itself."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leantune.core.signals import Interrupted
from leantune.errors import UserError
from leantune.monitor.hosts import exposure_warning

DEFAULT_PORT = 8470


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument(
        "runs_dir",
        metavar="RUNS_DIR",
        nargs="?",
        default="runs",
        help="the folder whose runs to show, directly in it or one level deeper (default: runs)",
    )
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT}; 0: any free port)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; anything else lets "
        "whoever reaches it read every run's config and metrics)",
    )
    p.add_argument(
        "--allow-host",
        metavar="NAME",
        action="append",
        type=_host_name,
        default=[],
        help="a host name the browser may use besides localhost, IP addresses and this "
        "machine's name (repeatable); requests naming others are refused, against DNS rebinding",
    )


def run(args: argparse.Namespace) -> int:
    """Serve the dashboard until SIGINT (Ctrl-C) or SIGTERM: exit 130 / 143, as every command.

    Raises:
        UserError: RUNS_DIR is not a folder, or the address cannot be bound.
    """
    from leantune.monitor.dashboard.server import make_server, serve  # only when serving

    root = Path(args.runs_dir)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UserError(f"RUNS_DIR {root} {what}; give the folder that holds your runs")
    try:
        server = make_server(root, args.host, args.port, args.allow_host)
    except OSError as exc:
        raise UserError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
            "pick another --port (0: any free one)"
        ) from None
    port = int(server.server_address[1])  # the one picked when --port was 0
    what = "every run's config, metrics and events"
    warning = exposure_warning(args.host, port, what, "--host", "--allow-host")
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    try:
        serve(server)
    except Interrupted as stop:
        print(f"dashboard: stopped ({stop.name})", file=sys.stderr)
        return stop.exit_code
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text}")
    return value


def _host_name(text: str) -> str:
    # The characters `hosts.host_name` accepts in a Host header: any other name never matches.
    if not text or not all(c.isalnum() or c in "-._" for c in text):
        raise argparse.ArgumentTypeError(
            f"expected a host name (runs.example.org), without scheme, port or path; got {text!r}"
        )
    return text
