"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(
    named_params: dict[str, nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (never on biases, norms or other 1-D tensors)."""
    decay = [p for n, p in named_params.items() if p.ndim >= 2 and "norm" not in n.lower()]
    no_decay = [p for n, p in named_params.items() if not (p.ndim >= 2 and "norm" not in n.lower())]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def warmup_cosine(step: int, max_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `max_steps`.

    `step` counts optimizer steps already taken (0 for the first update).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_ratio: float, min_lr_ratio: float
) -> LambdaLR:
    """Warmup (a share of `max_steps`) then cosine decay to a floor; steps once per update."""
    warmup = round(max_steps * warmup_ratio)
    return LambdaLR(optimizer, lambda s: warmup_cosine(s, max_steps, warmup, min_lr_ratio))
