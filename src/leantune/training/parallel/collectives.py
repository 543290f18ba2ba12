"""The collectives the strategies call, each named, so that a failure says which rank waited
for what.

A failed or timed-out collective raises an error naming this rank, the world size and the
operation; the other ranks' own errors name theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from leantune.training.parallel.world import World, end_world


class OverWorld:
    """The strategy protocol's rank and collective members over `self.world`, alike for every
    strategy (ddp, fsdp2, deepspeed): who speaks, which samples are this rank's, and the sums
    and decisions all ranks agree on."""

    world: World

    @property
    def is_main_process(self) -> bool:
        return self.world.is_main

    def shard_window(self, window: list[int]) -> list[int]:
        return shard(window, self.world)

    def reduce_count(self, count: int) -> int:
        return sum_int(self.world, count, COUNT)

    def reduce_sum(self, value: float) -> float:
        return sum_float(self.world, value, LOSS)

    def agree(self, code: int) -> int:
        return max_int(self.world, code, DECISION)

    def close(self) -> None:
        self.release()
        if self.world.owns_group:
            end_world()

    def release(self) -> None:
        """Drop what the strategy holds of the run (its wrapped model, engine): they hold
        the process group, which can only end once nothing does."""


class CollectiveFailed(RuntimeError):
    """A collective did not complete on this rank: a peer died, hung or took another path."""


@contextlib.contextmanager
def named(world: World, operation: str) -> Iterator[None]:
    """Re-raise a failure inside the block as `CollectiveFailed` naming rank and operation."""
    try:
        yield
    except CollectiveFailed:  # already named by an inner block: keep the innermost operation
        raise
    except (RuntimeError, dist.DistError) as exc:
        if not _is_collective_error(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # A peer that died makes the collective fail (gloo: the connection closes); one that
        # hangs makes it time out after dist.timeout_s. Only the text tells the two apart.
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        why = (
            f"did not complete within dist.timeout_s={world.timeout_s:g}s"
            if timed_out
            else "failed"
        )
        raise CollectiveFailed(
            f"rank {world.rank} of {world.world_size}: {operation} {why} ({first}); another "
            "rank died, hangs or took another path: its own error names it"
        ) from exc


def _is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    # gloo and some NCCL paths raise a plain RuntimeError: its text is the only sign. Anything
    # else (a shape error in the model) must pass through unrenamed.
    text = str(exc).lower()
    return any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer")
    )


def all_reduce(world: World, value: torch.Tensor, op: dist.ReduceOp.RedOpType, what: str) -> Any:
    """`value` reduced over ranks, in place (on the world's device for NCCL)."""
    tensor = value.to(world.device)  # NCCL reduces only CUDA tensors
    with named(world, f"all_reduce of {what}"):
        dist.all_reduce(tensor, op=op)
    return tensor.cpu()


def sum_int(world: World, count: int, what: str) -> int:
    return int(all_reduce(world, torch.tensor([count], dtype=torch.int64), dist.ReduceOp.SUM, what))


def sum_float(world: World, value: float, what: str) -> float:
    # float64: the Python float's own precision, so the transfer itself rounds nothing.
    t = torch.tensor([value], dtype=torch.float64)
    return float(all_reduce(world, t, dist.ReduceOp.SUM, what))


def max_int(world: World, value: int, what: str) -> int:
    return int(all_reduce(world, torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MAX, what))


def broadcast(world: World, obj: Any, what: str) -> Any:
    """Rank 0's `obj` on every rank (pickled: small things only)."""
    box = [obj if world.is_main else None]  # the list is filled in place on the other ranks
    with named(world, f"broadcast of {what}"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World, what: str) -> None:
    with named(world, f"barrier ({what})"):
        dist.barrier()


def shard(window: list[int], world: World) -> list[int]:
    """Rank r's contiguous share of a window; every rank gets the same number of rows.

    Raises:
        ValueError: the window does not divide evenly (the set-up refuses such a batch first).
    """
    n = len(window)
    # Unequal shares could give the ranks different numbers of micro-batches, and each gradient
    # sync needs every rank to run the same backward.
    if n % world.world_size:
        raise ValueError(
            f"a window of {n} samples does not divide over {world.world_size} processes: make "
            f"train.global_batch_size (or micro_batch_size x grad_accum) a multiple of "
            f"{world.world_size}"
        )
    per = n // world.world_size
    return window[world.rank * per : (world.rank + 1) * per]


COUNT = "the window's supervised-token count"
LOSS = "the window's loss"
DECISION = "a decision every rank takes alike (out of memory, stop, non-finite, set-up step)"


def nonfinite_anywhere(world: World, tensors: list[torch.Tensor]) -> bool:
    """Whether any rank's local `tensors` hold NaN or inf (every rank gets the same answer)."""
    local = any(t.is_floating_point() and not bool(t.isfinite().all()) for t in tensors)
    # Sharded weights: one rank may see a NaN that the others cannot, yet all must refuse alike.
    return bool(max_int(world, int(local), "the weights' finiteness check"))
