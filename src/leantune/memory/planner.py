"""The memory planner: predict a run's peak before loading weights, and find settings that fit.

`model_facts_for` builds the model on the meta device and applies the method; `estimate` (in
memory.estimate) turns facts and step settings into a breakdown; `recommend` walks the seeds'
out-of-memory checklist in order (halve the micro-batch, turn on gradient checkpointing, lighter
optimizer states, a lighter method) and returns the fastest settings that fit, always keeping the
global batch (micro_batch x grad_accum); `resolve_micro_batch` serves `train.micro_batch_size=auto`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from leantune.config import (
    Config,
    MethodConfig,
    TrainConfig,
    configured_global_batch,
)
from leantune.errors import UserError
from leantune.memory.estimate import GIB, Breakdown, StepSettings, estimate
from leantune.memory.facts import ModelFacts, build_meta_model, model_facts
from leantune.methods.errors import MethodError
from leantune.methods.registry import METHODS, apply_method, compute_dtype

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Headroom kept below the available memory when no budget is given.
SAFETY = 0.9


def parse_size(text: str) -> int:
    """'24GiB', '24G', '512MiB', '1.5GB' or a plain byte count -> bytes (see
    `config.parse_memory_size`: bare letters and *iB are binary, *B is SI).

    Raises:
        ValueError: not a size.
    """
    from leantune.config import ConfigError, parse_memory_size

    try:
        return parse_memory_size(text)
    except ConfigError as e:
        raise ValueError(str(e)) from None


def available_memory(device: str) -> int:
    """Memory a run may use: free CUDA memory, or MemAvailable of the machine (Linux)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here to measure free memory; give a budget")
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_budget(device: str) -> int:
    """The budget when none is configured: available memory less a safety margin."""
    return int(available_memory(device) * SAFETY)


def model_facts_for(
    config: object,
    weight_dtype: str,
    attn_implementation: str,
    method: MethodConfig,
    trust_remote_code: bool = False,
) -> ModelFacts:
    """Facts of `config`'s model with `method` applied, built on the meta device (no weights).

    Raises:
        ValueError: the method cannot be applied on a meta model (named in the message).
    """
    # A method whose trainable parameters equal another's on a meta model is counted as that
    # one (QLoRA trains LoRA's adapters; its base weights are `weight_quant`'s to account for).
    counted_as = METHODS[method.name].planned_as or method.name
    counted = replace(method, name=counted_as)  # type: ignore[arg-type]
    try:
        model = build_meta_model(
            config,
            getattr(
                torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[weight_dtype]
            ),
            attn_implementation,
            lambda m: apply_method(m, counted),
            trust_remote_code,
        )
    except MethodError:  # the method's settings do not fit this model: the user's to fix
        raise
    except Exception as e:  # one that needs real weights
        raise ValueError(f"memory planner: cannot apply method.name={method.name}: {e}") from e
    return model_facts(model, config)


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
        if global_batch % mb == 0:
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

    Order: the configured method with the largest micro-batch that fits (halving; grad
    accumulation keeps the global batch), first without then with gradient checkpointing (it
    costs ~30% step time), then each of `lighter_optimizers`; then the same with
    `lighter_weights` (e.g. model.dtype=bf16: the method unchanged, at half the weights); then
    the other methods of `facts_by_method` in their given order (e.g. lora, then qlora).
    Returns None if nothing fits.
    """
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
    for opt in (step.optimizer, *lighter_optimizers):
        for ckpt in sorted({step.gradient_checkpointing, True}):
            for mb in _halvings(step.micro_batch, global_batch):
                st = replace(
                    step,
                    micro_batch=mb,
                    gradient_checkpointing=ckpt,
                    optimizer=opt,
                    weight_quant=quant,
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
        mb, b = full[-1] if full else fitting[0]
        return mb, global_batch // mb, b
    b = estimate(facts, replace(step, micro_batch=1), weight_itemsize)
    raise MemoryError(
        f"train.micro_batch_size=auto: even micro-batch 1 needs {b.needed / GIB:.2f} GiB, over the "
        f"budget of {budget / GIB:.2f} GiB; try train.gradient_checkpointing=true, a shorter "
        "data.max_seq_len or a lighter method (method.name=lora); `leantune plan` shows options"
    )


# ---------------------------------------------------------------------------------------------
# Entry points: the only functions here that read the run config.

OPTIMIZER_LADDER = ("adamw_8bit", "adamw_4bit")
METHOD_LADDER = tuple(name for name, spec in METHODS.items() if spec.lighter_fallback)


@dataclass
class PlanInputs:
    """What `leantune plan` and `micro_batch_size=auto` derive from a config."""

    facts: ModelFacts
    step: StepSettings
    global_batch: int
    weight_itemsize: int
    hf_config: object


def max_supervised_per_row(labels_per_row: list[list[int]], ignore_index: int = -100) -> int:
    """The most supervised positions in any row (bounds the loss's vocabulary projection)."""
    return max((sum(1 for x in row if x != ignore_index) for row in labels_per_row), default=0)


def plan_inputs(
    cfg: Config,
    device: str,
    supervised_per_row: int | None = None,
    longest_row: int | None = None,
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> PlanInputs:
    """Build the planner's inputs from `cfg` (the model on the meta device; no weights read).

    `longest_row` (tokens, from the data) bounds the sequence length: a micro-batch is padded to
    its longest row, which for unpacked data is usually far below data.max_seq_len (with
    max_seq_len=auto and no data, the model's context). `global_batch` replaces the configured
    one (a run whose data has fewer rows). `allocator` is the CPU allocator the run has
    (`core.allocator`), which sets the margin a plan must leave (`estimate.FIT_MARGIN`).
    """
    from leantune.methods.checks import effective_pack
    from leantune.models.attention import resolve_attention
    from leantune.models.loading import load_model_config, resolve_model, streamed_shards

    source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    # A damaged config.json is the user's to fix: load_model_config names it (exit 2).
    hf_config = load_model_config(source, cfg.model.trust_remote_code)
    attention = resolve_attention(
        cfg.model.attn_implementation,
        packed=effective_pack(cfg.data.pack, cfg.method.name),
        model_config=hf_config,
        remote_code=cfg.model.trust_remote_code,
    ).name
    facts = model_facts_for(
        hf_config, cfg.model.dtype, attention, cfg.method, cfg.model.trust_remote_code
    )
    files, file_itemsize = checkpoint_size(source.location, source.gguf_file, hf_config, facts)
    t = cfg.train
    global_batch = global_batch or configured_global_batch(t)
    micro = global_batch if t.micro_batch_size == "auto" else min(t.micro_batch_size, global_batch)
    limit = cfg.data.max_seq_len
    if limit == "auto":
        limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    step = StepSettings(
        micro_batch=micro,
        seq_len=min(limit, longest_row or limit),
        supervised_per_row=supervised_per_row,
        gradient_checkpointing=t.gradient_checkpointing is True,
        attn_implementation=attention,
        precision=planned_precision(cfg, device),
        optimizer=str(getattr(t, "optimizer", "adamw")),
        weight_quant=METHODS[cfg.method.name].planned_weight_quant,
        kl=t.kl_coef > 0,
        device=device,
        allocator=allocator,
        checkpoint_bytes=files,
        checkpoint_itemsize=file_itemsize,
        checkpoint_streamed=streamed_shards(source, hf_config, cfg.model.trust_remote_code)
        is not None,
    )
    return PlanInputs(facts, step, global_batch, DTYPE_BYTES[cfg.model.dtype], hf_config)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
"""The files `from_pretrained` reads weights from (one kind is present; safetensors first)."""


def checkpoint_size(
    location: str, gguf_file: str | None, hf_config: object, facts: ModelFacts
) -> tuple[int, int | None]:
    """(bytes of the weight files loading reads, bytes per weight in them or None if unknown).

    A local folder's files are measured; a hub id not on disk is sized from its config's dtype
    (`facts.total_params` at that dtype); (0, None) when neither is known. A GGUF file is
    dequantised on load, so its weights never share a dtype with the run's.
    """
    folder = Path(location)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else None
    if gguf_file is not None:
        gguf = folder / gguf_file
        return (gguf.stat().st_size if gguf.is_file() else 0), 0
    if folder.is_dir():
        for pattern in WEIGHT_FILES:
            sizes = [f.stat().st_size for f in folder.glob(pattern) if f.is_file()]
            if sizes:
                return sum(sizes), itemsize
        return 0, None
    return (facts.total_params * itemsize if itemsize else 0), itemsize


def planned_precision(cfg: Config, device: str) -> str:
    """train.precision as the run will resolve it on `device` (auto: measured or cached)."""
    from leantune.core.precision import resolve_precision

    if device == "cuda" and cfg.train.precision == "auto" and not torch.cuda.is_available():
        return "bf16"  # no GPU here to ask: bf16 or fp16, both 2 bytes per activation
    compute = compute_dtype(cfg.method)
    return resolve_precision(cfg.train.precision, device, compute_dtype=compute).precision


def budget_for(cfg: Config, device: str, override: str | None = None) -> int:
    """`override`, else train.memory_budget, else the default budget of `device`."""
    text = override or cfg.train.memory_budget
    return parse_size(text) if text else default_budget(device)


def alternatives(cfg: Config, inputs: PlanInputs) -> dict[str, ModelFacts]:
    """Facts of the configured method, then of the lighter methods the registry offers."""
    out: dict[str, ModelFacts] = {cfg.method.name: inputs.facts}
    if METHODS[cfg.method.name].lighter_than_fallbacks:
        return out
    for name in METHOD_LADDER:
        if name not in out:
            light = replace(cfg.method, name=name)  # type: ignore[arg-type]
            out[name] = model_facts_for(
                inputs.hf_config,
                cfg.model.dtype,
                inputs.step.attn_implementation,
                light,
                cfg.model.trust_remote_code,
            )
    return out


def lighter_weights(
    cfg: Config,
    device: str,
    supervised_per_row: int | None = None,
    longest_row: int | None = None,
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> WeightOption | None:
    """The configured method with model.dtype=bf16, for a method that keeps fp32 base weights
    frozen (None otherwise: full fine-tuning in bf16 weights loses the updates' low bits, and a
    quantised base is already lighter)."""
    spec = METHODS[cfg.method.name]
    if cfg.model.dtype != "fp32" or spec.trains_base_weights or spec.planned_weight_quant:
        return None
    half = replace(cfg, model=replace(cfg.model, dtype="bf16"))
    inputs = plan_inputs(half, device, supervised_per_row, longest_row, global_batch, allocator)
    return WeightOption("bf16", inputs.facts, inputs.step, inputs.weight_itemsize)


def available_optimizers(device: str) -> tuple[str, ...]:
    """The lighter optimizers of OPTIMIZER_LADDER that can run on `device` ("cpu" or "cuda")
    here: one of their backends there has its library installed (see
    `core.optim.resolve_optimizer`, which training uses to build them)."""
    from leantune.core.optim import OptimizerUnavailable, resolve_optimizer

    offered = []
    for name in OPTIMIZER_LADDER:
        try:
            resolve_optimizer(name, device)
        except OptimizerUnavailable:
            continue
        offered.append(name)
    return tuple(offered)


CPU_ENOUGH_TOKENS = 2048
"""micro_batch_size=auto on CPU: the smallest micro-batch of at least this many tokens (that
fits). A CPU's matmuls already run at their peak on one 2,048-token row, so more rows per
micro-batch only add activation memory (about 1.6 GB per 2,048-token row on the demo model in
bf16): benchmarks/cpu_step.py measured LoRA fwd+bwd at 286, 318 and 307 tokens per CPU-second
with 1, 2 and 4 such rows, peaking at 4.6, 8.1 and 14.7 GB."""
FALLBACK_MICRO_BATCH = 4
"""micro_batch_size=auto where the planner cannot model the run (an OOM still halves it)."""


@dataclass(frozen=True)
class PlannedMemory:
    """What the planner told a run at its start: the log line, and the numbers monitoring shows
    against the measured memory."""

    note: str
    peak_bytes: int | None
    """Predicted peak of the step (None when the planner cannot model the run)."""
    budget_bytes: int | None
    """train.memory_budget, else the device's default budget (`default_budget`) at the start."""


def _budget_or_none(cfg: Config, device: str) -> int | None:
    try:
        return budget_for(cfg, device)
    except ValueError:  # no CUDA device here to measure
        return None


def plan_for_run(
    cfg: Config,
    device: str,
    labels_per_row: list[list[int]],
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> tuple[TrainConfig, PlannedMemory]:
    """At the start of `train`: resolve `micro_batch_size=auto` and `gradient_checkpointing=auto`
    and describe the prediction.

    Returns the train config to use (a copy with micro_batch_size and grad_accum resolved when
    auto, and gradient_checkpointing always a bool) and the prediction with its log line.
    `global_batch` is the run's rows per step when its data holds fewer than the configured
    global batch.

    auto is the default, so a planner that cannot model the model or method (it builds it on the
    meta device) does not stop the run: auto then means micro-batch 4 (or the global batch when
    smaller) without checkpointing, said in the log line; and a prediction that not even
    micro-batch 1 fits is a warning with micro-batch 1 (an out of memory then stops the run with
    exit 5).
    """
    t = cfg.train
    if (
        t.gradient_checkpointing == "auto"
        and not METHODS[cfg.method.name].supports_gradient_checkpointing
    ):
        t = replace(t, gradient_checkpointing=False)
    try:
        longest = max((len(row) for row in labels_per_row), default=0) or None
        supervised = max_supervised_per_row(labels_per_row)
        inputs = plan_inputs(cfg, device, supervised, longest, global_batch, allocator)
    except Exception as e:  # a prediction is advice: it must never stop a configured run
        if isinstance(e, MethodError):  # nor let one go wrong
            raise
        return _unmodelled(cfg, t, device, global_batch, e)
    budget = _budget_or_none(cfg, device)
    if t.micro_batch_size == "auto":
        return _auto_micro_batch(cfg, t, device, inputs, budget)
    ckpt = t.gradient_checkpointing
    b = estimate(
        inputs.facts,
        replace(inputs.step, gradient_checkpointing=ckpt is True),
        inputs.weight_itemsize,
    )
    reason = ""
    if ckpt == "auto":
        ckpt = False
        if budget is not None and b.needed > budget:
            with_ckpt = estimate(
                inputs.facts,
                replace(inputs.step, gradient_checkpointing=True),
                inputs.weight_itemsize,
            )
            if with_ckpt.needed <= budget:
                ckpt, b = True, with_ckpt
                reason = (
                    f"; gradient checkpointing on (gradient_checkpointing=auto): without it the "
                    f"micro-batch of {t.micro_batch_size} would not fit"
                )
    t = replace(t, gradient_checkpointing=ckpt)
    note = f"planner predicts {describe(b)}{reason}"
    if budget is not None and b.needed > budget:
        note = _over_budget(cfg, t, device, b, budget)
    return t, PlannedMemory(note, b.peak, budget)


def describe(b: Breakdown) -> str:
    """'peak 1.20 GiB (weights ..., gradients ...), 2.04 GiB with the allocator's x1.7 margin;
    loading 0.90 GiB'."""
    text = (
        f"peak {b.peak / GIB:.2f} GiB (weights {b.weights / GIB:.2f}, "
        f"optimizer {b.optimizer / GIB:.2f}, activations {b.activations / GIB:.2f}, "
        f"loss {b.loss / GIB:.2f}, gradients {b.gradients / GIB:.2f})"
    )
    if b.margin != 1:
        text += f", {b.peak * b.margin / GIB:.2f} GiB with the allocator's x{b.margin:g} margin"
    if b.load:
        text += f"; loading the checkpoint {b.load / GIB:.2f} GiB"
    return text


class WillNotFit(UserError):
    """A configured run's live tensors alone exceed the memory the machine has available."""


def _levers(cfg: Config, t: TrainConfig) -> str:
    """What lowers the memory a run needs, as settings to change."""
    return (
        f"train.micro_batch_size (now {t.micro_batch_size}; auto picks one that fits), "
        f"train.gradient_checkpointing=true, a lighter method.name (now {cfg.method.name}; "
        f"lora, then qlora), model.dtype=bf16 (now {cfg.model.dtype}) or a shorter "
        "data.max_seq_len; `leantune plan` shows what fits"
    )


def _over_budget(cfg: Config, t: TrainConfig, device: str, b: Breakdown, budget: int) -> str:
    """The warning for a configured micro-batch whose plan does not fit `budget`.

    Raises:
        WillNotFit: on CPU without train.memory_budget, when even the live tensors (the least
            the process will hold; it was measured at 1.08x-1.65x them) exceed the available
            memory: nothing would stop the run short of the kernel's OOM killer, minutes in.
    """
    what = f"train.memory_budget of {budget / GIB:.2f} GiB"
    if t.memory_budget is None:
        what = f"{budget / GIB:.2f} GiB the {device} has available (less {1 - SAFETY:.0%})"
        if device == "cpu" and max(b.peak, b.load) > available_memory(device):
            raise WillNotFit(
                f"the memory planner predicts {describe(b)}, above the "
                f"{available_memory(device) / GIB:.2f} GiB this machine has available: the run "
                f"would be killed. Lower it with {_levers(cfg, t)}; or, to run anyway, set "
                "train.memory_budget to the memory the run may use (its out-of-memory check "
                "then stops the run in time)"
            )
    return (
        f"warning: the memory planner predicts {describe(b)}: over the {what}; the run may be "
        f"killed. Levers: {_levers(cfg, t)}"
        + (
            "; a train.memory_budget arms the out-of-memory check that halves the micro-batch"
            if t.memory_budget is None
            else ""
        )
    )


def _unmodelled(
    cfg: Config, t: TrainConfig, device: str, global_batch: int | None, e: Exception
) -> tuple[TrainConfig, PlannedMemory]:
    """The plan when the planner cannot model the run: auto means micro-batch 4, no
    checkpointing."""
    budget = _budget_or_none(cfg, device)
    if t.gradient_checkpointing == "auto":
        t = replace(t, gradient_checkpointing=False)
    if t.micro_batch_size != "auto":
        return t, PlannedMemory(f"memory planner: no prediction ({e})", None, budget)
    batch = global_batch or configured_global_batch(t)
    mb = min(FALLBACK_MICRO_BATCH, batch)
    t = replace(t, micro_batch_size=mb, grad_accum=-(-batch // mb))
    note = (
        f"micro_batch_size=auto: the memory planner cannot model this run ({e}); "
        f"micro-batch {mb} x grad_accum {t.grad_accum} (global batch {batch}; an out of "
        "memory halves it)"
    )
    return t, PlannedMemory(note, None, budget)


def _auto_micro_batch(
    cfg: Config,
    t: TrainConfig,
    device: str,
    inputs: PlanInputs,
    budget: int | None,
) -> tuple[TrainConfig, PlannedMemory]:
    """micro_batch_size=auto: the planner's pick within `budget`; with gradient_checkpointing
    =auto, checkpointing only when not even micro-batch 1 fits without it."""
    if budget is None:
        budget = budget_for(cfg, device)  # raises: no CUDA device here to measure
    enough = CPU_ENOUGH_TOKENS if device == "cpu" else None
    ckpt_options = (
        [t.gradient_checkpointing] if t.gradient_checkpointing != "auto" else [False, True]
    )
    error: MemoryError | None = None
    for ckpt in ckpt_options:
        step = replace(inputs.step, gradient_checkpointing=bool(ckpt))
        try:
            mb, accum, b = resolve_micro_batch(
                inputs.facts, step, inputs.global_batch, budget, inputs.weight_itemsize, enough
            )
        except MemoryError as e:  # a prediction: the run (and its OOM handling) decides
            error = error or e
            continue
        t = replace(t, micro_batch_size=mb, grad_accum=accum, gradient_checkpointing=bool(ckpt))
        note = (
            f"micro_batch_size=auto: {mb} x grad_accum {accum} (global batch "
            f"{inputs.global_batch}); planner predicts {describe(b)}, within a "
            f"{budget / GIB:.2f} GiB budget"
            + (
                "; gradient checkpointing on (gradient_checkpointing=auto): without it not "
                "even micro-batch 1 fits"
                if ckpt is True and len(ckpt_options) == 2
                else ""
            )
        )
        return t, PlannedMemory(note, b.peak, budget)
    ckpt = ckpt_options[-1] is True
    t = replace(t, micro_batch_size=1, grad_accum=inputs.global_batch, gradient_checkpointing=ckpt)
    note = f"warning: {error}; training with 1 x grad_accum {inputs.global_batch}"
    one = estimate(
        inputs.facts,
        replace(inputs.step, micro_batch=1, gradient_checkpointing=ckpt),
        inputs.weight_itemsize,
    )
    return t, PlannedMemory(note, one.peak, budget)
