"""The one place that maps `method.name` to a function that wraps a model.

The training loop calls `apply_method` once and never branches on the method again: which
parameters train follows from `requires_grad`, and the saved artefact from the model's type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from leantune.config import MethodConfig
from leantune.methods.adapter import AdapterSettings, apply_adapter
from leantune.methods.freeze import apply_freeze
from leantune.methods.full import apply_full
from leantune.methods.ia3 import apply_ia3
from leantune.methods.lora import LORA_PRESETS, LoraSettings, apply_lora
from leantune.methods.prompt import apply_prefix, apply_prompt_tuning
from leantune.methods.qlora import apply_qlora
from leantune.models.quantize import Quantization, is_quantized


def _lora_settings(cfg: MethodConfig) -> LoraSettings:
    s = LORA_PRESETS[cfg.preset]
    if cfg.r is not None:
        s = replace(s, r=cfg.r)
    if cfg.alpha is not None:
        s = replace(s, alpha=cfg.alpha)
    if cfg.dropout is not None:
        s = replace(s, dropout=cfg.dropout)
    if cfg.target_modules is not None:
        s = replace(s, target_modules=tuple(cfg.target_modules))
    return s


def _ia3(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    if cfg.target_modules is None:
        return apply_ia3(model)
    return apply_ia3(model, tuple(cfg.target_modules))


def _adapter(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    settings = AdapterSettings(
        placement=cfg.adapter_placement, reduction_factor=cfg.adapter_reduction
    )
    return apply_adapter(model, settings)


def _prefix(model: nn.Module, cfg: MethodConfig, projection_default: bool) -> nn.Module:
    projection = projection_default if cfg.prefix_projection is None else cfg.prefix_projection
    return apply_prefix(model, cfg.num_virtual_tokens, projection, cfg.prefix_hidden_size)


def _prompt(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    # The text is tokenised with the tokenizer saved next to the model weights.
    tokenizer_path = getattr(model, "name_or_path", None) if cfg.prompt_init_text else None
    return apply_prompt_tuning(model, cfg.num_virtual_tokens, cfg.prompt_init_text, tokenizer_path)


METHODS: dict[str, Callable[[nn.Module, MethodConfig], nn.Module]] = {
    "full": lambda model, cfg: apply_full(model),
    "lora": lambda model, cfg: apply_lora(model, _lora_settings(cfg)),
    "dora": lambda model, cfg: apply_lora(model, replace(_lora_settings(cfg), use_dora=True)),
    "qlora": lambda model, cfg: apply_qlora(model, _lora_settings(cfg)),
    "ia3": _ia3,
    "freeze": lambda model, cfg: apply_freeze(model, cfg.last_blocks, cfg.norms),
    "adapter": _adapter,
    # Li & Liang 2021 train prefixes through an MLP; P-Tuning v2's reference code defaults to
    # training them directly. Both are peft prefix tuning (see methods/prompt.py).
    "prefix": lambda model, cfg: _prefix(model, cfg, projection_default=True),
    "ptuning_v2": lambda model, cfg: _prefix(model, cfg, projection_default=False),
    "prompt": _prompt,
}

# Learning rates that follow the seeds' advice: LoRA ~3x a base 3e-5 rate or more for small
# models, full fine-tuning ~0.1x the LoRA rate.
# IA3 trains a few scale vectors and needs a larger rate (its paper used 3e-3).
DEFAULT_LR: dict[str, float] = {
    "full": 2e-5,
    "lora": 2e-4,
    "dora": 2e-4,
    "qlora": 2e-4,
    "ia3": 3e-3,
    "freeze": 2e-5,
    # Adapters start as identities and train a few % of the weights; Houlsby et al. and
    # AdapterHub use 1e-4..1e-3.
    "adapter": 5e-4,
    # Prefix tuning: Li & Liang used 5e-5..8e-5 through the MLP on GPT-2 for many epochs;
    # P-Tuning v2 used 5e-3..1e-2 on the raw prefixes. Short runs need the upper range.
    "prefix": 5e-3,
    "ptuning_v2": 5e-3,
    # Prompt tuning trains only P input embeddings: Lester et al. used 0.3 (Adafactor);
    # AdamW setups (peft examples) use 1e-2..3e-2.
    "prompt": 3e-2,
}


def _qlora_quantization(cfg: MethodConfig, precision: str) -> Quantization:
    compute = cfg.compute_dtype if cfg.compute_dtype != "auto" else precision
    if compute == "auto":
        raise ValueError(
            "base_quantization needs the resolved train.precision "
            "(training.precision.resolve_precision), not auto"
        )
    return Quantization(quant_type="nf4", double_quant=cfg.double_quant, compute_dtype=compute)


# Methods whose base must be quantised while it loads: name -> (method config, train.precision)
# -> how. The recipe passes the result to `load_model`; every other method loads full precision.
BASE_QUANTIZATION: dict[str, Callable[[MethodConfig, str], Quantization]] = {
    "qlora": _qlora_quantization,
}


def base_quantization(cfg: MethodConfig, precision: str) -> Quantization | None:
    """How `load_model` must quantise the base for this method (None = not at all)."""
    make = BASE_QUANTIZATION.get(cfg.name)
    return make(cfg, precision) if make is not None else None


def apply_method(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    """Freeze the base and wrap `model` with the configured method."""
    for p in model.parameters():
        p.requires_grad_(False)
    return METHODS[cfg.name](model, cfg)


def trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters that train, by name (shared parameters appear once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared parameters are counted once."""
    trainable = total = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def merge_for_inference(model: nn.Module) -> nn.Module:
    """Fold adapter weights into the base in place where peft can (LoRA: W + BA), so evaluation
    after training pays no adapter overhead. Call only after the trained model has been saved.

    A 4-bit base is left unmerged: merging re-quantises W + BA, a different model from the one
    trained and saved (which is the 4-bit base plus the fp32 adapter)."""
    if is_quantized(model):
        return model
    merge = getattr(model, "merge_adapter", None)
    if callable(merge):
        merge()
    return model
