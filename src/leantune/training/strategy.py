"""How the loop runs across processes: one protocol, and the single-process strategy.

The loop asks its strategy to wrap the model, to pick this process's share of a window, to sum
counts and losses over processes, to turn gradient sync on only for a window's last
micro-batch, and to gather and load the weights a checkpoint holds. It never branches on which
strategy it has. A single-process run is the trivial strategy; DDP and FSDP2 implement the same
protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn


class ParallelStrategy(Protocol):
    """What the loop needs from a way of running it."""

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run's files (metrics, checkpoints, final/)."""
        ...

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The model as the loop trains it (after the method has wrapped it)."""
        ...

    def shard_window(self, window: list[int]) -> list[int]:
        """This process's rows of one step's window (a pure function of the window)."""
        ...

    def reduce_count(self, count: int) -> int:
        """`count` summed over processes (the window's supervised tokens)."""
        ...

    def reduce_sum(self, value: float) -> float:
        """`value` summed over processes (the window's loss)."""
        ...

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """A context for one micro-batch's backward; sync only when `enabled` (the last)."""
        ...

    def weights_for_checkpoint(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """The trainable weights as a checkpoint stores them."""
        ...

    def load_weights(
        self, params: dict[str, nn.Parameter], weights: dict[str, torch.Tensor]
    ) -> None:
        """Put checkpointed weights back into the trainable parameters."""
        ...


class SingleProcess:
    """One process holds the whole model and the whole window."""

    @property
    def is_main_process(self) -> bool:
        return True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def shard_window(self, window: list[int]) -> list[int]:
        return window

    def reduce_count(self, count: int) -> int:
        return count

    def reduce_sum(self, value: float) -> float:
        return value

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        yield

    def weights_for_checkpoint(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in params.items()}

    def load_weights(
        self, params: dict[str, nn.Parameter], weights: dict[str, torch.Tensor]
    ) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
