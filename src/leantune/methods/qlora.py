"""QLoRA: LoRA adapters (fp32) on a base whose block linear layers were loaded as 4-bit NF4.

The 4-bit base comes from load time (`leantune.models.quantize`, requested through
`registry.base_quantization`); this function only checks that it got one and adds the adapters.
"""

from __future__ import annotations

from dataclasses import replace

from peft import prepare_model_for_kbit_training
from torch import nn

from leantune.methods.loftq import init_loftq
from leantune.methods.lora import LoraSettings, apply_lora
from leantune.methods.spec import INIT_REPORT
from leantune.models.quantize import is_quantized


def apply_qlora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap a 4-bit model in LoRA; only the adapters train. With `settings.init` "loftq" the
    adapters start at the base's quantisation error (`methods.loftq`); the model then carries
    the `LoftqReport` as `INIT_REPORT`.

    Raises:
        ValueError: the model was not loaded in 4 bits.
        MethodError: LoftQ cannot read the base's full-precision weights.
    """
    if not is_quantized(model):
        raise ValueError(
            "method.name=qlora needs the base loaded in 4 bits; load it with "
            "load_model(..., quantization=base_quantization(...)) as the recipe does"
        )
    # Upcasts the weights that stay unquantised (norms, embeddings) to fp32 when they were
    # loaded in bf16/fp16, for stable training. Its gradient checkpointing stays off:
    # `train.gradient_checkpointing` decides that for every method.
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    wrapped = apply_lora(model, replace(settings, init="default"))
    if settings.init == "loftq":
        # After peft's default start, which drew A from the seed: LoftQ overwrites A and B.
        report = init_loftq(wrapped, required=settings.init_required)
        setattr(wrapped, INIT_REPORT, report)
    return wrapped
