"""What the planner reads: the configured values (`PlanInputs`, read from a config once by its
caller in `training`), and what it estimates from them (`plan_basis`: the model built on the meta
device with the method applied, and the step's settings), no weights read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from leantune.config import MethodConfig
from leantune.core.precision import resolve_precision
from leantune.memory.estimate import StepSettings
from leantune.memory.facts import ModelFacts, build_meta_model, model_facts
from leantune.methods.errors import MethodError
from leantune.methods.registry import METHODS, apply_method, compute_dtype
from leantune.objectives.registry import OBJECTIVES, REFERENCE_PASS_ROWS, reference_kind

if TYPE_CHECKING:
    from leantune.models.attention import AttnImplementation

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
"""The files `from_pretrained` reads weights from (one kind is present; safetensors first)."""


@dataclass(frozen=True)
class PlanInputs:
    """The configured values the memory planner reads (`training.planning.plan_inputs` reads
    them from a config); None where the config leaves a setting to the planner (auto)."""

    model_path: str
    gguf_file: str | None
    model_dtype: str
    """Dtype of the frozen weights (model.dtype)."""
    trust_remote_code: bool
    attn_implementation: AttnImplementation
    """model.attn_implementation as configured (auto is resolved with the model's config)."""
    method: MethodConfig
    pack: bool
    """Whether rows are packed (data.pack as the method resolves it)."""
    max_seq_len: int | None
    """Longest row; None: the model's context (data.max_seq_len=auto)."""
    micro_batch: int | None
    """Rows per micro-batch; None: the planner picks it (train.micro_batch_size=auto)."""
    grad_accum: int
    global_batch: int
    """Rows per optimizer step as configured (`config.configured_global_batch`)."""
    gradient_checkpointing: bool | None
    """None: the planner decides (train.gradient_checkpointing=auto)."""
    precision: str
    """train.precision as configured (auto is resolved on the device planned for)."""
    optimizer: str
    kl: bool
    """Whether the loss adds a KL term against the base model (train.kl_coef > 0)."""
    memory_budget: str | None
    """train.memory_budget (None: the device's default budget)."""
    objective: str = "sft"
    """train.objective: a paired one's rows hold two sequences of up to max_seq_len each, and
    one with a reference adds its forward (`objectives.registry.reference_kind`)."""
    reference: str = "auto"
    """train.reference: live keeps a frozen copy of the weights (full, freeze)."""


@dataclass(frozen=True)
class PlanBasis:
    """What the planner estimates from: the model's facts and one step's settings."""

    facts: ModelFacts
    step: StepSettings
    global_batch: int
    weight_itemsize: int
    hf_config: object


def max_supervised_per_row(labels_per_row: list[list[int]], ignore_index: int = -100) -> int:
    """The most supervised positions in any row (bounds the loss's vocabulary projection)."""
    return max((sum(1 for x in row if x != ignore_index) for row in labels_per_row), default=0)


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
    # How LoRA adapters start (method.init) changes no count, and LoftQ reads real weights.
    counted = replace(method, name=counted_as, init="default")  # type: ignore[arg-type]
    try:
        model = build_meta_model(
            config,
            _TORCH_DTYPES[weight_dtype],
            attn_implementation,
            lambda m: apply_method(m, counted),
            trust_remote_code,
        )
    except MethodError:  # the method's settings do not fit this model: the user's to fix
        raise
    except Exception as e:  # one that needs real weights
        raise ValueError(f"memory planner: cannot apply method.name={method.name}: {e}") from e
    return model_facts(model, config)


def plan_basis(
    inputs: PlanInputs,
    device: str,
    supervised_per_row: int | None = None,
    longest_row: int | None = None,
    global_batch: int | None = None,
    allocator: str = "glibc",
) -> PlanBasis:
    """The model's facts on the meta device and the configured step (no weights read).

    `longest_row` (tokens, from the data) bounds the sequence length. `global_batch` replaces
    the configured one (a run whose data has fewer rows). `allocator` is the CPU allocator the
    run has (`core.allocator`), which sets the margin a plan must leave (`estimate.FIT_MARGIN`).
    """
    # Deferred: transformers' model code takes seconds to import, and only building the model
    # needs it (the planner's search and the budget do not).
    from leantune.models.attention import resolve_attention
    from leantune.models.loading import load_model_config, resolve_model, streamed_shards

    source = resolve_model(inputs.model_path, inputs.gguf_file)
    # A damaged config.json is the user's to fix: load_model_config names it (exit 2).
    hf_config = load_model_config(source, inputs.trust_remote_code)
    attention = resolve_attention(
        inputs.attn_implementation,
        packed=inputs.pack,
        model_config=hf_config,
        remote_code=inputs.trust_remote_code,
    ).name
    facts = model_facts_for(
        hf_config, inputs.model_dtype, attention, inputs.method, inputs.trust_remote_code
    )
    files, file_itemsize = checkpoint_size(source.location, source.gguf_file, hf_config, facts)
    global_batch = global_batch or inputs.global_batch
    micro = global_batch if inputs.micro_batch is None else min(inputs.micro_batch, global_batch)
    limit = inputs.max_seq_len
    if limit is None:  # max_seq_len=auto: the model's context (2048 where the config lacks one)
        limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    spec = OBJECTIVES.get(inputs.objective)  # None: sft
    if spec is not None and spec.data == "paired":
        # data.max_seq_len bounds one prompt and answer; a row holds whole pairs, both answers
        # (training.preference_setup packs rows of twice the limit).
        limit *= 2
    trains_base = METHODS[inputs.method.name].trains_base_weights
    streamed = streamed_shards(source, hf_config, inputs.trust_remote_code) is not None
    step = StepSettings(
        micro_batch=micro,
        # A micro-batch is padded to its longest row, which for unpacked data is usually far
        # below data.max_seq_len.
        seq_len=min(limit, longest_row or limit),
        supervised_per_row=supervised_per_row,
        gradient_checkpointing=inputs.gradient_checkpointing is True,
        attn_implementation=attention,
        precision=planned_precision(inputs.precision, inputs.method, device),
        optimizer=inputs.optimizer,
        weight_quant=METHODS[inputs.method.name].planned_weight_quant,
        kl=inputs.kl,
        device=device,
        allocator=allocator,
        checkpoint_bytes=files,
        checkpoint_itemsize=file_itemsize,
        checkpoint_streamed=streamed,
        reference="none" if spec is None else reference_kind(spec, trains_base, inputs.reference),
        reference_rows=REFERENCE_PASS_ROWS,
    )
    return PlanBasis(facts, step, global_batch, DTYPE_BYTES[inputs.model_dtype], hf_config)


def checkpoint_size(
    location: str, gguf_file: str | None, hf_config: object, facts: ModelFacts
) -> tuple[int, int | None]:
    """(bytes of the weight files loading reads, bytes per weight in them or None if unknown).

    A local folder's files are measured; a hub id not on disk is sized from its config's dtype
    (`facts.total_params` at that dtype); (0, None) when neither is known. A GGUF file is
    dequantised on load, so its weights never share a dtype with the run's.
    """
    folder = Path(location)
    # `dtype` in newer transformers, `torch_dtype` in older ones.
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else None
    if gguf_file is not None:
        gguf = folder / gguf_file
        return (gguf.stat().st_size if gguf.is_file() else 0), 0
    if folder.is_dir():
        for pattern in WEIGHT_FILES:
            sizes = [f.stat().st_size for f in folder.glob(pattern) if f.is_file()]
            # The first kind present is the one loaded; a folder holding both safetensors and
            # .bin copies would be counted twice otherwise.
            if sizes:
                return sum(sizes), itemsize
        return 0, None
    return (facts.total_params * itemsize if itemsize else 0), itemsize


def planned_precision(precision: str, method: MethodConfig, device: str) -> str:
    """train.precision as the run will resolve it on `device` (auto: measured or cached)."""
    if device == "cuda" and precision == "auto" and not torch.cuda.is_available():
        return "bf16"  # no GPU here to ask: bf16 or fp16, both 2 bytes per activation
    compute = compute_dtype(method)
    return resolve_precision(precision, device, compute_dtype=compute).precision
