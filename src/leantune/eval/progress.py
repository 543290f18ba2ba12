"""What generation reports while it runs: prompts answered, tokens generated, work left.

`generate_texts` calls a `ProgressCallback` after every decoding step of every batch (through a
transformers `StoppingCriteria` that never stops anything) and once at the end of each batch, so
a display can show progress and an ETA even inside one long batch. How it is shown (a bar on
stderr, nothing) is the caller's choice: `leantune.monitor.progress.GenerationBar` is the CLI's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria


@dataclass(frozen=True)
class GenerationProgress:
    """Where one `generate_texts` call stands."""

    done: int
    """Prompts whose answer has ended (at a stop token, or at max_new_tokens)."""
    total: int
    """Prompts in the call."""
    new_tokens: int
    """Tokens generated so far by answers that had not ended (stop tokens included)."""
    work_done: int
    """Decoding steps times batch rows done, of `work_total`; a batch whose answers all end
    early completes its whole share at once, so the rate over this unit gives the ETA."""
    work_total: int
    """Prompts times max_new_tokens: the most decoding work the call can take."""
    elapsed_s: float = 0.0
    """Seconds since the call started (its first batch's prompt pass included)."""


ProgressCallback = Callable[[GenerationProgress], None]


class ProgressTracker:
    """Counts prompts, tokens and work over the batches of one `generate_texts` call; without
    a callback it watches nothing (no per-step work)."""

    def __init__(
        self,
        total: int,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        callback: ProgressCallback | None,
    ):
        self.total = total
        self.max_new_tokens = max_new_tokens
        self.stop_ids = torch.tensor(list(stop_ids), dtype=torch.long)
        self.callback = callback
        self.done = 0
        self.new_tokens = 0
        self._done_before = 0  # the prompts of the batches already returned
        self._work_before = 0  # and their work
        self._start = time.monotonic()

    def batch(self, rows: int) -> StoppingCriteria | None:
        """The criteria that watches the next batch of `rows` prompts (pass it to `generate`)."""
        return _Watch(self, rows) if self.callback is not None else None

    def end_batch(self, rows: int) -> None:
        """A batch returned: all its prompts are done, whether or not they stopped."""
        self._done_before += rows
        self._work_before += rows * self.max_new_tokens
        self.done = self._done_before
        self.report(self._work_before)

    def step(self, rows: int, steps: int, ended: int) -> None:
        """`steps` tokens into a batch of `rows` prompts, `ended` of which have ended."""
        self.done = self._done_before + ended
        self.report(self._work_before + rows * min(steps, self.max_new_tokens))

    def report(self, work_done: int) -> None:
        """Calls the callback with where the call stands."""
        if self.callback is None:
            return
        self.callback(
            GenerationProgress(
                self.done,
                self.total,
                self.new_tokens,
                work_done,
                self.total * self.max_new_tokens,
                time.monotonic() - self._start,
            )
        )


class _Watch(StoppingCriteria):
    """Called by `generate` after each new token: counts the answers that ended and the tokens
    of those that had not, and reports; never asks to stop (the eos criteria does that)."""

    def __init__(self, tracker: ProgressTracker, rows: int):
        self.tracker = tracker
        self.rows = rows
        self.steps = 0
        self.ended: torch.Tensor | None = None

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor | None = None, **kwargs: object
    ) -> torch.Tensor:
        last = input_ids[:, -1]
        ended = self.ended if self.ended is not None else torch.zeros_like(last, dtype=torch.bool)
        # A row that had ended gets padding from here on: it no longer produces tokens.
        self.tracker.new_tokens += int((~ended).sum())
        self.ended = ended | torch.isin(last, self.tracker.stop_ids.to(last.device))
        self.steps += 1
        self.tracker.step(self.rows, self.steps, int(self.ended.sum()))
        return torch.zeros_like(last, dtype=torch.bool)
