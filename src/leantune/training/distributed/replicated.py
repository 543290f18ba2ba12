"""What the two data-parallel strategies share: the window's share, the reductions and the
agreement."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from leantune.training.distributed import collectives as c
from leantune.training.distributed.world import World


class Reductions:
    """shard_window, reduce_count, reduce_sum and agree over one `World`."""

    def __init__(self, world: World) -> None:
        self.world = world

    @property
    def is_main_process(self) -> bool:
        return self.world.is_main

    def shard_window(self, window: list[int]) -> list[int]:
        return c.shard(window, self.world)

    def reduce_count(self, count: int) -> int:
        return c.sum_int(self.world, count, "the window's supervised-token count")

    def reduce_sum(self, value: float) -> float:
        return c.sum_float(self.world, value, "the window's loss")

    def agree(self, code: int) -> int:
        return c.max_int(self.world, code, "the out-of-memory/stop decision")

    @contextlib.contextmanager
    def named(self, operation: str) -> Iterator[None]:
        with c.named(self.world, operation):
            yield


def nonfinite_anywhere(world: World, tensors: list[torch.Tensor]) -> bool:
    """Whether any rank's local `tensors` hold NaN or inf (every rank gets the same answer)."""
    local = any(t.is_floating_point() and not bool(t.isfinite().all()) for t in tensors)
    return bool(c.max_int(world, int(local), "the weights' finiteness check"))
