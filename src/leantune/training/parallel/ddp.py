"""DDP: every rank holds the whole model; gradients are summed over ranks on the last
micro-batch's backward. The state is replicated, so rank 0 writes the single-process
checkpoint layout, which any world size (and a single process) resumes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from leantune.layout import checkpoint_name
from leantune.models.loss import LossModule, WrappedLoss
from leantune.training.guard.divergence import diverged
from leantune.training.parallel import collectives as c
from leantune.training.parallel.strategy import (
    CheckpointParts,
    SingleProcess,
    SyncScope,
    Warn,
    clip_whole,
    load_full_checkpoint,
)
from leantune.training.parallel.world import World
from leantune.training.state.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    resume_checkpoint,
)
from leantune.training.state.reading import newest_complete


def _sum_hook(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket as a sum."""
    # Each rank's loss is already divided by the supervised tokens of the whole window, so the
    # sum is the one-process gradient; DDP's default would divide by the world size once more.
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda f: f.value()[0])


# DDP checks the hook's annotations as objects (this module postpones them to strings).
_sum_hook.__annotations__ = {
    "group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class DDPStrategy(c.OverWorld):
    """DistributedDataParallel over the world's mesh."""

    shards_parameters = False

    def __init__(self, world: World) -> None:
        self.world = world

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        return clip_whole(params, max_norm)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        w = self.world
        ddp = DistributedDataParallel(
            LossModule(model),  # the chunked loss runs inside DDP's forward
            device_ids=[w.local_rank] if w.device.type == "cuda" else None,
            process_group=w.mesh.get_group(),
            forward_sync_buffers=False,  # the buffers (rotary tables) are the same everywhere
        )
        ddp.register_comm_hook(w.mesh.get_group(), _sum_hook)  # a sum, not DDP's mean
        return WrappedLoss(ddp, model)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[SyncScope]:
        ddp = model.wrapped if isinstance(model, WrappedLoss) else model
        assert isinstance(ddp, DistributedDataParallel)
        # no_sync on all but the window's last micro-batch: gradients accumulate locally and
        # are all-reduced once per optimizer step.
        op = "the gradient all-reduce" if enabled else "a micro-batch (no gradient sync)"
        scope = SyncScope()
        try:
            with c.named(self.world, op), contextlib.nullcontext() if enabled else ddp.no_sync():
                yield scope
        except BaseException:
            if enabled and scope.loss is not None:
                # The forward prepared DDP's reducer for a backward that will not come: left
                # so, it would all-reduce inside the replay's first no-sync backward. Every
                # rank abandons this same micro-batch (they agreed), so all complete it alike.
                with c.named(self.world, "the gradient all-reduce of an abandoned micro-batch"):
                    # Times zero: the sync completes without changing any gradient.
                    (scope.loss * 0).backward()
            raise

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        """Rank 0 writes the single-process layout; the others wait for it and learn whether
        it worked."""
        bad = [n for n, p in parts.params.items() if not bool(p.detach().isfinite().all())]
        if bad:  # the same weights on every rank: each refuses alike (exit 4 everywhere)
            raise diverged(parts.state.step, bad, newest_complete(root))
        error: BaseException | None = None
        path = root / checkpoint_name(parts.state.step)
        if self.world.is_main:
            try:
                path = SingleProcess().save_checkpoint(root, parts)
            except Exception as exc:  # every rank must hear of it before anyone raises
                error = exc
        # Every rank raises alike on a failed save; a rank that carried on alone would hang in
        # the next collective. repr: the exception itself may not pickle.
        failed = c.broadcast(self.world, None if error is None else repr(error), "save outcome")
        if error is not None:
            raise error
        if failed is not None:
            raise CheckpointError(f"rank {self.world.rank}: rank 0 could not save: {failed}")
        return path

    def resume_checkpoint(self, root: Path, warn: Warn) -> Checkpoint | None:
        """Rank 0 picks (and verifies) the checkpoint; every rank loads the same one."""
        # One rank chooses: ranks scanning on their own could pick different checkpoints if
        # one is damaged or a save lands between scans, and the replicas would diverge.
        error: BaseException | None = None
        ckpt = None
        if self.world.is_main:
            try:
                ckpt = resume_checkpoint(root, warn=warn)
            except Exception as exc:
                error = exc
        told = c.broadcast(
            self.world,
            (None if ckpt is None else str(ckpt.path), None if error is None else repr(error)),
            "the checkpoint to resume",
        )
        if error is not None:
            raise error
        chosen, failed = told
        if failed is not None:
            raise CheckpointError(f"rank {self.world.rank}: rank 0 could not resume: {failed}")
        if self.world.is_main or chosen is None:
            return ckpt
        # The path, not the tensors, is broadcast (pickled): each rank reads the files itself.
        return load_checkpoint(Path(chosen))

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        load_full_checkpoint(ckpt, params, optimizer)

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        return model if self.world.is_main else None  # replicas: rank 0's copy is the model
