"""The process group: from torchrun's environment, or a world of one process.

torchrun (`python -m torch.distributed.run`) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT for every process it starts; `init_process_group` reads them (the env://
rendezvous). Without them, a `dist.strategy` run is a world of one process.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from leantune.errors import UserError
from leantune.training.parallel.launch import EXPECTED_WORLD_ENV, launched_by_torchrun


class WorldSizeMismatch(UserError):
    """torchrun started another number of processes than `leantune train --nproc` asked for."""


@dataclass(frozen=True)
class World:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    """Where this rank computes (cuda:<local rank> under NCCL)."""
    mesh: DeviceMesh
    """The 1-D data-parallel mesh, passed explicitly to DDP and fully_shard (with gloo the
    implicit one can land on the wrong device type: pytorch#132471)."""
    timeout_s: float
    owns_group: bool = False
    """The process group was created for this run (not a caller's), so the run ends it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(backend: str, device_type: str, timeout_s: float) -> World:
    """Join (or create) the process group and build the data-parallel mesh.

    Args:
        backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
        device_type: ``cpu`` or ``cuda``, the run's resolved device.
        timeout_s: How long any collective may wait for the other ranks.

    Raises:
        WorldSizeMismatch: torchrun started another world size than ``--nproc`` asked for.
    """
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Before the process group: otherwise every rank's NCCL communicator would use cuda:0.
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        if launched_by_torchrun():
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A world of one, with the same code path and checkpoints as a launched run, so a
            # run can continue at another world size. An in-memory store: no rendezvous.
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        # A run that fails before its strategy is closed still ends the group before the
        # interpreter goes (`end_world`); a caller's own group is left alone.
        atexit.register(end_world)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = os.environ.get(EXPECTED_WORLD_ENV)
    if expected is not None and int(expected) != world_size:
        raise WorldSizeMismatch(
            f"rank {rank}: asked for {expected} processes but the process group has "
            f"{world_size}: check torchrun's --nproc-per-node and --nnodes"
        )
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return World(rank, world_size, local_rank, device, mesh, timeout_s, owns_group)


def end_world() -> None:
    """Destroy the process group and free it now, while the interpreter is whole.

    `destroy_process_group` only drops torch's own references: FSDP2's and DeepSpeed's module
    states hold the group too, in reference cycles. Left to the interpreter's last collection
    at exit, the gloo group's worker threads were torn down with the interpreter half gone, and
    a rank that had finished everything aborted ("terminate called without an active
    exception", SIGABRT) intermittently, failing the torchrun job.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    # The cycles that still hold the group, freed here rather than at exit; freeing one can
    # release the next (finalizers), so until a pass finds nothing (bounded, to be safe).
    for _ in range(8):
        if gc.collect() == 0:
            break
