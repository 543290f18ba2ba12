"""Optimizer and learning-rate schedule.

`train.optimizer` names an algorithm; `OPTIMIZER_BACKENDS` maps it, per device type, to the library
that implements it there (bitsandbytes or torchao for the low-bit states). A name with no backend
on the device, or whose library is missing, fails with `OptimizerUnavailable` before training.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

ParamGroups = list[dict[str, Any]]


class OptimizerUnavailable(RuntimeError):
    """No backend implements the requested optimizer on this device (or its library is missing)."""


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """torchao logs a warning for each CUDA-only extension it cannot load on a CPU build, and
    torch warns about its pytree registrations: noise that says nothing about the optimizers."""
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _torch_adamw(groups: ParamGroups, lr: float, betas: tuple[float, float], eps: float) -> Any:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def _bnb(cls_name: str) -> Callable[..., Any]:
    def build(groups: ParamGroups, lr: float, betas: tuple[float, float], eps: float) -> Any:
        import bitsandbytes as bnb

        return getattr(bnb.optim, cls_name)(groups, lr=lr, betas=betas, eps=eps)

    return build


def _torchao(cls_name: str) -> Callable[..., Any]:
    def build(groups: ParamGroups, lr: float, betas: tuple[float, float], eps: float) -> Any:
        with _quiet_torchao_import():
            import torchao.optim

        return getattr(torchao.optim, cls_name)(groups, lr=lr, betas=betas, eps=eps)

    return build


@dataclass(frozen=True)
class Backend:
    """One implementation of an optimizer name."""

    library: str
    """Python package it needs ("torch", "bitsandbytes" or "torchao")."""
    build: Callable[[ParamGroups, float, tuple[float, float], float], torch.optim.Optimizer]
    """(param groups, lr, betas, eps) -> optimizer."""
    note: str | None = None
    """Why this backend is only a stand-in for the name (`leantune validate` warns with it)."""


_BNB_8BIT = Backend("bitsandbytes", _bnb("AdamW8bit"))
_AO_8BIT = Backend("torchao", _torchao("AdamW8bit"))
_AO_4BIT = Backend("torchao", _torchao("AdamW4bit"))

# name -> device type -> backends in order of preference (the first importable one is used).
# bitsandbytes' 8-bit AdamW is preferred: it runs eagerly (torchao's compiles its update with
# torch.compile, seconds per new parameter shape on CPU). Paging moves optimizer state between GPU
# and CPU memory under pressure; on CPU there is nothing to page, so it is the plain 8-bit AdamW.
OPTIMIZER_BACKENDS: dict[str, dict[str, list[Backend]]] = {
    "adamw": {"cpu": [Backend("torch", _torch_adamw)], "cuda": [Backend("torch", _torch_adamw)]},
    "adamw_8bit": {"cpu": [_BNB_8BIT, _AO_8BIT], "cuda": [_BNB_8BIT, _AO_8BIT]},
    "adamw_4bit": {"cpu": [_AO_4BIT], "cuda": [_AO_4BIT]},
    "paged_adamw_8bit": {
        "cpu": [
            Backend(
                "bitsandbytes",
                _bnb("AdamW8bit"),
                note="train.optimizer=paged_adamw_8bit: paging only applies to GPU memory; on "
                "CPU it runs as adamw_8bit",
            )
        ],
        "cuda": [Backend("bitsandbytes", _bnb("PagedAdamW8bit"))],
    },
}

_INSTALL = {
    "bitsandbytes": "pip install 'bitsandbytes>=0.50'",
    "torchao": "pip install --no-deps 'torchao>=0.18' (it must match your torch version)",
}


def resolve_optimizer(name: str, device_type: str) -> Backend:
    """The backend that runs optimizer `name` on `device_type` ("cpu" or "cuda").

    Raises:
        OptimizerUnavailable: unknown name, no backend for the device, or its library is missing.
    """
    if name not in OPTIMIZER_BACKENDS:
        raise OptimizerUnavailable(
            f"train.optimizer={name!r}: not one of {' | '.join(OPTIMIZER_BACKENDS)}"
        )
    backends = OPTIMIZER_BACKENDS[name].get(device_type, [])
    if not backends:
        raise OptimizerUnavailable(
            f"train.optimizer={name}: no implementation on {device_type}; use train.optimizer=adamw"
        )
    for backend in backends:
        if importlib.util.find_spec(backend.library) is not None:
            return backend
    needed = " or ".join(dict.fromkeys(b.library for b in backends))
    hints = "; ".join(_INSTALL[b.library] for b in backends if b.library in _INSTALL)
    raise OptimizerUnavailable(
        f"train.optimizer={name} needs {needed}, which is not installed ({hints}); "
        "or use train.optimizer=adamw"
    )


def param_groups(named_params: dict[str, nn.Parameter], weight_decay: float) -> ParamGroups:
    """Weight decay on matrices only (never on biases, norms or other 1-D tensors)."""
    decay = [p for n, p in named_params.items() if p.ndim >= 2 and "norm" not in n.lower()]
    no_decay = [p for n, p in named_params.items() if not (p.ndim >= 2 and "norm" not in n.lower())]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    named_params: dict[str, nn.Parameter],
    lr: float,
    weight_decay: float,
    name: str = "adamw",
    device_type: str = "cpu",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """AdamW (full-precision, 8-bit or 4-bit state) with weight decay on matrices only.

    Args:
        named_params: the trainable parameters by name.
        lr: peak learning rate.
        weight_decay: decoupled weight decay for matrices (biases and norms get none).
        name: adamw | adamw_8bit | adamw_4bit | paged_adamw_8bit.
        device_type: where the parameters live ("cpu" or "cuda"); picks the backend.
        betas: Adam's moment decay rates.
        eps: Adam's denominator term.

    Raises:
        OptimizerUnavailable: see `resolve_optimizer`.
    """
    backend = resolve_optimizer(name, device_type)  # its note is a `validate` warning
    return backend.build(param_groups(named_params, weight_decay), lr, betas, eps)


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
