"""IA3 through peft: learned per-channel rescaling of keys, values and the MLP's inner activation
(the input of its down projection), as Liu et al. 2022 define it.

Families with a fused attention projection (Phi-3's `qkv_proj`: queries, keys and values side
by side) are scaled through it, with the query slice of its scale vector held at 1: the keys and
values are scaled exactly as on `k_proj`/`v_proj`, and the saved adapter is a plain peft IA3
adapter that any peft loads and merges.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import IA3Config, get_peft_model
from torch import nn

from leantune.methods.counting import HELD_ATTR
from leantune.methods.coverage import SCALED_ATTR, unmatched_target, unwrapped_name
from leantune.methods.errors import MethodError
from leantune.methods.freeze import decoder_layers
from leantune.methods.lora import quiet_peft

# What IA3 scales in Llama/Qwen2/Mistral-style blocks (peft's own default for them).
DEFAULT_IA3_TARGETS = ("k_proj", "v_proj", "down_proj")
DEFAULT_IA3_FEEDFORWARD = ("down_proj",)
FUSED_QKV = "qkv_proj"
"""A fused attention projection laid out as [queries | keys | values] (Phi-3, Phi-4)."""


def _matching(model: nn.Module, name: str) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (n == name or n.endswith(f".{name}"))
    ]


def _block_linear(model: nn.Module) -> list[str]:
    layers = decoder_layers(model)
    return [n for n, m in layers.named_modules() if isinstance(m, nn.Linear)]


def resolve_ia3_targets(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Full names of the linear layers IA3 scales.

    The default scales keys and values through `k_proj`/`v_proj`, or through a fused `qkv_proj`
    where the family has no separate ones, and the MLP through `down_proj` (its input).

    Raises:
        MethodError: a name that matches no linear layer, or no keys and values to scale.
    """
    if names == DEFAULT_IA3_TARGETS:
        attention = _matching(model, "k_proj") + _matching(model, "v_proj")
        # No k_proj/v_proj (Phi-3): the fused projection, whose query part `_hold_queries`
        # keeps unscaled.
        attention = attention or _matching(model, FUSED_QKV)
        if not attention:
            raise MethodError(
                "method.name=ia3: the model has no k_proj/v_proj or fused qkv_proj layers to "
                "scale keys and values; name its key and value layers in method.target_modules"
            )
        return attention + _matching(model, "down_proj")
    targets: list[str] = []
    for name in names:
        hits = _matching(model, name)
        if not hits:
            raise MethodError(unmatched_target(model, name, "linear layer", _block_linear(model)))
        targets += [n for n in hits if n not in targets]
    return targets


def apply_ia3(
    model: nn.Module,
    target_modules: tuple[str, ...] = DEFAULT_IA3_TARGETS,
    feedforward_modules: tuple[str, ...] = DEFAULT_IA3_FEEDFORWARD,
) -> nn.Module:
    """Wrap `model` in a peft IA3 model: one learned scale vector per targeted layer.

    `feedforward_modules` (names among the targets) are scaled on their input, the others on
    their output; a fused `qkv_proj` on the key and value part of its output only.
    """
    targets = resolve_ia3_targets(model, target_modules)
    feedforward = [t for t in targets if t.rsplit(".", 1)[-1] in feedforward_modules]
    config = IA3Config(
        target_modules=targets, feedforward_modules=feedforward, task_type="CAUSAL_LM"
    )
    with quiet_peft():
        wrapped = get_peft_model(model, config)
    # peft's IA3 scales a target's whole output; a fused qkv_proj's queries must stay as they are.
    for name, module in wrapped.named_modules():
        if unwrapped_name(name).endswith(f".{FUSED_QKV}") and hasattr(module, "ia3_l"):
            _hold_queries(module, model.config)
    return wrapped


def _hold_queries(layer: nn.Module, config: object) -> None:
    """Keep the query slice of a fused qkv_proj's IA3 output scales at 1 (see the module doc).

    Raises:
        MethodError: the layer's width is not queries + keys + values of the config.
    """
    c: Any = config
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)  # absent: no GQA
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    queries = heads * head_dim
    ia3_l: Any = layer.ia3_l  # peft's ParameterDict of scales, by adapter name
    for scales in ia3_l.values():
        if scales.numel() != queries + 2 * kv_heads * head_dim:
            raise MethodError(
                f"method.name=ia3: {FUSED_QKV} has {scales.numel()} outputs, not the "
                f"{queries} queries + 2 x {kv_heads * head_dim} keys/values of the config"
            )
        # The query slice's gradient masked to zero; IA3 scales get no weight decay
        # (core.optim), so AdamW never moves it from 1, and a scale of 1 merges to the same
        # weights. The mask is built on the CPU and follows the gradient to its device, so it
        # holds wherever the model is moved later.
        mask = torch.ones_like(scales, device="cpu")
        mask.view(-1)[:queries] = 0
        scales.register_hook(lambda g, m=mask: g * m.to(g.device, g.dtype))
        setattr(scales, HELD_ATTR, queries)  # counting: these entries do not train
    setattr(layer, SCALED_ATTR, "k, v")
    layer.register_forward_pre_hook(_still_held)


def _still_held(layer: nn.Module, args: object) -> None:
    """Refuse a forward whose scale vectors are no longer the masked ones.

    Raises:
        MethodError: a scale vector of the layer is not the masked one.
    """
    ia3_l: Any = layer.ia3_l
    # The mask lives on the parameter object: a strategy that replaces the parameters (FSDP2
    # shards them into new ones) would drop it and train the query scales.
    if not all(hasattr(scales, HELD_ATTR) for scales in ia3_l.values()):
        raise MethodError(
            f"method.name=ia3 on a fused {FUSED_QKV}: the parallel strategy replaced the scale "
            "vectors whose query part is held at 1; use dist.strategy=ddp (or one process)"
        )
