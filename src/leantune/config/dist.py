"""The `dist:` section of a config: how a run spreads over processes (torchrun).

Nothing here changes a run's trajectory (two processes with micro-batch B make the same updates
as one with 2B), so the section is free to change on resume, the world size included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from leantune.config.parse import ConfigError
from leantune.config.roles import FREE


@dataclass
class DistConfig:
    """Data parallelism under torchrun: `torchrun --nproc-per-node N -m leantune train ...` or
    `leantune train --nproc N`."""

    strategy: Literal["auto", "ddp", "fsdp2", "deepspeed"] = field(default="auto", metadata=FREE)
    """auto: ddp when torchrun started this process (WORLD_SIZE set), else one process;
    ddp: every rank holds the whole model, gradients are all-reduced; fsdp2: parameters,
    gradients and optimizer state are sharded over the ranks (`fully_shard` per transformer
    block, then the root); deepspeed: DeepSpeed ZeRO at dist.zero_stage (an optional extra:
    pip install --no-build-isolation 'deepspeed==0.19.8')."""
    backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata=FREE)
    """Process-group backend; auto: nccl on CUDA, gloo on CPU."""
    timeout_s: float = field(default=600.0, metadata=FREE)
    """A collective that does not complete in this many seconds fails, naming the rank and
    the operation (a dead or hung peer)."""
    cpu_offload: bool = field(default=False, metadata=FREE)
    """fsdp2 only: keep the sharded parameters, gradients and optimizer state in CPU memory
    (`CPUOffloadPolicy`), the optimizer step runs on the CPU."""
    reshard_after_forward: bool = field(default=True, metadata=FREE)
    """fsdp2 only: free each block's gathered parameters after its forward and gather them
    again for the backward (less memory, one more all-gather per block)."""
    zero_stage: int = field(default=3, metadata=FREE)
    """deepspeed only: 1 shards the optimizer state over the ranks, 2 the gradients too, 3 the
    parameters as well (gathered per module for its forward and backward)."""


CPU_OFFLOAD_ON_CPU = (
    "dist.cpu_offload=true needs CUDA: training on the CPU, the shards are in CPU memory "
    "already; leave it false"
)
NCCL_ON_CPU = (
    "dist.backend=nccl needs CUDA and this run trains on the CPU (train.device=cpu, or "
    "train.device=auto on a machine with no CUDA device); use dist.backend=auto (gloo on CPU)"
)


def check_dist(d: DistConfig, device: str, eval_every: int) -> None:
    """Cross-field checks of `dist:`; raises ConfigError naming the field and the fix."""
    if not d.timeout_s > 0:
        raise ConfigError(f"dist.timeout_s: must be > 0 seconds, got {d.timeout_s}")
    if d.backend == "nccl" and device == "cpu":
        raise ConfigError(NCCL_ON_CPU)
    # Both are fully_shard options: any other strategy would ignore them without a word.
    if d.strategy != "fsdp2" and (d.cpu_offload or not d.reshard_after_forward):
        raise ConfigError(
            f"dist.cpu_offload and dist.reshard_after_forward are fsdp2 settings; "
            f"set dist.strategy=fsdp2 or leave them at their defaults (strategy {d.strategy})"
        )
    if d.cpu_offload and device == "cpu":
        raise ConfigError(CPU_OFFLOAD_ON_CPU)
    # With the parameters sharded, an evaluation forward on rank 0 alone starts all-gathers
    # that the other ranks never join. Stages 1 and 2 keep whole parameters on every rank.
    if d.strategy == "deepspeed" and d.zero_stage == 3 and eval_every:
        raise ConfigError(
            "train.eval_every with dist.strategy=deepspeed and dist.zero_stage=3: the periodic "
            "evaluation runs on rank 0, which holds only a shard of the model; use "
            "dist.zero_stage=1 or 2, or train.eval_every=0 (the closing evaluation still runs, "
            "on the gathered model)"
        )
    if d.strategy == "fsdp2" and eval_every:
        raise ConfigError(
            "train.eval_every with dist.strategy=fsdp2: the periodic evaluation runs on rank 0, "
            "which holds only a shard of the model; use dist.strategy=ddp, or train.eval_every=0 "
            "(the closing evaluation still runs, on the gathered model)"
        )


DEEPSPEED_INSTALL = "pip install --no-build-isolation 'deepspeed==0.19.8'"
"""How the deepspeed extra installs (its build imports torch, so not in an isolated env)."""


def check_deepspeed(
    d: DistConfig, precision: str, optimizer: str, method: str, quantized_base: bool
) -> None:
    """The checks of dist.strategy=deepspeed (and of dist.zero_stage without it); raises
    ConfigError naming the field and the fix."""
    if d.zero_stage not in (1, 2, 3):
        raise ConfigError(f"dist.zero_stage: 1, 2 or 3, got {d.zero_stage}")
    if d.strategy != "deepspeed":
        if d.zero_stage != 3:
            raise ConfigError(
                f"dist.zero_stage is a deepspeed setting; set dist.strategy=deepspeed or leave "
                f"it at its default (strategy {d.strategy})"
            )
        return
    import importlib.util

    # Found, not imported: importing deepspeed loads torch and CUDA, and the config package
    # stays light (nothing of the run loads before every check has passed).
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"dist.strategy=deepspeed needs DeepSpeed, which is not installed: "
            f"{DEEPSPEED_INSTALL} (or use dist.strategy=fsdp2, PyTorch's own sharding)"
        )
    if precision == "fp16":
        raise ConfigError(
            "train.precision=fp16 with dist.strategy=deepspeed: leantune's fp16 loss scaler "
            "cannot reach ZeRO's partitioned gradients; use bf16 (or fp32)"
        )
    if optimizer != "adamw":
        raise ConfigError(
            f"train.optimizer={optimizer} with dist.strategy=deepspeed: ZeRO partitions "
            "torch's AdamW state (and already shrinks it by the world size); use "
            "train.optimizer=adamw"
        )
    if quantized_base:
        raise ConfigError(
            f"dist.strategy=deepspeed with method.name={method}: 4-bit base weights are not "
            "partitioned by this leantune; use dist.strategy=ddp"
        )
