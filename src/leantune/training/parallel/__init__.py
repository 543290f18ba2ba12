"""Data parallelism on PyTorch's own engine: the process group from torchrun's environment
(`world`), named collectives (`collectives`), DDP (`ddp`), FSDP2 (`fsdp`) and its sharded
checkpoints (`sharded`), DeepSpeed ZeRO-1/2/3 (`zero`, an optional extra) and `leantune train
--nproc N` (`launch`).

Every strategy implements `training.parallel.strategy.ParallelStrategy`; the loop never sees which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leantune.config.dist import CPU_OFFLOAD_ON_CPU, NCCL_ON_CPU
from leantune.config.parse import ConfigError
from leantune.training.parallel.launch import launched_by_torchrun

if TYPE_CHECKING:
    from leantune.training.parallel.strategy import ParallelStrategy

__all__ = ["build_strategy", "launched_by_torchrun"]


def build_strategy(
    name: str,
    *,
    backend: str,
    device_type: str,
    timeout_s: float,
    bf16: bool,
    cpu_offload: bool,
    reshard_after_forward: bool,
    zero_stage: int = 3,
    max_grad_norm: float = 0.0,
) -> ParallelStrategy:
    """Join the process group and build the `name` strategy (``ddp``, ``fsdp2`` or
    ``deepspeed``, which clips at `max_grad_norm` inside its step)."""
    # The CLI imports this package for `launch` (`--nproc`): torch.distributed and the
    # strategies load only when one is built.
    from leantune.training.parallel.world import init_world

    # Checked here, after device resolution: train.device=auto may have found no GPU, and
    # offloading to the CPU from the CPU means nothing; NCCL has no CPU transport.
    if cpu_offload and device_type == "cpu":
        raise ConfigError(CPU_OFFLOAD_ON_CPU)
    if backend == "nccl" and device_type == "cpu":
        raise ConfigError(NCCL_ON_CPU)
    world = init_world(backend, device_type, timeout_s)
    if name == "ddp":
        from leantune.training.parallel.ddp import DDPStrategy  # see build_strategy's top

        return DDPStrategy(world)
    if name == "deepspeed":
        from leantune.training.parallel.zero import ZeroStrategy  # deepspeed: an optional extra

        return ZeroStrategy(world, zero_stage=zero_stage, max_grad_norm=max_grad_norm)
    from leantune.training.parallel.fsdp import FSDP2Strategy  # see build_strategy's top

    return FSDP2Strategy(
        world, bf16=bf16, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward
    )
