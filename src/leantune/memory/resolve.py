"""At the start of `train`: resolve ``micro_batch_size=auto`` and ``gradient_checkpointing=auto``
with the memory planner, and say what it predicts (`plan_for_run`).

auto is the default, so a planner that cannot model the model or method (it builds it on the
meta device) does not stop the run: auto then means micro-batch 4 (or the global batch when
smaller) without checkpointing, said in the log line; and a prediction that not even micro-batch
1 fits is a warning with micro-batch 1 (an out of memory then stops the run with exit 5).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from leantune.errors import UserError
from leantune.memory import budget as budgets
from leantune.memory.estimate import GIB, Breakdown, estimate
from leantune.memory.inputs import PlanBasis, PlanInputs, max_supervised_per_row, plan_basis
from leantune.memory.planner import resolve_micro_batch
from leantune.methods.errors import MethodError
from leantune.methods.registry import METHODS

CPU_ENOUGH_TOKENS = 2048
"""micro_batch_size=auto on CPU: the smallest micro-batch of at least this many tokens (that
fits). A CPU's matmuls already run at their peak on one 2,048-token row, so more rows per
micro-batch only add activation memory (about 1.6 GB per 2,048-token row on the demo model in
bf16): benchmarks/cpu_step.py measured LoRA fwd+bwd at 286, 318 and 307 tokens per CPU-second
with 1, 2 and 4 such rows, peaking at 4.6, 8.1 and 14.7 GB."""
FALLBACK_MICRO_BATCH = 4
"""micro_batch_size=auto where the planner cannot model the run (an OOM still halves it)."""


@dataclass(frozen=True)
class BatchPlan:
    """How the run splits its global batch, and whether it checkpoints: no auto left."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool


@dataclass(frozen=True)
class PlannedMemory:
    """What the planner told a run at its start: the log line, and the numbers monitoring shows
    against the measured memory."""

    note: str
    peak_bytes: int | None
    """Predicted peak of the step (None when the planner cannot model the run)."""
    budget_bytes: int | None
    """train.memory_budget, else the device's default budget (`default_budget`) at the start."""


class WillNotFit(UserError):
    """A configured run's live tensors alone exceed the memory the machine has available."""


def _budget_or_none(configured: str | None, device: str) -> int | None:
    try:
        return budgets.budget_for(configured, device)
    except ValueError:  # no CUDA device here to measure
        return None


def plan_for_run(
    inputs: PlanInputs,
    device: str,
    labels_per_row: list[list[int]],
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> tuple[BatchPlan, PlannedMemory]:
    """Resolve the micro-batch and gradient checkpointing the run trains with, and describe
    the prediction (its log line).

    A configured micro-batch is kept (its grad_accum too); auto is the largest that fits the
    budget (`resolve_micro_batch`). `global_batch` is the run's rows per step when its data
    holds fewer than the configured global batch.

    Raises:
        WillNotFit: a configured micro-batch whose live tensors exceed the memory the CPU has
            available, without train.memory_budget (`_over_budget`).
        MethodError: the method's settings do not fit the model.
    """
    ckpt = inputs.gradient_checkpointing  # None: auto
    # auto never picks a checkpointing the method cannot run.
    if ckpt is None and not METHODS[inputs.method.name].supports_gradient_checkpointing:
        ckpt = False
    try:
        longest = max((len(row) for row in labels_per_row), default=0) or None
        supervised = max_supervised_per_row(labels_per_row)
        basis = plan_basis(inputs, device, supervised, longest, global_batch, allocator)
    except Exception as e:  # a prediction is advice: it must never stop a configured run
        if isinstance(e, MethodError):  # nor let one go wrong
            raise
        return _unmodelled(inputs, ckpt, device, global_batch, e)
    budget = _budget_or_none(inputs.memory_budget, device)
    if inputs.micro_batch is None:
        return _auto_micro_batch(inputs, ckpt, device, basis, budget)
    b = estimate(
        basis.facts,
        replace(basis.step, gradient_checkpointing=ckpt is True),
        basis.weight_itemsize,
    )
    reason = ""
    if ckpt is None:
        # auto with a configured micro-batch: checkpointing (~30% slower) only when the
        # micro-batch would not fit without it.
        ckpt = False
        if budget is not None and b.needed > budget:
            with_ckpt = estimate(
                basis.facts,
                replace(basis.step, gradient_checkpointing=True),
                basis.weight_itemsize,
            )
            if with_ckpt.needed <= budget:
                ckpt, b = True, with_ckpt
                reason = (
                    f"; gradient checkpointing on (gradient_checkpointing=auto): without it the "
                    f"micro-batch of {inputs.micro_batch} would not fit"
                )
    note = f"planner predicts {describe(b)}{reason}"
    if budget is not None and b.needed > budget:
        note = _over_budget(inputs, device, b, budget)
    batch = BatchPlan(inputs.micro_batch, inputs.grad_accum, ckpt)
    return batch, PlannedMemory(note, b.peak, budget)


def describe(b: Breakdown) -> str:
    """'peak 1.20 GiB (weights ..., gradients ...), 2.04 GiB with the allocator's x1.7 margin;
    loading 0.90 GiB'."""
    text = (
        f"peak {b.peak / GIB:.2f} GiB (weights {b.weights / GIB:.2f}, "
        f"optimizer {b.optimizer / GIB:.2f}, activations {b.activations / GIB:.2f}, "
        f"loss {b.loss / GIB:.2f}, gradients {b.gradients / GIB:.2f}"
        + (f", reference forward {b.reference / GIB:.2f}" if b.reference else "")
        + (
            f", the reference's frozen copy {b.reference_copy / GIB:.2f} (train.reference=live)"
            if b.reference_copy
            else ""
        )
        + ")"
    )
    if b.margin != 1:
        text += f", {b.peak * b.margin / GIB:.2f} GiB with the allocator's x{b.margin:g} margin"
    if b.load:
        text += f"; loading the checkpoint {b.load / GIB:.2f} GiB"
    if b.reference_pass:
        text += f"; the reference pass before training {b.reference_pass / GIB:.2f} GiB"
    return text


def _levers(inputs: PlanInputs) -> str:
    """What lowers the memory a run with a configured micro-batch needs, as settings to change."""
    return (
        f"train.micro_batch_size (now {inputs.micro_batch}; auto picks one that fits), "
        f"train.gradient_checkpointing=true, a lighter method.name (now {inputs.method.name}; "
        f"lora, then qlora), model.dtype=bf16 (now {inputs.model_dtype}) or a shorter "
        "data.max_seq_len; `leantune plan` shows what fits"
    )


def _over_budget(inputs: PlanInputs, device: str, b: Breakdown, budget: int) -> str:
    """The warning for a configured micro-batch whose plan does not fit `budget`.

    Raises:
        WillNotFit: on CPU without train.memory_budget, when even the live tensors (the least
            the process will hold; it was measured at 1.08x-1.65x them) exceed the available
            memory: nothing would stop the run short of the kernel's OOM killer, minutes in.
    """
    what = f"train.memory_budget of {budget / GIB:.2f} GiB"
    if inputs.memory_budget is None:
        what = f"{budget / GIB:.2f} GiB the {device} has available (less {1 - budgets.SAFETY:.0%})"
        available = budgets.available_memory(device) if device == "cpu" else None
        # The peak without the margin: the live tensors are the least the process will hold,
        # so only a certain kill is refused; a likely one is a warning.
        if available is not None and max(b.peak, b.load) > available:
            raise WillNotFit(
                f"the memory planner predicts {describe(b)}, above the "
                f"{available / GIB:.2f} GiB this machine has available: the run "
                f"would be killed. Lower it with {_levers(inputs)}; or, to run anyway, set "
                "train.memory_budget to the memory the run may use (its out-of-memory check "
                "then stops the run in time)"
            )
    return (
        f"warning: the memory planner predicts {describe(b)}: over the {what}; the run may be "
        f"killed. Levers: {_levers(inputs)}"
        + (
            "; a train.memory_budget arms the out-of-memory check that halves the micro-batch"
            if inputs.memory_budget is None
            else ""
        )
    )


def _unmodelled(
    inputs: PlanInputs,
    ckpt: bool | None,
    device: str,
    global_batch: int | None,
    e: Exception,
) -> tuple[BatchPlan, PlannedMemory]:
    """The plan when the planner cannot model the run: auto means micro-batch 4, no
    checkpointing."""
    budget = _budget_or_none(inputs.memory_budget, device)
    if inputs.micro_batch is not None:
        batch = BatchPlan(inputs.micro_batch, inputs.grad_accum, ckpt is True)
        return batch, PlannedMemory(f"memory planner: no prediction ({e})", None, budget)
    rows = global_batch or inputs.global_batch
    mb = min(FALLBACK_MICRO_BATCH, rows)
    # Ceiling division: the global batch is covered even when mb does not divide it.
    batch = BatchPlan(mb, -(-rows // mb), ckpt is True)
    note = (
        f"micro_batch_size=auto: the memory planner cannot model this run ({e}); "
        f"micro-batch {mb} x grad_accum {batch.grad_accum} (global batch {rows}; an out of "
        "memory halves it)"
    )
    return batch, PlannedMemory(note, None, budget)


def _auto_micro_batch(
    inputs: PlanInputs,
    ckpt: bool | None,
    device: str,
    basis: PlanBasis,
    budget: int | None,
) -> tuple[BatchPlan, PlannedMemory]:
    """micro_batch_size=auto: the planner's pick within `budget`; with gradient_checkpointing
    =auto (`ckpt` None), checkpointing only when not even micro-batch 1 fits without it."""
    if budget is None:
        budget = budgets.budget_for(inputs.memory_budget, device)  # raises: no CUDA here
    # On CUDA the largest fitting micro-batch is fastest; on CPU more rows than one 2,048-token
    # row buy no speed (see CPU_ENOUGH_TOKENS).
    enough = CPU_ENOUGH_TOKENS if device == "cpu" else None
    options = [ckpt] if ckpt is not None else [False, True]  # without checkpointing first
    error: MemoryError | None = None
    for option in options:
        step = replace(basis.step, gradient_checkpointing=option)
        try:
            mb, accum, b = resolve_micro_batch(
                basis.facts, step, basis.global_batch, budget, basis.weight_itemsize, enough
            )
        except MemoryError as e:  # a prediction: the run (and its OOM handling) decides
            error = error or e
            continue
        note = (
            f"micro_batch_size=auto: {mb} x grad_accum {accum} (global batch "
            f"{basis.global_batch}); planner predicts {describe(b)}, within a "
            f"{budget / GIB:.2f} GiB budget"
            + (
                "; gradient checkpointing on (gradient_checkpointing=auto): without it not "
                "even micro-batch 1 fits"
                if option and len(options) == 2
                else ""
            )
        )
        return BatchPlan(mb, accum, option), PlannedMemory(note, b.peak, budget)
    # Nothing fits by the prediction: micro-batch 1 with the lightest option tried, and the
    # run's own out-of-memory handling has the last word.
    last = options[-1]
    note = f"warning: {error}; training with 1 x grad_accum {basis.global_batch}"
    one = estimate(
        basis.facts,
        replace(basis.step, micro_batch=1, gradient_checkpointing=last),
        basis.weight_itemsize,
    )
    return BatchPlan(1, basis.global_batch, last), PlannedMemory(note, one.peak, budget)
