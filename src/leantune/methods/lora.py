"""LoRA through peft: low-rank adapters on the chosen linear layers, base weights frozen."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from peft import LoraConfig, get_peft_model
from torch import nn


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters."""

    r: int = 16
    """Rank of the update."""
    alpha: int = 32
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input. Off by default: it costs a copy of every adapted layer's
    input (measured +35% forward time on CPU) and short fine-tunes rarely overfit."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt; ("all-linear",) = every linear layer of the blocks (not lm_head)."""
    use_dora: bool = False
    """DoRA: split each weight into magnitude and direction and adapt the direction with LoRA."""


LORA_PRESETS: dict[str, LoraSettings] = {
    # The QLoRA paper found all linear layers necessary to match full fine-tuning.
    "default": LoraSettings(),
    # The source articles' setting.
    "seed": LoraSettings(r=8, alpha=32, dropout=0.1, target_modules=("q_proj", "v_proj")),
}


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a peft LoRA (or DoRA) model; only adapter weights train (kept in fp32)."""
    targets: str | list[str] = (
        "all-linear"
        if settings.target_modules == ("all-linear",)
        else list(settings.target_modules)
    )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        use_dora=settings.use_dora,
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        return get_peft_model(model, config, autocast_adapter_dtype=True)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence peft 0.21's call of transformers' deprecated `is_gradient_checkpointing`: a
    FutureWarning users can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield
