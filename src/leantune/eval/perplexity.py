"""Held-out loss and perplexity."""

from __future__ import annotations

import math

import torch
from torch import nn

from leantune.core.precision import autocast
from leantune.data.loader import collate
from leantune.data.packing import Row
from leantune.models.loss import count_supervised, token_loss_sum


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    rows: list[Row],
    pad_id: int,
    batch_size: int = 8,
    precision: str = "fp32",
    device: torch.device | None = None,
) -> dict[str, float]:
    """Mean token loss over all supervised tokens of `rows`, and its perplexity."""
    device = device or next(model.parameters()).device
    # Restore the caller's mode at the end: a mid-training eval must not leave dropout off.
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i : i + batch_size], pad_id).items()}
        with autocast(device.type, precision):
            # Summed, not a per-batch mean: dividing once below weights every supervised
            # token equally, however the tokens fall across batches.
            total += float(token_loss_sum(model, batch))
        count += count_supervised(batch["labels"])
    model.train(was_training)
    loss = total / max(1, count)  # no supervised tokens: 0.0, not ZeroDivisionError
    # math.exp overflows past ~709; the cap keeps a diverged model's perplexity a finite number.
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(count)}
