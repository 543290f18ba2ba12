"""How the loop runs across processes: one protocol, and the single-process strategy.

The loop asks its strategy to wrap the model, to pick this process's share of a window, to sum
counts and losses over processes, to agree on a decision every process must take alike (an
out-of-memory error or a stop signal on one of them), to turn gradient sync on only for a
window's last micro-batch, to write and read checkpoints, and for the model `final/` is saved
from. It never branches on which strategy it has. A single-process run is the trivial
strategy; DDP, FSDP2 and DeepSpeed ZeRO implement the same protocol (`training.parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from leantune.training.parallel.parts import CheckpointParts, SyncScope, Warn
from leantune.training.parallel.sharded import read_whole
from leantune.training.state.checkpoint import (
    Checkpoint,
    resume_checkpoint,
    save_checkpoint,
)


class ParallelStrategy(Protocol):
    """What the loop needs from a way of running it."""

    shards_parameters: bool
    """Each process holds shards of the parameters (FSDP2, ZeRO-3): flattened per unit into
    buffers of one dtype, so the frozen weights keep the model's dtype."""

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

    def agree(self, code: int) -> int:
        """The largest `code` over processes: a decision (0 = none) every process takes."""
        ...

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps, given the one built over the trainable parameters
        (DeepSpeed's engine takes it over; the others step it as it is)."""
        ...

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The gradients' global norm over processes, clipped to `max_norm` (before the step,
        or by it)."""
        ...

    def gradient_sync(
        self, model: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager[SyncScope]:
        """A context for one micro-batch's forward and backward; sync only when `enabled`.
        Left by an exception, it discards what the window accumulated (the replay or the
        stop starts clean on every process)."""
        ...

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        """Write a checkpoint under `root` (atomic); returns its directory."""
        ...

    def resume_checkpoint(self, root: Path, warn: Warn) -> Checkpoint | None:
        """The newest checkpoint under `root` that checks out, or None when there is none."""
        ...

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        """Put a checkpoint's weights and optimizer state into the trainable parameters."""
        ...

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        """The whole model for final/ and the closing evaluation on the main process; None
        on the others (after taking part in gathering it). `rebuild` makes the unwrapped
        model again (base + method), for a strategy that holds only shards of it."""
        ...

    def close(self) -> None:
        """End what the strategy started (its process group), once the run is over."""
        ...


class SingleProcess:
    """One process holds the whole model and the whole window."""

    shards_parameters = False

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

    def agree(self, code: int) -> int:
        return code

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        return clip_whole(params, max_norm)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[SyncScope]:
        yield SyncScope()  # one process: no sync to complete, no gradients held outside .grad

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        return save_checkpoint(
            root,
            parts.state,
            weights={n: p.detach() for n, p in parts.params.items()},  # no autograd history
            optimizer=parts.optimizer.state_dict(),
            scheduler=parts.scheduler,
            scaler=parts.scaler,
            rng=parts.rng,
            keep_last=parts.keep_last,
            metadata=parts.metadata,
        )

    def resume_checkpoint(self, root: Path, warn: Warn) -> Checkpoint | None:
        return resume_checkpoint(root, warn=warn)

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        load_full_checkpoint(ckpt, params, optimizer)

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        return model

    def close(self) -> None:
        pass  # nothing started


def clip_whole(params: list[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` over parameters whose gradients are whole (or DTensors, whose norm
    torch reduces over the mesh)."""
    # float(): the norm is a tensor (a DTensor under FSDP2); reading it syncs with the device,
    # once per step, where the guard needs the number anyway.
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def load_full_checkpoint(
    ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
) -> None:
    """Copy a checkpoint's weights and optimizer state into whole parameters (every replica
    does); a sharded (fsdp2) checkpoint is read whole first.

    Raises:
        RuntimeError: the checkpoint's weights are not these trainable parameters.
    """
    weights, optim = ckpt.weights, ckpt.optimizer
    if ckpt.sharded:
        weights, optim = read_whole(ckpt, params, optimizer)
    # Checked before copying: a partial load would leave a mix of two models' weights.
    if set(weights) != set(params):
        raise RuntimeError(
            f"{ckpt.path}: checkpoint weights do not match the model's trainable parameters "
            f"(was it written with another method or model?)"
        )
    with torch.no_grad():  # an in-place copy into a leaf that requires grad needs it
        for name, tensor in weights.items():
            # In place: the optimizer holds these very parameter objects.
            params[name].copy_(tensor)
    optimizer.load_state_dict(optim)
