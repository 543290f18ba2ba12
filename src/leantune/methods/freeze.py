"""Partial fine-tuning: train only the last N transformer blocks and/or the norm layers."""

from __future__ import annotations

from torch import nn

from leantune.methods.errors import MethodError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of an HF causal LM.

    Raises:
        ValueError: the model does not expose its blocks as `get_decoder().layers`.
    """
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("method.name=freeze: cannot find the model's transformer blocks")
    return layers


def apply_freeze(model: nn.Module, last_blocks: int, norms: bool) -> nn.Module:
    """Freeze everything, then unfreeze the last `last_blocks` blocks and, if `norms`, every norm.

    Raises:
        MethodError: nothing would train, or more blocks are asked for than the model has.
    """
    layers = decoder_layers(model)
    if last_blocks > len(layers):
        raise MethodError(
            f"method.last_blocks={last_blocks}, but the model has only {len(layers)} blocks: "
            f"use 0..{len(layers)}"
        )
    if last_blocks == 0 and not norms:
        raise MethodError("method.name=freeze trains nothing: set method.last_blocks or norms")
    for p in model.parameters():
        p.requires_grad_(False)
    # len - last_blocks, not -last_blocks: [-0:] would be every block, and last_blocks=0
    # (norms only) must unfreeze none.
    for layer in list(layers)[len(layers) - last_blocks :]:
        for p in layer.parameters():
            p.requires_grad_(True)
    if norms:
        for name, module in model.named_modules():
            # By leaf name: families name their norms input_layernorm, post_attention_layernorm,
            # norm, ln_f, ..., and their classes differ (LlamaRMSNorm, Qwen2RMSNorm, LayerNorm).
            if "norm" in name.rsplit(".", 1)[-1].lower():
                for p in module.parameters():
                    p.requires_grad_(True)
    return model
