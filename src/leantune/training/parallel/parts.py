"""The types every strategy and the loop share: a micro-batch's sync scope and a checkpoint's
parts (kept apart from `strategy` so the sharded checkpoint code can use them without a cycle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leantune.training.state.checkpoint import TrainingState

Warn = Callable[[str], None]


@dataclass
class SyncScope:
    """One micro-batch inside `gradient_sync`: its loss, from the forward until its backward
    has run."""

    # Kept so that a strategy that prepared a gradient sync for the micro-batch can complete
    # that sync when it is abandoned (an out-of-memory replay or a stop).
    loss: torch.Tensor | None = None


@dataclass
class CheckpointParts:
    """What one checkpoint holds, as the trainer has it (the strategy gathers or shards it)."""

    state: TrainingState
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    keep_last: int
    metadata: dict[str, str]
