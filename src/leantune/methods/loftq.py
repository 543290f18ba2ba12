"""LoftQ for QLoRA: LoRA adapters that start at the 4-bit base's quantisation error.

QLoRA's default start (B = 0) is the 4-bit model NF4(W), which is further from the model that
was pretrained than LoRA's start W. LoftQ (Li et al. 2023) starts the adapters at the best rank-r
fit of the error instead: scaling x B A = SVD_r(W - NF4(W)), so NF4(W) + scaling x B A is the
closest a rank-r adapter can bring the 4-bit model to W.

peft's `replace_lora_weights_loftq` does this on an already quantised model, reading each W from
the base's safetensors one tensor at a time (one copy of the weights in memory, as here), but
peft 0.21 runs it on CUDA or XPU only, and sets B A to the fit without dividing by LoRA's
scaling (alpha / r), so with alpha != r the adapters start at scaling x the error. This module
is that computation on the weight's own device, with the scaling, and with the layer names
checked.

One pass only: LoftQ's further passes re-quantise the base (NF4(W - scaling x B A)), and a saved
adapter is reloaded onto NF4(W) (`methods.artifacts`), so they would train against a base that
eval and export never see. With one pass the base stays the one loading made, and everything
after the start (saving, reloading, resuming, merging) is QLoRA's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantune.core.digests import local_model_dir
from leantune.methods.errors import MethodError
from leantune.models.quantize import canonical_4bit
from leantune.models.weight_files import checkpoint_shards, pread_state_dict

EXACT_SVD_SIDE = 2048
"""Layers whose smaller side is at most this get the exact SVD (the demo's and up to 1.5B's
attention weights: seconds); larger ones the randomized SVD (`_rank_r_fit`)."""
PEFT_PREFIX = "base_model.model."
"""What peft puts before the wrapped model's own module names."""


@dataclass(frozen=True)
class LoftqReport:
    """What the LoftQ start did, for the run log."""

    layers: int
    """4-bit layers whose adapters were fitted."""
    error_before: float
    """||W - NF4(W)|| / ||W||, averaged over the layers: QLoRA's default start."""
    error_after: float
    """||W - (NF4(W) + scaling x B A)|| / ||W||, averaged: LoftQ's start."""
    skipped: str | None = None
    """Why the adapters kept QLoRA's default start (method.init=auto only), or None."""

    def line(self) -> str:
        """One line for the run log."""
        if self.skipped is not None:
            return f"LoftQ skipped, B = 0 (the default start): {self.skipped}"
        return (
            f"LoftQ start: {self.layers} 4-bit layers, weight error of the 4-bit base "
            f"{self.error_before:.4f} -> {self.error_after:.4f} with the adapters "
            "(||W - W_start|| / ||W||, mean)"
        )


@torch.no_grad()
def init_loftq(model: nn.Module, adapter: str = "default", required: bool = True) -> LoftqReport:
    """Set the LoRA weights of every 4-bit layer of a peft `model` to LoftQ's one-pass start.

    The full-precision weights are read from the safetensors files of the base (the directory
    `model.name_or_path` names), one tensor at a time.

    Raises:
        MethodError: the base's safetensors cannot be found, a 4-bit layer's weight is not in
            them, or the model has no 4-bit LoRA layer.
    """
    layers = _four_bit_lora_layers(model)
    if not layers:
        raise MethodError(
            "method.init=loftq: no 4-bit layer carries a LoRA adapter (check "
            "method.target_modules); use method.init=default"
        )
    try:
        shards = _base_shards(model)
    except MethodError as e:
        if required:
            raise
        # method.init=auto: QLoRA's usual start where LoftQ cannot read the base, said in the log.
        return LoftqReport(0, 0.0, 0.0, skipped=str(e).split(": ", 1)[-1])
    before: list[float] = []
    after: list[float] = []
    with pread_state_dict(shards) as tensors:
        for name, module in layers:
            weight = _full_precision_weight(tensors, name, model)
            quantised = _dequantised(module)
            # Read on the CPU; fitted where the 4-bit weight lives (one layer's worth on a GPU).
            weight = _oriented(weight.to(quantised.device), quantised, name)
            scaling = float(module.scaling[adapter])
            a, b = _rank_r_fit(weight - quantised, module.r[adapter], scaling)
            module.lora_A[adapter].weight.data.copy_(a)
            module.lora_B[adapter].weight.data.copy_(b)
            norm = weight.norm().item() or 1.0  # an all-zero weight: its error is absolute
            before.append((weight - quantised).norm().item() / norm)
            after.append((weight - quantised - scaling * (b @ a)).norm().item() / norm)
    return LoftqReport(len(layers), sum(before) / len(before), sum(after) / len(after))


def _four_bit_lora_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """(name, layer) of every peft LoRA layer around a bitsandbytes 4-bit weight (typed Any:
    peft's layers hold their adapters in dicts that mypy reads as tensors)."""
    # By class name: peft's Linear4bit only exists where bitsandbytes imports.
    return [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear4bit" and hasattr(m, "lora_A")
    ]


def _base_shards(model: nn.Module) -> list[Path]:
    location = str(getattr(model, "name_or_path", "") or "")
    folder = local_model_dir(location) if location else None
    shards = checkpoint_shards(str(folder)) if folder is not None else None
    if shards is None:
        raise MethodError(
            f"method.init=loftq reads the base's full-precision weights from its safetensors "
            f"files, and found none for {location or 'this model'}: give model.path as a local "
            "model directory with *.safetensors, or use method.init=default"
        )
    return shards


def _full_precision_weight(tensors: dict[str, Any], name: str, model: nn.Module) -> torch.Tensor:
    own = name.removeprefix(PEFT_PREFIX)
    # Checkpoints of some families omit the base model's prefix (`model.`, `transformer.`).
    prefix = getattr(getattr(model, "get_base_model", lambda: model)(), "base_model_prefix", "")
    for key in (f"{own}.weight", f"{own.removeprefix(f'{prefix}.')}.weight"):
        if key in tensors:
            return tensors[key][:].to(torch.float32)
    raise MethodError(
        f"method.init=loftq: the base's safetensors hold no weight {own}.weight for the 4-bit "
        "layer of that name (renamed on loading?); use method.init=default"
    )


def _dequantised(module: Any) -> torch.Tensor:
    import bitsandbytes.functional as bnb_f  # only a 4-bit model gets here: bitsandbytes is there

    data, state = canonical_4bit(module.get_base_layer().weight)
    return bnb_f.dequantize_4bit(data, state).to(torch.float32)


def _oriented(weight: torch.Tensor, quantised: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` as (out, in), like the 4-bit layer: GPT-2-style Conv1D checkpoints store
    (in, out), which loading transposed before quantising."""
    candidates = [w for w in (weight, weight.T) if w.shape == quantised.shape]
    if not candidates:
        raise MethodError(
            f"method.init=loftq: {name}'s saved weight is {tuple(weight.shape)}, its 4-bit "
            f"layer {tuple(quantised.shape)}; use method.init=default"
        )
    # A square weight fits both ways: the stored orientation is the one the 4-bit weight
    # approximates (a quantisation error is far smaller than a transposition's).
    return min(candidates, key=lambda w: (w - quantised).norm().item())


def _rank_r_fit(
    residual: torch.Tensor, r: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with scaling x B A the best rank-r approximation of `residual` (its top r
    singular components, split evenly between the two factors)."""
    if min(residual.shape) <= EXACT_SVD_SIDE:
        u, s, vh = torch.linalg.svd(residual, full_matrices=False)
    else:
        # A full SVD costs ~m^2 n: over a minute per 3584 x 18944 weight on 2 cores, hours for
        # a 7B's 196 layers. The randomized one finds the top r with power iterations in
        # O(m n r) (tests: its fit within 1% of the exact one's error).
        u, s, v = torch.svd_lowrank(residual, q=min(2 * r + 8, min(residual.shape)), niter=6)
        vh = v.T
    k = min(r, s.numel())  # a rank above the layer's smaller side: the rest stays 0
    root = torch.sqrt(s[:k] / scaling)
    a = residual.new_zeros(r, residual.shape[1])
    b = residual.new_zeros(residual.shape[0], r)
    a[:k] = root[:, None] * vh[:k]
    b[:, :k] = u[:, :k] * root[None, :]
    return a, b
