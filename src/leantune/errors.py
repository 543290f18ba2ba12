"""The one base class of every error that is the user's to fix (exit code 2).

A command that fails on bad input, a bad config, a run directory in the wrong state or a
damaged checkpoint raises a subclass of :class:`UserError` whose message names the file (line,
field) and the fix; the CLI prints it without a traceback and exits with ``exit_code``.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message says what and how."""

    # 2, as for argparse's usage errors: the input is wrong, not leantune (an internal error
    # exits 70, `cli.crash`).
    exit_code = 2
