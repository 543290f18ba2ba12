"""Where a test may inject a fault into a run: the `StepHooks` the step calls at its fault points.

The library runs with `NoStepHooks`. `leantune.testing.faults` implements the hooks from the
`LEANTUNE_*` environment variables and the CLI installs them (`install_step_hooks`), so that
library code never reads those variables. Torch-free: the CLI installs them before it imports
torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: this module loads before the CLI imports torch
    from torch import nn


class StepHooks(Protocol):
    """The fault points of one run, in the order a run meets them."""

    def at_start(self) -> None:
        """`train` has claimed its run directory and is about to set up."""

    def check_memory(self, step: int, micro_batch: int, count: int) -> None:
        """Micro-batch `micro_batch` (of `count`) of `step` passed its memory check, after its
        forward and again after its backward; may raise `torch.OutOfMemoryError`."""

    def after_backward(self, micro_batch: int) -> None:
        """The backward of global micro-batch `micro_batch` (since the run began) is done."""

    def window_loss(self, step: int, loss: float, params: Iterable[nn.Parameter]) -> float:
        """The window's loss before clipping; may change it and the gradients of `params`."""

    def before_eval(self) -> None:
        """An evaluation attempt starts (inside its OOM retry); may raise an OOM."""


class NoStepHooks:
    """The library's hooks: every fault point does nothing."""

    def at_start(self) -> None:
        pass

    def check_memory(self, step: int, micro_batch: int, count: int) -> None:
        pass

    def after_backward(self, micro_batch: int) -> None:
        pass

    def window_loss(self, step: int, loss: float, params: Iterable[nn.Parameter]) -> float:
        return loss

    def before_eval(self) -> None:
        pass


_factory: Callable[[], StepHooks] = NoStepHooks
"""Makes each run's hooks: a run's faults fire at most once, so every run gets fresh ones."""


def install_step_hooks(factory: Callable[[], StepHooks]) -> None:
    """Make every later run's hooks with `factory` (the CLI's entry installs the test faults)."""
    global _factory
    _factory = factory


def new_step_hooks() -> StepHooks:
    """The hooks of a run that starts now."""
    return _factory()
