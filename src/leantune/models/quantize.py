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
    return any(type(m).__name__ in ("Linear4bit", "Params4bit") for m in model.modules()) or any(
        type(p).__name__ == "Params4bit" for p in model.parameters()
    )
