"""Parameter counts as a user means them: logical values, not storage.

Imports nothing heavy, like `spec`: the registry re-exports `count_parameters`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

HELD_ATTR = "leantune_held_entries"
"""On a trainable parameter: how many of its entries the method keeps fixed (their gradient is
masked to zero), so they are not counted as training. IA3 on a fused `qkv_proj` holds the query
slice of its scale vector at 1."""


def logical_numel(p: nn.Parameter) -> int:
    """The number of values `p` holds: a bitsandbytes 4-bit weight (Params4bit) packs two values
    a byte, and its `quant_state.shape` is the shape of the weight it stands for."""
    # Duck-typed, not isinstance(Params4bit): bitsandbytes stays an optional import.
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def trained_numel(p: nn.Parameter) -> int:
    """The entries of a trainable `p` that train (all but those its method holds fixed)."""
    return logical_numel(p) - int(getattr(p, HELD_ATTR, 0))


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) logical parameter counts; shared parameters are counted once."""
    trainable = total = 0
    # model.parameters() yields a shared (tied) parameter once, so tied embeddings count once.
    for p in model.parameters():
        total += logical_numel(p)
        if p.requires_grad:
            trainable += trained_numel(p)
    return trainable, total
