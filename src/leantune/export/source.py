"""What an export starts from: a run's `final/` model, loaded, and the merged model built from it.

A run directory exports its `final/`; a model or adapter directory exports itself. Adapter methods
(LoRA, DoRA, IA3) are folded into the base with peft's `merge_and_unload`. A 4-bit base
(bitsandbytes `Params4bit`, as QLoRA trains on) is dequantised to float32 first and the adapter is
merged into those dequantised weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.errors import UserError
from leantune.export.parity import LogitsFn
from leantune.layout import RunPaths
from leantune.methods.artifacts import check_model_path, is_adapter_dir, load_for_inference
from leantune.methods.lora import quiet_peft
from leantune.models.attention import AttnImplementation
from leantune.models.quantize import canonical_4bit


class ExportError(ValueError, UserError):
    """The requested export cannot be made from this input; the message says why and what to do.

    A user's mistake (exit 2), told apart from a written export that fails its parity check
    (`ParityError`, exit 1)."""


@dataclass
class ExportSource:
    """The loaded source model (eval mode, float32) and where it came from."""

    path: str
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    adapter_dir: Path | None


def resolve_export_input(path: str) -> str:
    """A run directory resolves to its `final/`; anything else is returned as given."""
    final = RunPaths(Path(path).expanduser()).final
    return str(final) if final.is_dir() else path


def load_source(path: str, attn_implementation: AttnImplementation = "auto") -> ExportSource:
    """Load a run, model directory, adapter directory or demo name in float32 for export.

    Raises:
        ModelPathError: the path is not a model (e.g. a run without `final/`, saying how to
            finish it) or cannot be loaded.
        UnsupportedAttention: an explicit `attn_implementation` the model cannot use.
    """
    resolved = resolve_export_input(path)
    check_model_path(resolved)
    model, tokenizer = load_for_inference(resolved, "fp32", attn_implementation=attn_implementation)
    p = Path(resolved)
    # Kept for the adapter format's copy and for a 4-bit merge, which reloads the adapter.
    adapter_dir = p if p.is_dir() and is_adapter_dir(p) else None
    return ExportSource(resolved, model, tokenizer, adapter_dir)


def model_logits_fn(model: nn.Module) -> LogitsFn:
    """Logits of an in-memory HF or peft causal LM (no KV cache)."""

    def fn(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=False).logits.float()

    return fn


def is_4bit(module: nn.Module) -> bool:
    """True when some weight is a bitsandbytes 4-bit parameter."""
    # By name: bitsandbytes is optional, and a model without 4-bit weights need not import it.
    return any(type(p).__name__ == "Params4bit" for p in module.parameters())


def dequantize_4bit(model: nn.Module) -> int:
    """Replace every bitsandbytes 4-bit linear layer by a float32 `nn.Linear` holding its
    dequantised weight, and drop the model's quantisation config. Returns the count replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if type(weight).__name__ != "Params4bit":
            continue
        # Imported only here: bitsandbytes is optional, and only a 4-bit model needs it.
        import bitsandbytes.functional as bnb_f

        # A weight that bitsandbytes repacked for its AVX512-BF16 CPU kernel is unpacked first.
        data, state = canonical_4bit(weight)
        dense = bnb_f.dequantize_4bit(data, state).to(torch.float32)
        bias = getattr(module, "bias", None)
        linear = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None)
        linear.weight.data.copy_(dense)
        if bias is not None:
            linear.bias.data.copy_(bias.data.float())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
        replaced += 1
    # With the quantisation marks left, the saved config would still name bitsandbytes, and
    # from_pretrained would quantise the float export again (and need bitsandbytes to load it).
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        setattr(model, "is_quantized", False)  # noqa: B010 (mypy: nn.Module attribute)
    return replaced


def merge_into_base(
    model: nn.Module, adapter_dir: Path | None
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Fold the adapter into its base; dequantise a 4-bit base first. Consumes `model`.

    Args:
        model: the source model, a plain HF model or a `PeftModel`.
        adapter_dir: the adapter directory `model` was loaded from (reloaded onto the dequantised
            base when the base is 4-bit).

    Returns:
        The merged plain HF model (float32, eval mode) and what merging did, for the report.

    Raises:
        ExportError: the adapter kind cannot be merged (e.g. prompt tuning).
    """
    info: dict[str, Any] = {"merged_adapter": isinstance(model, PeftModel)}
    if not isinstance(model, PeftModel):
        if is_4bit(model):
            info["dequantized_layers"] = dequantize_4bit(model)
        # Every writer and the parity reference assume float32 weights in eval mode.
        return model.float().eval(), info  # type: ignore[return-value]
    # Prompt-learning adapters add virtual tokens, not weight deltas: nothing to fold in.
    if (
        not callable(getattr(model, "merge_and_unload", None))
        or model.peft_config[model.active_adapter].is_prompt_learning
    ):
        raise ExportError(
            "this adapter kind cannot be merged into the base weights; "
            "export it with --format adapter instead"
        )
    if is_4bit(model):
        if adapter_dir is None:
            raise ExportError("a 4-bit base can only be merged from an adapter directory on disk")
        # Merging into 4-bit weights would requantise the sum. unload() drops the adapter
        # unmerged, so it is reloaded from disk onto the dequantised float32 weights: the values
        # it was trained against.
        base = model.unload()
        info["dequantized_layers"] = dequantize_4bit(base)
        with quiet_peft():
            model = PeftModel.from_pretrained(base.float(), adapter_dir)
    merged = model.merge_and_unload()
    return merged.float().eval(), info
