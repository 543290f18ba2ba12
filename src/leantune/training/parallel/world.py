"""The process group: from torchrun's environment, or a world of one process.

torchrun (`python -m torch.distributed.run`) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT for every process it starts; `init_process_group` reads them (the env://
rendezvous). Without them, a `dist.strategy` run is a world of one process.
"""

from __future__ import annotations

import atexit
import datetime
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
    if not dist.is_initialized():
        if launched_by_torchrun():
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A world of one, with the same code path and checkpoints as a launched run, so a
            # run can continue at another world size. An in-memory store: no rendezvous.
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        atexit.register(_destroy)  # only for a group this call created, not a caller's
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = os.environ.get(EXPECTED_WORLD_ENV)
    if expected is not None and int(expected) != world_size:
        raise WorldSizeMismatch(
            f"rank {rank}: asked for {expected} processes but the process group has "
            f"{world_size}: check torchrun's --nproc-per-node and --nnodes"
        )
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return World(rank, world_size, local_rank, device, mesh, timeout_s)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
