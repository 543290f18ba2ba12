"""Full fine-tuning: every parameter trains."""

from __future__ import annotations

from torch import nn


def apply_full(model: nn.Module) -> nn.Module:
    """Unfreeze every parameter and return the model unchanged otherwise."""
    # Undoes apply_method's freeze: full fine-tuning is the one method with nothing to add.
    for p in model.parameters():
        p.requires_grad_(True)
    return model
