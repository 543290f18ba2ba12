"""DeepSpeed ZeRO (an optional extra: ``pip install --no-build-isolation deepspeed==0.19.8``).

ZeRO-1 shards the optimizer state over the ranks, ZeRO-2 the gradients too, ZeRO-3 the
parameters as well (gathered per module for its forward and backward). DeepSpeed's engine
takes leantune's own torch optimizer and steps it on flat fp32 partitions; everything else
stays leantune's, as for DDP and FSDP2:

- The loop's arithmetic: the engine divides by nothing (``gradient_accumulation_steps=1``); the
  window's last micro-batch is its accumulation boundary, and gradients are summed over ranks.
- Precision: leantune's autocast around the forward (fp16 is refused).
- Clipping and the guard: the global gradient norm is ZeRO's own, measured before the guard
  decides; DeepSpeed clips with it inside the step. A skipped step discards the partitions'
  gradients.
- Checkpoints: gathered whole; rank 0 writes the single-process layout.
- final/: ZeRO-1/2 keep whole parameters on every rank (rank 0 saves its model); ZeRO-3's
  trained weights are gathered into a model built again on rank 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantune.layout import checkpoint_name
from leantune.models.loss import BatchFn, LossModule, WrappedLoss
from leantune.training.guard.divergence import diverged
from leantune.training.parallel import collectives as c
from leantune.training.parallel.ddp import DDPStrategy
from leantune.training.parallel.parts import CheckpointParts, SyncScope, Warn
from leantune.training.parallel.world import World, WorldSizeMismatch
from leantune.training.state import checkpoint as ck
from leantune.training.state.checkpoint import Checkpoint, CheckpointError
from leantune.training.state.reading import newest_complete

_ADAM_STATE = ("exp_avg", "exp_avg_sq")
"""torch AdamW's per-parameter state besides its step count (dist.strategy=deepspeed runs
train.optimizer=adamw only)."""


def engine_config(zero_stage: int, max_grad_norm: float) -> dict[str, Any]:
    """The DeepSpeed config: ZeRO's stage and clipping; accumulation and precision stay the
    loop's (see the module docstring)."""
    return {
        # DeepSpeed's own bookkeeping (its data loader, throughput): the loop makes the batches.
        "train_micro_batch_size_per_gpu": 1,
        # Each micro-batch's loss is already over the whole window's supervised tokens of all
        # ranks: an engine that accumulated would divide it once more.
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        # The same formula as clip_grad_norm_, applied inside the engine's step.
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        # No bf16/fp16 section: the engine never casts the model; leantune's autocast does the
        # mixed precision (and fp16, which would need DeepSpeed's loss scaler, is refused).
        "steps_per_print": 2**31 - 1,  # never: the loop does its own logging
        "wall_clock_breakdown": False,
    }


class _GradTimes(torch.autograd.Function):
    """The identity whose gradient is `factor` times larger (DeepSpeed's mean -> a sum)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _EngineSlot(nn.Module):
    """The loss module as the loop calls it: the engine's forward once the optimizer exists
    (`ZeroStrategy.prepare_optimizer` builds the engine)."""

    def __init__(self, loss: LossModule, world_size: int) -> None:
        super().__init__()
        object.__setattr__(self, "loss_module", loss)  # registered by the engine, not here
        self.world_size = world_size
        self.engine: nn.Module | None = None

    def forward(
        self, batch: dict[str, torch.Tensor], kl_coef: float, fn: BatchFn | None = None
    ) -> torch.Tensor:
        if self.engine is None:
            raise RuntimeError("dist.strategy=deepspeed: the engine is built with the optimizer")
        out = self.engine(batch, kl_coef) if fn is None else self.engine(batch, kl_coef, fn)
        # DeepSpeed averages gradients over the ranks; a gradient world_size times larger
        # (the loss value unchanged) turns that average into the sum the token normalisation
        # needs.
        return _GradTimes.apply(out, float(self.world_size))


class EngineOptimizer(torch.optim.Optimizer):
    """The loop's optimizer under DeepSpeed: `step` is the engine's (ZeRO steps the torch
    optimizer on its fp32 partitions), `zero_grad` outside a step discards the partitions'
    gradients (a skipped or replayed window); `param_groups` are the torch optimizer's, where
    the schedule and the guard set the learning rate ZeRO steps with."""

    def __init__(self, engine: Any, base: torch.optim.Optimizer) -> None:
        # No Optimizer.__init__: it would take over the parameters ZeRO now owns.
        self.engine = engine
        self.base = base
        self.defaults = base.defaults
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self._just_stepped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.base.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.base.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.engine.step()
        self._just_stepped = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Right after a step there is nothing to discard; a zero_grad anywhere else means a
        # skipped or replayed window whose gradients must go.
        if not self._just_stepped:
            discard_gradients(self.engine.optimizer)
        self._just_stepped = False


def discard_gradients(zero: Any) -> None:
    """Forget the gradients a ZeRO optimizer holds (as its own overflow path does), so that the
    next backward starts the accumulation afresh."""
    # These are DeepSpeed's private attributes, reset as its own overflow path resets them;
    # zero_grad alone leaves the accumulated partitions and the micro-step counter.
    zero.zero_grad(set_to_none=True)
    averaged = getattr(zero, "averaged_gradients", None)
    if isinstance(averaged, dict) and hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        zero.averaged_gradients = {}
        zero.micro_step_id = 0
        return
    if isinstance(averaged, dict):  # ZeRO-1/2
        release = getattr(zero, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        for k in list(averaged):
            averaged[k] = None
            if k in getattr(zero, "all_grad_tensors", {}):
                zero.all_grad_tensors[k] = None
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        zero.micro_step_id = INITIAL_MICRO_STEP_ID


class ZeroStrategy(c.OverWorld):
    """DeepSpeed ZeRO-1/2/3 over the world's process group."""

    shards_parameters = True  # its engine flattens parameters by group; one rule for every stage

    def __init__(self, world: World, *, zero_stage: int, max_grad_norm: float) -> None:
        self.world = world
        self.zero_stage = zero_stage
        self.max_grad_norm = max_grad_norm
        self.slot: _EngineSlot | None = None
        self.engine: Any = None
        self.order: list[nn.Parameter] = []
        """The trainable parameters as the torch optimizer numbered them (its state dict's)."""
        self.groups: list[list[int]] = []

    def release(self) -> None:
        self.slot, self.engine, self.order = None, None, []

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.slot = _EngineSlot(LossModule(model), self.world.world_size)
        return WrappedLoss(self.slot, model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Build the engine around the loss module and `optimizer`; the optimizer the loop
        steps.

        Raises:
            WorldSizeMismatch: DeepSpeed sees another data-parallel world than torchrun made.
        """
        import deepspeed

        assert self.slot is not None, "wrap_model first"
        # Recorded before the engine takes the optimizer over (ZeRO puts its flat partitions
        # in the param groups): torch's own numbering, which the checkpoints keep.
        self.order = [p for g in optimizer.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(self.order)}
        self.groups = [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        config = engine_config(self.zero_stage, self.max_grad_norm)
        # DeepSpeed insists on a launcher's LOCAL_RANK; a world of one has none. Set only for
        # the call: left behind, it tells later code in the process (accelerate, a caller's
        # own) that a launcher started it.
        with (
            _launcher_local_rank(self.world.local_rank),
            c.named(self.world, "deepspeed.initialize"),
        ):
            engine, _, _, _ = deepspeed.initialize(
                model=self.slot.loss_module,
                optimizer=optimizer,
                config=config,
                dist_init_required=False,
            )
        if engine.dp_world_size != self.world.world_size:  # a launcher that started fewer
            raise WorldSizeMismatch(
                f"rank {self.world.rank}: DeepSpeed sees {engine.dp_world_size} data-parallel "
                f"processes, torchrun started {self.world.world_size}"
            )
        self.engine = engine
        self.slot.engine = engine
        return EngineOptimizer(engine, optimizer)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """ZeRO's global gradient norm over its partitions (every rank gets it); the step
        clips with it (``gradient_clipping``)."""
        from deepspeed.runtime.utils import combine_grad_norm_groups

        zero = self.engine.optimizer
        # Over ZeRO's partitions, not `params`: under ZeRO-2/3 no rank holds whole gradients.
        with c.named(self.world, "the gradient norm"):
            if self.zero_stage == 3:
                norm = combine_grad_norm_groups(zero._get_norm_groups())
            else:
                norm = zero.scaled_global_norm()
        return float(norm)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[SyncScope]:
        # ZeRO-1 reduces only at the boundary; ZeRO-2/3 reduce-scatter every micro-batch into
        # the partitions.
        self.engine.set_gradient_accumulation_boundary(enabled)
        op = "a ZeRO forward/backward" + ("" if enabled else " (no gradient sync)")
        try:
            with c.named(self.world, op):
                yield SyncScope()
        except BaseException:
            discard_gradients(self.engine.optimizer)
            raise

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        """Gather the whole trainable state (every rank takes part); rank 0 writes it in the
        single-process layout."""
        # The single-process layout, so any world size, DDP or one process resumes it. The fp32
        # masters, not the model's low-precision copies: resuming must lose nothing.
        weights = self._gather(parts.params, None)
        bad = [n for n, t in weights.items() if not bool(t.isfinite().all())]
        if bad:  # the gathered weights are the same on every rank: each refuses alike
            raise diverged(parts.state.step, bad, newest_complete(root))
        optimizer = self._gather_optimizer(parts.params)
        error: BaseException | None = None
        path = root / checkpoint_name(parts.state.step)
        if self.world.is_main:
            try:
                path = ck.save_checkpoint(
                    root,
                    parts.state,
                    weights=weights,
                    optimizer=optimizer,
                    scheduler=parts.scheduler,
                    scaler=parts.scaler,
                    rng=parts.rng,
                    keep_last=parts.keep_last,
                    metadata=parts.metadata,
                )
            except Exception as exc:  # every rank must hear of it before anyone raises
                error = exc
        failed = c.broadcast(self.world, None if error is None else repr(error), "save outcome")
        if error is not None:
            raise error
        if failed is not None:
            raise CheckpointError(f"rank {self.world.rank}: rank 0 could not save: {failed}")
        return path

    def resume_checkpoint(self, root: Path, warn: Warn) -> Checkpoint | None:
        return DDPStrategy(self.world).resume_checkpoint(root, warn)  # rank 0 picks for all

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        """Put a single-process layout checkpoint (of any world size) into ZeRO's partitions.

        Raises:
            CheckpointError: a sharded (fsdp2) checkpoint, or not these trainable parameters.
        """
        if ckpt.sharded:
            raise CheckpointError(
                f"{ckpt.path}: a sharded (dist.strategy=fsdp2) checkpoint; dist.strategy="
                "deepspeed resumes single-process, ddp and deepspeed checkpoints: continue it "
                "with dist.strategy=fsdp2 or ddp"
            )
        if set(ckpt.weights) != set(params):
            raise CheckpointError(
                f"{ckpt.path}: checkpoint weights do not match the model's trainable "
                "parameters (was it written with another method or model?)"
            )
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = self.engine.optimizer
        for name, p in params.items():
            safe_set_full_fp32_param(p, ckpt.weights[name].float())
        # Setting the masters does not touch the copies the forward uses.
        _copy_masters_to_model(zero, params, ckpt.weights, self.zero_stage)
        groups = ckpt.optimizer["param_groups"]
        for group, was in zip(zero.optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in was.items() if k != "params"})  # lr, as it was
        saved = ckpt.optimizer.get("state", {})
        flats = (
            zero.fp32_partitioned_groups_flat
            if self.zero_stage == 3
            else zero.single_partition_of_fp32_groups
        )
        if not saved:  # written before the first update: Adam as it starts (step 0, zeros)
            for flat in flats:
                for value in zero.optimizer.state.get(flat, {}).values():
                    value.zero_()
            return
        step = next(iter(saved.values()))["step"]
        # Adam's state is created by its first step: make it here, on ZeRO's fp32 partitions.
        for flat in flats:
            state = zero.optimizer.state[flat]  # after a step, ZeRO-1/2 link views of it
            state["step"] = step.clone()
            for key in _ADAM_STATE:
                state.setdefault(key, torch.zeros_like(flat))
        if self.zero_stage != 3:
            # Links each parameter to its slice of the flat state, which the setter below needs.
            zero._lazy_init_hp_params_optimizer_state()
        index = {id(p): i for i, p in enumerate(self.order)}
        for p in params.values():
            for key in _ADAM_STATE:
                safe_set_full_optimizer_state(p, saved[index[id(p)]][key].float(), key)

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        """ZeRO-1/2: rank 0's model (whole parameters); ZeRO-3: the trained weights gathered
        into a model built again on rank 0."""
        if self.zero_stage != 3:
            return model if self.world.is_main else None
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        full = self._gather(params, None)
        if not self.world.is_main:
            return None
        fresh = rebuild()
        mine = dict(fresh.named_parameters())
        missing = set(full) - set(mine)
        if missing:
            raise RuntimeError(f"the rebuilt model lacks trained weights: {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, tensor in full.items():
                mine[name].copy_(tensor)
        return fresh

    def _gather(self, params: dict[str, nn.Parameter], key: str | None) -> dict[str, Any]:
        """Every trainable weight (or its optimizer state `key`) whole, on every rank."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = {}
        with c.named(self.world, "gathering the ZeRO partitions"):
            for name, p in params.items():
                got = (
                    safe_get_full_fp32_param(p)
                    if key is None
                    else safe_get_full_optimizer_state(p, key)
                )
                # ZeRO-3's parameter is an empty placeholder: ds_shape is the real shape.
                shape = getattr(p, "ds_shape", p.shape)
                dtype = p.dtype if key is None else torch.float32
                # clone: on CPU and in the same dtype, .to() returns the very tensor ZeRO holds.
                out[name] = got.detach().reshape(shape).to("cpu", dtype).clone()
        return out

    def _gather_optimizer(self, params: dict[str, nn.Parameter]) -> dict[str, Any]:
        """torch AdamW's state dict, numbered as the torch optimizer numbered the parameters
        (what one process's `optimizer.state_dict()` would be)."""
        base = self.engine.optimizer.optimizer
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": idx}
            for g, idx in zip(base.param_groups, self.groups, strict=True)
        ]
        if not base.state:  # before the first update
            return {"state": {}, "param_groups": groups}
        step = next(iter(base.state.values()))["step"]
        by_key = {key: self._gather(params, key) for key in _ADAM_STATE}
        index = {id(p): i for i, p in enumerate(self.order)}
        state = {
            index[id(p)]: {"step": step.clone(), **{k: by_key[k][n] for k in _ADAM_STATE}}
            for n, p in params.items()
        }
        return {"state": state, "param_groups": groups}


def _copy_masters_to_model(
    zero: Any, params: dict[str, nn.Parameter], weights: dict[str, torch.Tensor], stage: int
) -> None:
    """The model's own (low-precision) copies after the masters were set: ZeRO-1/2 hold whole
    parameters, ZeRO-3 a flat partition per group that mirrors its fp32 one."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with torch.no_grad():
        if stage != 3:
            for name, p in params.items():
                p.copy_(weights[name])
            return
        for low, high in zip(
            zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True
        ):
            low.copy_(high)
        # Parameters gathered now (small ones stay gathered between steps: ZeRO-3's persistence
        # threshold) hold their whole value besides the partition: a rollback mid-run sets it.
        for name, p in params.items():
            if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE:
                p.data.copy_(weights[name])


@contextlib.contextmanager
def _launcher_local_rank(local_rank: int) -> Iterator[None]:
    """LOCAL_RANK as a launcher sets it, for the duration of the block, where none is set."""
    if "LOCAL_RANK" in os.environ:  # a launcher's own value wins
        yield
        return
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        yield
    finally:
        os.environ.pop("LOCAL_RANK", None)
