"""The memory planner's search: the fastest settings that fit a budget, for `leantune plan`.

`memory.inputs` builds the model's facts on the meta device and the step's settings; `estimate`
(in memory.estimate) turns them into a breakdown; `recommend` walks the seeds' out-of-memory
checklist in order (halve the micro-batch, turn on gradient checkpointing, lighter optimizer
states, half-precision frozen weights, a lighter method) and returns the fastest settings that
fit, always keeping the global batch (micro_batch x grad_accum); `resolve_micro_batch` serves
`train.micro_batch_size=auto` (`memory.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from leantune.core.optim import OptimizerUnavailable, resolve_optimizer
from leantune.memory.estimate import GIB, Breakdown, StepSettings, estimate
from leantune.memory.facts import ModelFacts
from leantune.memory.inputs import PlanBasis, PlanInputs, model_facts_for, plan_basis
from leantune.methods.registry import METHODS


@dataclass(frozen=True)
class Plan:
    """Settings for a run and their predicted memory."""

    method: str
    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    optimizer: str
    seq_len: int
    breakdown: Breakdown
    model_dtype: str | None = None
    """model.dtype to set (None: as configured)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "model_dtype": self.model_dtype,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "gradient_checkpointing": self.gradient_checkpointing,
            "optimizer": self.optimizer,
            "seq_len": self.seq_len,
            "breakdown": self.breakdown.as_dict(),
        }


def _halvings(micro_batch: int, global_batch: int) -> list[int]:
    """micro_batch, then halves of it down to 1 that divide the global batch."""
    out = []
    mb = micro_batch
    while mb >= 1:
        if global_batch % mb == 0:  # grad_accum must be whole for the global batch to hold
            out.append(mb)
        if mb == 1:
            break
        mb = max(1, mb // 2)
    return out or [1]


@dataclass(frozen=True)
class WeightOption:
    """The configured method with its frozen weights at another dtype (model.dtype)."""

    dtype: str
    facts: ModelFacts
    step: StepSettings
    weight_itemsize: int


def recommend(
    facts_by_method: dict[str, ModelFacts],
    method: str,
    step: StepSettings,
    global_batch: int,
    budget: int,
    weight_itemsize: int = 4,
    lighter_optimizers: tuple[str, ...] = (),
    lighter_weights: WeightOption | None = None,
) -> Plan | None:
    """The fastest settings that fit `budget` (`Breakdown.needed`: with the allocator's margin
    and the load phase), searched in the seeds' checklist order.

    Order: the configured method (micro-batch, checkpointing, then `lighter_optimizers`, as
    `_fastest_fitting` tries them); then the same with `lighter_weights` (e.g. model.dtype=bf16);
    then the other methods of `facts_by_method` in their given order (e.g. lora, then qlora).
    Returns None if nothing fits.
    """
    # Ordered by what the user gives up: the method unchanged at half the weights changes less
    # than another method does.
    options: list[tuple[str, ModelFacts, StepSettings, int, str | None]] = [
        (method, facts_by_method[method], step, weight_itemsize, None)
    ]
    if lighter_weights is not None:
        w = lighter_weights
        options.append((method, w.facts, w.step, w.weight_itemsize, w.dtype))
    options += [
        (m, f, step, weight_itemsize, None) for m, f in facts_by_method.items() if m != method
    ]
    for m, facts, base, itemsize, dtype in options:
        plan = _fastest_fitting(m, facts, base, global_batch, budget, itemsize, lighter_optimizers)
        if plan is not None:
            return replace(plan, model_dtype=dtype)
    return None


def _fastest_fitting(
    method: str,
    facts: ModelFacts,
    step: StepSettings,
    global_batch: int,
    budget: int,
    weight_itemsize: int,
    lighter_optimizers: tuple[str, ...],
) -> Plan | None:
    """`recommend` for one method and weight dtype."""
    quant = METHODS[method].planned_weight_quant or step.weight_quant
    reference = step.reference
    if reference != "none":
        # A preference objective's reference follows the method: the ones that train the base
        # weights compute it before training (or keep a frozen copy: train.reference=live),
        # adapters switch off for a forward per micro-batch (`objectives.registry.reference_kind`).
        if not METHODS[method].trains_base_weights:
            reference = "forward"
        elif reference != "live":
            reference = "precomputed"
    # Innermost the micro-batch, halved (grad accumulation keeps the global batch); then
    # gradient checkpointing, off before on (sorted: False first), since it costs ~30% step
    # time; outermost the optimizer, whose lighter states change the training itself.
    for opt in (step.optimizer, *lighter_optimizers):
        for ckpt in sorted({step.gradient_checkpointing, True}):
            for mb in _halvings(step.micro_batch, global_batch):
                st = replace(
                    step,
                    micro_batch=mb,
                    gradient_checkpointing=ckpt,
                    optimizer=opt,
                    weight_quant=quant,
                    reference=reference,
                )
                b = estimate(facts, st, weight_itemsize)
                if b.needed <= budget:
                    return Plan(method, mb, global_batch // mb, ckpt, opt, step.seq_len, b)
    return None


def resolve_micro_batch(
    facts: ModelFacts,
    step: StepSettings,
    global_batch: int,
    budget: int,
    weight_itemsize: int = 4,
    enough_tokens: int | None = None,
) -> tuple[int, int, Breakdown]:
    """`train.micro_batch_size=auto`: the largest micro-batch dividing `global_batch` that fits
    (`Breakdown.needed`), or, with `enough_tokens`, the smallest that fits and holds at least
    that many tokens.

    `step.micro_batch` is the largest to try. Returns (micro_batch, grad_accum, breakdown) with
    micro_batch * grad_accum == global_batch.

    Raises:
        MemoryError: not even micro-batch 1 fits, naming the predicted peak and the levers.
    """
    fitting = []
    for mb in _halvings(step.micro_batch, global_batch):
        b = estimate(facts, replace(step, micro_batch=mb), weight_itemsize)
        if b.needed <= budget:
            fitting.append((mb, b))
    if fitting:
        full = [f for f in fitting if enough_tokens and f[0] * step.seq_len >= enough_tokens]
        # `fitting` runs largest first: full[-1] is the smallest with enough tokens, fitting[0]
        # the largest that fits.
        mb, b = full[-1] if full else fitting[0]
        return mb, global_batch // mb, b
    b = estimate(facts, replace(step, micro_batch=1), weight_itemsize)
    raise MemoryError(
        f"train.micro_batch_size=auto: even micro-batch 1 needs {b.needed / GIB:.2f} GiB, over the "
        f"budget of {budget / GIB:.2f} GiB; try train.gradient_checkpointing=true, a shorter "
        "data.max_seq_len or a lighter method (method.name=lora); `leantune plan` shows options"
    )


OPTIMIZER_LADDER = ("adamw_8bit", "adamw_4bit")
METHOD_LADDER = tuple(name for name, spec in METHODS.items() if spec.lighter_fallback)


def alternatives(inputs: PlanInputs, basis: PlanBasis) -> dict[str, ModelFacts]:
    """Facts of the configured method, then of the lighter methods the registry offers."""
    method = inputs.method
    out: dict[str, ModelFacts] = {method.name: basis.facts}
    if METHODS[method.name].lighter_than_fallbacks:  # falling back would only cost memory
        return out
    for name in METHOD_LADDER:
        if name not in out:
            light = replace(method, name=name)  # type: ignore[arg-type]
            out[name] = model_facts_for(
                basis.hf_config,
                inputs.model_dtype,
                basis.step.attn_implementation,
                light,
                inputs.trust_remote_code,
            )
    return out


def lighter_weights(
    inputs: PlanInputs,
    device: str,
    supervised_per_row: int | None = None,
    longest_row: int | None = None,
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> WeightOption | None:
    """The configured method with model.dtype=bf16, for a method that keeps fp32 base weights
    frozen (None otherwise: full fine-tuning in bf16 weights loses the updates' low bits, and a
    quantised base is already lighter)."""
    spec = METHODS[inputs.method.name]
    if inputs.model_dtype != "fp32" or spec.trains_base_weights or spec.planned_weight_quant:
        return None
    half = replace(inputs, model_dtype="bf16")
    basis = plan_basis(half, device, supervised_per_row, longest_row, global_batch, allocator)
    return WeightOption("bf16", basis.facts, basis.step, basis.weight_itemsize)


def available_optimizers(device: str) -> tuple[str, ...]:
    """The lighter optimizers of OPTIMIZER_LADDER that can run on `device` ("cpu" or "cuda")
    here: one of their backends there has its library installed (see
    `core.optim.resolve_optimizer`, which training uses to build them)."""
    offered = []
    for name in OPTIMIZER_LADDER:
        try:
            resolve_optimizer(name, device)
        except OptimizerUnavailable:
            continue
        offered.append(name)
    return tuple(offered)
