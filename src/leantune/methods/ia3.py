"""IA3 through peft: learned per-channel rescaling of keys, values and the MLP down projection."""

from __future__ import annotations

from peft import IA3Config, get_peft_model
from torch import nn

from leantune.methods.lora import quiet_peft

# peft's IA3 default for Llama/Qwen2/Mistral-style blocks, written out so the choice is visible.
DEFAULT_IA3_TARGETS = ("k_proj", "v_proj", "down_proj")
DEFAULT_IA3_FEEDFORWARD = ("down_proj",)


def apply_ia3(
    model: nn.Module,
    target_modules: tuple[str, ...] = DEFAULT_IA3_TARGETS,
    feedforward_modules: tuple[str, ...] = DEFAULT_IA3_FEEDFORWARD,
) -> nn.Module:
    """Wrap `model` in a peft IA3 model: one learned scale vector per targeted layer.

    `feedforward_modules` (a subset of `target_modules`) are scaled on their input, the others on
    their output.
    """
    config = IA3Config(
        target_modules=list(target_modules),
        feedforward_modules=[m for m in feedforward_modules if m in target_modules],
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        return get_peft_model(model, config)
