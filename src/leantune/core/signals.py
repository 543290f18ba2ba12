"""SIGTERM, SIGINT and SIGHUP during `train`: stop at a micro-batch boundary with a checkpoint.

:class:`StopSignals` installs one handler for the three signals while `train` runs and puts
the previous handlers back when it returns. Inside the training loop (:meth:`StopSignals.deferred`)
the first signal only sets a flag; the loop calls :meth:`StopSignals.check` at each micro-batch
boundary, which raises :class:`Interrupted` there, with the step state consistent, so the loop
abandons the window in flight and saves a checkpoint of the last applied step. Everywhere else
(loading, data preparation, the final evaluation), and for a second signal while the first is
handled, the handler raises :class:`Interrupted` at once. The exit code is 128 + the signal's
number: 130, 143, 129.

SIGHUP is what a dropped ssh session sends: its terminal is gone, and every later write to it
fails (EIO), so the handler first points stdout and stderr that were on that terminal at
/dev/null; the stop is recorded in ``events.jsonl``. A SIGHUP ignored when `train` starts
(``nohup leantune train ...``) stays ignored.

The bound: after the signal, at most one micro-batch's forward and backward (or a periodic
evaluation that is already running) plus one checkpoint save.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_OUTPUTS = (1, 2)
"""stdout and stderr, as file descriptors: what a hung-up terminal breaks."""


class Interrupted(BaseException):
    """A stop signal ended the command; the CLI prints the message and exits 128 + signum.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way up turns
    it into another error.
    """

    def __init__(self, signum: int, at_boundary: bool, message: str = "") -> None:
        super().__init__(message)
        self.signum = signum
        self.at_boundary = at_boundary
        """True when raised by `check` between micro-batches: the state is consistent."""
        self.message = message

    @property
    def name(self) -> str:
        """SIGINT, SIGTERM or SIGHUP."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP (the shell's 128 + signal number)."""
        return 128 + self.signum

    def __str__(self) -> str:
        return self.message or f"{self.name}: stopped"


class StopSignals:
    """The SIGINT/SIGTERM/SIGHUP handler of one `train` call, used as a context manager."""

    def __init__(self) -> None:
        self.requested: int | None = None
        """The first signal received while deferring (None: none yet)."""
        self.deferring = False
        self._previous: dict[int, Any] = {}
        self._terminals: list[int] = []
        """The output descriptors that were on a terminal when `train` started."""

    def __enter__(self) -> StopSignals:
        # Handlers can only be installed from the main thread; elsewhere the defaults stay.
        if threading.current_thread() is not threading.main_thread():
            return self
        self._terminals = [fd for fd in _OUTPUTS if os.isatty(fd)]
        for signum in SIGNALS:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # nohup: the caller asked to outlive the terminal
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            # First: the stop that follows prints, and a hung-up terminal answers EIO.
            self._leave_hung_up_terminal()
        if self.deferring and self.requested is None:
            # Inside the loop: raising here could land mid-step (optimizer half applied), so
            # the loop's next `check` raises at a consistent boundary instead.
            self.requested = signum
            return
        # Outside the loop, or a second signal: the user means now.
        self.deferring = False
        raise Interrupted(signum, at_boundary=False)

    def _leave_hung_up_terminal(self) -> None:
        """Point stdout and stderr at /dev/null where their terminal has hung up (it no longer
        answers as a terminal), so that the progress bar and the closing lines do not fail
        with EIO before the checkpoint is saved. A live terminal (``kill -HUP``) is kept."""
        gone = [fd for fd in self._terminals if not os.isatty(fd)]
        if not gone:
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            # dup2 onto the descriptors themselves: sys.stdout, tqdm and C-level writes all
            # go through 1 and 2.
            for fd in gone:
                os.dup2(null, fd)
        finally:
            os.close(null)
        self._terminals = [fd for fd in self._terminals if fd not in gone]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, the first signal is only recorded, for `check` to act on."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def check(self) -> None:
        """Raise :class:`Interrupted` (at a boundary) if a signal arrived while deferring."""
        if self.requested is not None and self.deferring:
            self.deferring = False  # from here on a second signal stops at once
            raise Interrupted(self.requested, at_boundary=True)
