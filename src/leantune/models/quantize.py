"""Load-time quantisation of the frozen base (QLoRA's 4-bit NF4) through bitsandbytes.

Quantisation happens while the weights load, so it is described by a `Quantization` value that
`load_model` turns into transformers' `BitsAndBytesConfig`; the method registry says which
methods need it. NF4 quantisation is deterministic (blockwise absmax, nearest code), so loading the
same base with the same `Quantization` again gives bit-identical 4-bit weights: that is how a
saved QLoRA adapter is reloaded for evaluation.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

import torch

from leantune.models.bnb_notice import explain_kernel_notice

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class QuantizationUnavailable(RuntimeError):
    """The quantisation library is missing or cannot run here."""


@dataclass(frozen=True)
class Quantization:
    """How to quantise the linear layers of the blocks while loading (lm_head stays as is)."""

    quant_type: str = "nf4"
    """4-bit data type: nf4 (QLoRA's normal-float) or fp4."""
    double_quant: bool = True
    """Quantise the per-block scales as well (~0.37 bit per parameter saved)."""
    compute_dtype: str = "fp32"
    """dtype the 4-bit weights are dequantised to for each matmul (fp32, bf16 or fp16)."""

    def to_json(self) -> dict[str, Any]:
        """Plain data for `leantune_base.json`."""
        return {"bits": 4, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Quantization:
        """Inverse of `to_json`."""
        return cls(**{k: v for k, v in data.items() if k != "bits"})


def require_bitsandbytes() -> None:
    """Raise before anything loads when bitsandbytes is missing.

    Raises:
        QuantizationUnavailable: bitsandbytes is not installed.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationUnavailable(
            "method.name=qlora needs bitsandbytes for the 4-bit base: pip install "
            "'bitsandbytes>=0.50' (it runs on CUDA and CPU), or use method.name=lora"
        )


def bnb_config(q: Quantization) -> Any:
    """transformers' `BitsAndBytesConfig` for `q`."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
    )


def is_quantized(model: torch.nn.Module) -> bool:
    """True when `model` (or the model inside a peft wrapper) holds bitsandbytes 4-bit layers."""
    # By class name: bitsandbytes is optional, and an isinstance test would import it for
    # every model, quantised or not.
    return any(type(m).__name__ in ("Linear4bit", "Params4bit") for m in model.modules()) or any(
        type(p).__name__ == "Params4bit" for p in model.parameters()
    )


def keep_training_layout(model: torch.nn.Module) -> int:
    """Make every bitsandbytes 4-bit layer run the same kernel in eval mode as in training.

    Returns the number of layers changed. Explains, once, bitsandbytes' held-back notice about
    the optional kernel of that layout (`bnb_notice`).
    """
    changed = 0
    # On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks a Linear4bit weight in place on its
    # first eval-mode forward without grad: the weight changes shape, the block scales are
    # rounded to bf16 (outputs then differ from training's by ~1e-2 on a 256x128 layer) and
    # dequantize_4bit no longer reads it correctly. Evaluating, generating or merging a QLoRA
    # model must see the weights it was trained against, on every CPU: the repacking is off.
    for module in model.modules():
        if type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (mypy: Module attr)
            changed += 1
    if changed:
        explain_kernel_notice()  # the kernel bitsandbytes could not load serves that layout
    return changed


def canonical_4bit(weight: Any) -> tuple[torch.Tensor, Any]:
    """A `Params4bit`'s data and quant state in bitsandbytes' canonical layout.

    A weight that bitsandbytes repacked for its AVX512-BF16 CPU kernel (see
    `keep_training_layout`) is unpacked with bitsandbytes' own inverse. That inverse leaves the
    scales of a non-double-quantised weight transposed and in bf16, so they are put back in the
    flat float32 order `dequantize_4bit` reads. The repacking rounded the scales to bf16, so the
    recovered weights match the original ones to within 2^-8 of each block's absmax, not exactly.
    """
    state = weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False):
        return weight.data, state
    # Imported here: bitsandbytes is optional, and only a repacked weight needs its inverse.
    import bitsandbytes.functional as bnb_f

    data, state = bnb_f._convert_weight_packed_for_cpu_inverse(weight.data, state)
    if not state.nested and state.absmax.dim() == 2:
        state.absmax = state.absmax.T.reshape(-1).to(torch.float32).contiguous()
    return data, state
