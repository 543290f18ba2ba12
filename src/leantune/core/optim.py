"""Optimizer and learning-rate schedule.

`train.optimizer` names an algorithm; `OPTIMIZER_BACKENDS` maps it, per device type, to the library
that implements it there (bitsandbytes or torchao for the low-bit states). A name with no backend
on the device, or whose library is missing, fails with `OptimizerUnavailable` before training.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


_FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _torch_adamw(groups: ParamGroups, lr: float, betas: tuple[float, float], eps: float) -> Any:
    params = [p for g in groups for p in g["params"]]
    # On CPU torch's default is its per-tensor loop (foreach is CUDA's default, and slower than
    # the loop on CPU); its fused CPU kernel updates each tensor in one pass: 4x faster on the
    # demo's full step, equal to the loop to fp32 rounding (not bit-identical). Plain CPU
    # tensors only: sharded (DTensor) parameters keep the loop.
    fused = bool(params) and all(
        type(p) is nn.Parameter and p.device.type == "cpu" and p.dtype in _FUSED_CPU_DTYPES
        for p in params
    )
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def _bnb(cls_name: str) -> Callable[..., Any]:
    def build(groups: ParamGroups, lr: float, betas: tuple[float, float], eps: float) -> Any:
        import bitsandbytes as bnb

        return getattr(bnb.optim, cls_name)(groups, lr=lr, betas=betas, eps=eps)

    return build


def _torchao(cls_name: str) -> Callable[..., Any]:
    # Imported when an optimizer is built, not when this module loads: most runs use neither
    # library, and both are heavy imports.
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
        # find_spec, not an import: it says whether the library is there without paying for
        # (or failing in) its import at validation time.
        if importlib.util.find_spec(backend.library) is not None:
            return backend
    needed = " or ".join(dict.fromkeys(b.library for b in backends))
    hints = "; ".join(_INSTALL[b.library] for b in backends if b.library in _INSTALL)
    raise OptimizerUnavailable(
        f"train.optimizer={name} needs {needed}, which is not installed ({hints}); "
        "or use train.optimizer=adamw"
    )


# IA3's scale vectors are stored as (n, 1) or (1, n) matrices but start at 1: decay would pull
# every scaled layer towards 0, not towards the base model.
_NO_DECAY_MARKERS = ("norm", "ia3_l")


def _decays(name: str, param: nn.Parameter) -> bool:
    # ndim >= 2: decay shrinks weights towards 0, which suits matrices; biases and gains have a
    # scale of their own that decay would only pull at.
    return param.ndim >= 2 and not any(m in name.lower() for m in _NO_DECAY_MARKERS)


def param_groups(named_params: dict[str, nn.Parameter], weight_decay: float) -> ParamGroups:
    """Weight decay on matrices only (never on biases, norms, IA3 scales or 1-D tensors)."""
    decay = [p for n, p in named_params.items() if _decays(n, p)]
    no_decay = [p for n, p in named_params.items() if not _decays(n, p)]
    # Always in this order (decay first): set_weight_decay pairs a loaded optimizer's groups
    # with these by position.
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
    return Schedule(warmup_steps, max_steps, min_lr_ratio).multiplier(step)


@dataclass(frozen=True)
class Schedule:
    """The LR multiplier of a run: linear warmup, then a cosine down to a floor.

    A fresh run's cosine starts at 1 when warmup ends. A run continued with other schedule
    settings (`run.resume=force`) restarts the cosine at `from_step` from the multiplier it had
    reached there (`start_ratio`), so the LR never jumps; see :meth:`continued`.
    """

    warmup_steps: int
    max_steps: int
    min_lr_ratio: float
    from_step: int = 0
    """Where a continued cosine starts (0: when warmup ends, from 1)."""
    start_ratio: float = 1.0
    """The multiplier at `from_step` (used when `from_step` > 0)."""

    def multiplier(self, step: int) -> float:
        """The LR multiplier for the update after `step` optimizer steps."""
        if step < self.warmup_steps:
            # step + 1: the first update already moves (an LR of 0 would waste it).
            return (step + 1) / self.warmup_steps
        restarted = self.from_step > 0 and self.from_step >= self.warmup_steps
        origin = self.from_step if restarted else self.warmup_steps
        start = self.start_ratio if restarted else 1.0
        span = max(1, self.max_steps - origin)  # a warmup as long as the run: no 0 division
        progress = min(1.0, (step - origin) / span)  # steps past max_steps stay on the floor
        low = self.min_lr_ratio
        return low + (start - low) * 0.5 * (1 + math.cos(math.pi * progress))

    def continued(
        self,
        at: int,
        reached: float,
        max_steps: int,
        min_lr_ratio: float,
        warmup_steps: int | None = None,
    ) -> Schedule:
        """This schedule changed at step `at`, where its multiplier is `reached`, to end at
        `max_steps` on the floor `min_lr_ratio`.

        Still in warmup: the warmup goes on (over `warmup_steps`, default the same number of
        steps) and the cosine then runs from 1 over the new length. After warmup: a cosine from
        `reached` down to the new floor at `max_steps`, so the LR does not jump.
        """
        warmup = self.warmup_steps if warmup_steps is None else warmup_steps
        if at < warmup:
            return Schedule(warmup, max_steps, min_lr_ratio)
        return Schedule(warmup, max_steps, min_lr_ratio, at, reached)

    def to_json(self) -> dict[str, Any]:
        """Plain data for the run progress (``RunProgress.schedule``) in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Schedule:
        """The inverse of :meth:`to_json`."""
        return cls(
            warmup_steps=int(raw["warmup_steps"]),
            max_steps=int(raw["max_steps"]),
            min_lr_ratio=float(raw["min_lr_ratio"]),
            from_step=int(raw["from_step"]),
            start_ratio=float(raw["start_ratio"]),
        )


def default_schedule(max_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Schedule:
    """Warmup over a share of `max_steps`, then a cosine to the floor."""
    return Schedule(round(max_steps * warmup_ratio), max_steps, min_lr_ratio)


def build_scheduler(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_ratio: float, min_lr_ratio: float
) -> LambdaLR:
    """Warmup (a share of `max_steps`) then cosine decay to a floor; steps once per update."""
    schedule = default_schedule(max_steps, warmup_ratio, min_lr_ratio)
    # LambdaLR multiplies each group's initial LR by this, so the peak LR stays the optimizer's.
    return LambdaLR(optimizer, lambda s: schedule.multiplier(s))


def use_schedule(scheduler: LambdaLR, schedule: Schedule) -> None:
    """Make `scheduler` follow `schedule` from its next step on (its position is kept).

    The multiplier lives in a plain function, which `LambdaLR.state_dict` leaves out: the
    schedule travels in the checkpoint's run progress (``RunProgress.schedule``) instead.
    """
    scheduler.lr_lambdas = [lambda s: schedule.multiplier(s) for _ in scheduler.lr_lambdas]


def set_peak_lr(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, peak: float, schedule: Schedule
) -> float:
    """Set every group's peak LR to `peak` and its current LR to where `schedule` is now.

    Returns:
        The LR of the next update.
    """
    lr = peak * schedule.multiplier(scheduler.last_epoch)
    # base_lrs and initial_lr both: this scheduler computes from the first, and a scheduler
    # built later on this optimizer takes its base from the second.
    scheduler.base_lrs = [peak for _ in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["initial_lr"] = peak
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps it as a tensor
            # Kept a tensor, filled in place: torchao's compiled update takes the LR as a tensor.
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = [lr for _ in scheduler.base_lrs]  # what get_last_lr() reports
    return lr


def current_multiplier(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> float:
    """Where the schedule stands: the next update's LR over its peak."""
    return float(optimizer.param_groups[0]["lr"]) / float(scheduler.base_lrs[0])


def set_weight_decay(
    optimizer: torch.optim.Optimizer, named_params: dict[str, nn.Parameter], weight_decay: float
) -> None:
    """Change the decay of the matrices' group (a loaded optimizer state keeps the old one)."""
    for group, fresh in zip(
        optimizer.param_groups, param_groups(named_params, weight_decay), strict=True
    ):
        group["weight_decay"] = fresh["weight_decay"]
