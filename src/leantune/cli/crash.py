"""An exception no command expected: one labelled line on stderr, the traceback in a log file.

Every mistake a user can make ends in a `UserError` (exit 2) raised where it is found; what
escapes a command besides is leantune's bug. The CLI then prints one line, ``internal error:
<type>: <message>; full traceback in <log>; please report``, and exits 70. The log goes into
the run directory when the command has one (per rank in a distributed run), else under
``$LEANTUNE_HOME/crashes``, else the temp directory.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import tempfile
import traceback
from pathlib import Path

from leantune.models.demo_model import leantune_home

# Not 1 or 2: a script can tell a bug from a refusal (2) or a failed check (1).
EX_SOFTWARE = 70
"""Exit code of an internal error (sysexits.h): not the user's to fix."""
MESSAGE_LIMIT = 500
"""Characters of the exception's message on the one line; the log holds all of it."""


def log_dirs(run_dir: Path | None) -> list[Path]:
    """Where a crash log may go, best first: the run directory (only when it already exists:
    a crash never creates one), $LEANTUNE_HOME/crashes, then the temp directory."""
    # Beside the run's own files, where a user reporting the run looks first.
    dirs = [run_dir] if run_dir is not None and run_dir.is_dir() else []
    return [*dirs, leantune_home() / "crashes", Path(tempfile.gettempdir()) / "leantune-crashes"]


def write_log(exc: BaseException, argv: list[str], run_dir: Path | None, rank: str) -> Path | None:
    """The command line and `exc`'s traceback in a new file of the first writable `log_dirs`;
    None when none is writable."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    suffix = f"-rank{rank}" if rank else ""
    # The pid and rank keep apart the logs of processes crashing in the same second (torchrun).
    name = f"crash-{stamp}-{os.getpid()}{suffix}.log"
    text = "leantune " + " ".join(argv) + "\n\n" + "".join(traceback.format_exception(exc))
    for folder in log_dirs(run_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            # "x": never follow or replace what is there (a symlink planted under that name).
            with path.open("x", encoding="utf-8", errors="backslashreplace") as f:
                f.write(text)
            return path
        except OSError:  # read-only, full, or not a directory: the next place
            continue
    return None


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line, cut at MESSAGE_LIMIT characters."""
    text = " ".join(str(exc).split())  # one line, whatever newlines the message holds
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def report_internal_error(
    exc: BaseException, argv: list[str], run_dir: Path | None, tag: str = ""
) -> int:
    """Log `exc` (see the module docstring), print its one line and return EX_SOFTWARE.

    Args:
        exc: what escaped the command.
        argv: the command line's arguments (after `leantune`), heading the log.
        run_dir: the command's run directory, if it has one.
        tag: `rank R of W: ` in a process of a distributed run, else "".
    """
    rank = os.environ.get("RANK", "?") if tag else ""
    path = write_log(exc, argv, run_dir, rank)
    where = f"full traceback in {path}" if path is not None else "no log could be written"
    # One line, not the traceback: a wall of library frames (torch's advice among them) would
    # read as if it were the user's to act on.
    message = f"{tag}internal error: {type(exc).__name__}: {one_line(exc)}; {where}; please report"
    print(message, file=sys.stderr, flush=True)
    return EX_SOFTWARE
