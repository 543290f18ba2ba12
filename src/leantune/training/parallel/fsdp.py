"""FSDP2: parameters, gradients and optimizer state sharded over the ranks.

`fully_shard` makes one unit per transformer block, then the root (the embeddings, the final
norm and the head, tied or not, with whatever the method added outside the blocks), after the
method has wrapped the model. Trainable leaves whose dtype differs from the rest of their block
(fp32 adapters on a bf16 base) become units of their own. Frozen parameters that are not
floating point (QLoRA's packed 4-bit base weights) are left whole on every rank; everything
trainable is sharded as for any other method. Checkpoints are sharded
(`training.parallel.sharded`) and hold only trainable weights, so nothing 4-bit is in them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from leantune.models.loss import LossModule, WrappedLoss
from leantune.training.parallel import collectives as c
from leantune.training.parallel import sharded
from leantune.training.parallel.parts import CheckpointParts, SyncScope, Warn
from leantune.training.parallel.strategy import clip_whole
from leantune.training.parallel.world import World
from leantune.training.state.checkpoint import Checkpoint


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of the largest ModuleList of same-class modules."""
    best: list[nn.Module] = []
    best_size = 0
    # Found by shape rather than by attribute name, so any architecture's layer list works.
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        # The largest: a block may itself hold a smaller list of same-class modules (experts).
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = list(module), size
    return best


def unshardable_params(model: nn.Module) -> set[nn.Parameter]:
    """Frozen parameters that are not floating point: packed low-bit weights (bitsandbytes'
    `Params4bit`), whose bytes only mean something whole, with their quantisation state."""
    return {p for p in model.parameters() if not p.requires_grad and not p.is_floating_point()}


def odd_dtype_leaves(block: nn.Module) -> list[nn.Module]:
    """Modules of `block` owning trainable parameters of a dtype other than the block's other
    sharded parameters (they get their own unit, so each unit has one trainable dtype)."""
    leaves = []
    # A unit's trainable parameters must share one dtype: FSDP2 reduce-scatters a unit's
    # gradients as one buffer.
    frozen = {p.dtype for p in block.parameters() if not p.requires_grad and p.is_floating_point()}
    for module in block.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and frozen and {p.dtype for p in own} - frozen:
            leaves.append(module)
    return leaves


class FSDP2Strategy(c.OverWorld):
    """`fully_shard` over the world's mesh."""

    shards_parameters = True

    def __init__(
        self,
        world: World,
        *,
        bf16: bool,
        cpu_offload: bool,
        reshard_after_forward: bool,
    ) -> None:
        self.world = world
        self.bf16 = bf16
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.root: nn.Module | None = None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        return clip_whole(params, max_norm)

    def release(self) -> None:
        self.root = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # Compute in bf16, but reduce gradients in fp32: a sum over ranks in bf16 would round
        # away the low bits of every gradient.
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.bf16
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        # Packed 4-bit weights cannot be cut into shards: each unit ignores its own, so every rank
        # keeps the whole 4-bit base, an eighth of its fp32 size.
        whole = unshardable_params(model)

        def shard(module: nn.Module) -> None:
            own = {p for p in module.parameters() if p in whole}
            fully_shard(
                module,
                mesh=self.world.mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=mp,
                offload_policy=offload,
                ignored_params=own or None,
            )

        # Sharded after the method wrapped the model, so a LoRA layer is made with the whole
        # weight's shape (peft#3578 is what happens otherwise). Inner units first: fully_shard
        # on a parent leaves the parameters of already-sharded children to them.
        for block in transformer_blocks(model):
            for leaf in odd_dtype_leaves(block):
                shard(leaf)
            shard(block)
        root = LossModule(model)  # the root's forward runs the chunked loss
        shard(root)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                # Each rank's loss is over the whole window's tokens: sum, never average.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self.root = root
        return WrappedLoss(root, model)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[SyncScope]:
        root = self.root
        assert isinstance(root, FSDPModule)
        # Without sync, FSDP keeps unsharded gradients locally and reduce-scatters them all on
        # the window's last backward.
        root.set_requires_gradient_sync(enabled)
        op = (
            "a forward/backward (all-gather, reduce-scatter)"
            if enabled
            else "a forward/backward without gradient sync (all-gather)"
        )
        try:
            with c.named(self.world, op):
                yield SyncScope()
        except BaseException:
            # An abandoned window's gradients would otherwise join the replay's reduce-scatter.
            _drop_unreduced_gradients(root)
            raise

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        assert self.root is not None
        return sharded.save(self.world, root, self.root, parts)

    def resume_checkpoint(self, root: Path, warn: Warn) -> Checkpoint | None:
        return sharded.find(self.world, root, warn)

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        assert self.root is not None
        sharded.load(self.world, ckpt, self.root, params, optimizer)

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        """The trainable weights gathered onto rank 0 and put into a model built again there."""
        # Frozen weights are left out: they never changed, so the rebuilt model's own copies
        # (from the base model's files) are the same. cpu_offload: the whole weights are
        # gathered in host memory, not on one GPU next to its shards.
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
        )
        assert self.root is not None
        # Every rank takes part in the gather, though only rank 0 keeps the result.
        with c.named(self.world, "gathering the trained weights for final/"):
            gathered = get_model_state_dict(self.root, options=options)
        full = {k.removeprefix("model."): v for k, v in gathered.items()}  # LossModule.model
        if not self.world.is_main:
            return None
        fresh = rebuild()
        missing = set(full) - set(fresh.state_dict())
        if missing:
            raise RuntimeError(f"the rebuilt model lacks trained weights: {sorted(missing)[:3]}")
        fresh.load_state_dict(full, strict=False)  # strict=False: only the trainable weights
        return fresh


def _drop_unreduced_gradients(root: nn.Module) -> None:
    """Forget the gradients FSDP keeps, unsharded, between backwards without sync."""
    # The optimizer's zero_grad reaches only the sharded gradients. FSDP2 has no public call
    # for this, hence the private attributes.
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else []:
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
