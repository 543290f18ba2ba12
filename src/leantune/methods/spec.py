"""What leantune knows about one fine-tuning method, in one frozen dataclass.

`methods.registry.METHODS` holds one `MethodSpec` per `method.name`; every module that needs a
fact about a method (config validation, the memory planner, the OOM advice, the recipe) reads it
from there instead of comparing method names. This module imports nothing heavy: the config
reads these facts before torch loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from leantune.config import MethodConfig
    from leantune.models.quantize import Quantization

INIT_REPORT = "leantune_init_report"
"""The attribute of a wrapped model that holds what its LoRA initialisation did: an object with
a `line()` for the run log (`methods.loftq.LoftqReport`); absent for the default start."""


@dataclass(frozen=True)
class LrAdvice:
    """A learning rate that is risky for a method: `validate` warns at or above `high`."""

    high: float
    """The lowest rate that gets the warning."""
    usual: str
    """The usual range, as the warning shows it (e.g. "1e-5..5e-5")."""
    what: str
    """The method as the warning names it (e.g. "full fine-tuning")."""


@dataclass(frozen=True)
class MethodSpec:
    """One fine-tuning method: how it wraps a model and what follows from it for a run."""

    name: str
    """`method.name`."""
    description: str
    """What trains, in a few words (the README's methods table shows the same text)."""
    apply: Callable[[nn.Module, MethodConfig], nn.Module]
    """Wrap a model whose parameters are all frozen; what it leaves trainable is what trains."""
    default_lr: float
    """`train.lr` when it is unset."""
    base_quantization: Callable[[MethodConfig, str], Quantization] | None = None
    """(method config, resolved train.precision) -> how `load_model` quantises the base while
    it loads; None = the base loads in model.dtype."""
    needs_unpacked_data: bool = False
    """One example per row: the method adds virtual tokens (a prefix cache, prepended
    embeddings), which packed rows' restarting position ids cannot keep apart; `data.pack=true`
    is refused and `data.pack=auto` does not pack."""
    supports_gradient_checkpointing: bool = True
    """False where checkpointed blocks would drop what the method trains (the prefix lives in
    the KV cache, which transformers drops in checkpointed blocks)."""
    trains_base_weights: bool = False
    """The method trains the model's own weights, not added ones (there is no adapter to
    disable, and a lighter method means one with adapters)."""
    mergeable: bool = False
    """The trained weights fold into the base (export writes one plain model)."""
    lora_settings: bool = False
    """`method.preset`, `r`, `alpha`, `dropout` and `target_modules` configure it as LoRA."""
    default_init: str = "default"
    """What `method.init=auto` (the default) starts a LoRA method's adapters with."""
    check: Callable[[MethodConfig], str | None] | None = None
    """A check of the method's own fields before anything loads: the error message, or None."""
    lr_advice: LrAdvice | None = None
    """A learning rate that gets a warning."""
    planned_as: str | None = None
    """The method whose trainable parameters the planner counts on its meta model instead (the
    same adapters on a base that only loading can quantise)."""
    planned_weight_quant: str | None = None
    """The base weights' format as `memory.estimate` names it (None = model.dtype)."""
    lighter_fallback: bool = False
    """`leantune plan` offers it, in registry order, when the configured method does not fit."""
    lighter_than_fallbacks: bool = False
    """It trains fewer parameters than the fallbacks, so the planner offers none of them."""

    @property
    def kl_capable(self) -> bool:
        """`train.kl_coef` works: its base is the same model with the adapters disabled."""
        return not self.trains_base_weights
