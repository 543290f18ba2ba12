"""Frozen linear weights stored in the dtype their matmuls run in.

Under bf16/fp16 autocast a linear layer casts its fp32 weight to the low precision at every
forward, and backward keeps that copy (it needs the weight for the input's gradient). Autocast
caches the cast only for weights that require grad, so a frozen base (LoRA, adapters, IA3, the
prompt family) pays the cast in every forward (the preference objectives' reference forward too)
and holds a low-precision copy of every weight backward passes through: 211 MiB of the 609 MiB
that one 512-token forward of the demo model saves for backward.

Storing those weights in the autocast dtype once gives the same products (autocast would round
them to the same values) without either cost. Only a weight whose every use is its own layer's
forward qualifies (`frozen_linears`): not one shared with another module (a tied embedding), not
a DoRA layer's base (its magnitude is computed from the float weight), never a quantised one.
"""

from __future__ import annotations

import torch
from torch import nn


def _dora_bases(model: nn.Module) -> set[int]:
    """ids of the base layers of peft's DoRA layers (they read the weight outside forward)."""
    bases: set[int] = set()
    for module in model.modules():
        magnitude = getattr(module, "lora_magnitude_vector", None)
        base = getattr(module, "base_layer", None)
        if isinstance(magnitude, nn.ModuleDict) and len(magnitude) > 0 and base is not None:
            bases.add(id(base))
    return bases


def frozen_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain `nn.Linear` layers of `model` whose weight (and bias) is frozen fp32 and used
    only by that layer's own forward."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    dora = _dora_bases(model)
    found: list[nn.Linear] = []
    for module in model.modules():
        if type(module) is not nn.Linear or id(module) in dora:  # exact: no quantised subclass
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if all(p.dtype == torch.float32 and not p.requires_grad for p in params) and all(
            uses.get(id(p), 0) == 1 for p in params
        ):
            found.append(module)
    return found


def store_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Cast `frozen_linears(model)` to `dtype` in place; the bytes this frees (fp32 -> dtype)."""
    freed = 0
    per = 4 - torch.empty((), dtype=dtype).element_size()
    for module in frozen_linears(model):
        freed += sum(p.numel() * per for p in module.parameters())
        module.to(dtype)
    return freed
