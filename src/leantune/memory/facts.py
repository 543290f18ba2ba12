"""What the planner needs to know about a model, read from a meta-device copy (no weights).

The model is built from its config on `torch.device("meta")` and the configured method is applied
to it for real, so parameter counts, dtypes and which layers train are those of the actual run,
not a formula's guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from leantune.methods.freeze import decoder_layers
from leantune.methods.frozen import frozen_linears

# Linear layers of a Llama/Qwen2/Mistral-style block, grouped by where their input comes from.
ATTN_INPUT = ("q_proj", "k_proj", "v_proj")
MLP_INPUT = ("gate_proj", "up_proj")
LINEAR_KINDS = (*ATTN_INPUT, "o_proj", *MLP_INPUT, "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers that size the activations."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class LayerTraining:
    """How one transformer block takes part in backward.

    `saves_input` are the linear kinds whose input is kept for backward (a trainable weight or
    LoRA/DoRA adapter needs it); `saves_output` the kinds scaled on their output (IA3 on k/v).
    """

    trains: bool
    saves_input: frozenset[str] = frozenset()
    saves_output: frozenset[str] = frozenset()
    norms_train: bool = False
    lora_rank_sum: int = 0
    """Sum of LoRA ranks over the block's adapted linears (their A outputs are kept)."""
    dora_out_features: int = 0
    """Sum of output widths of DoRA-adapted linears (DoRA keeps base and adapter outputs)."""
    dropout_in_features: int = 0
    """Sum of input widths of adapted linears with dropout (dropout keeps a copy and a mask)."""


@dataclass
class ModelFacts:
    """Parameter bytes and training layout of a (meta) model after the method is applied."""

    shape: ModelShape
    weight_bytes: int
    """Bytes of every parameter and buffer at its dtype (shared tensors once)."""
    trainable_params: int
    trainable_bytes: int
    largest_trainable: int
    """Elements of the largest trainable tensor (optimizer-step temporaries scale with it)."""
    total_params: int
    linear_params: int
    """Elements of the blocks' linear weights (what 4-bit quantisation would shrink)."""
    embedding_trains: bool
    head_trains: bool
    layers: list[LayerTraining] = field(default_factory=list)
    largest_tensor: int = 0
    """Elements of the largest parameter (loading converts one tensor at a time)."""
    frozen_linear_params: int = 0
    """Elements of the blocks' linear weights that a bf16/fp16 run stores in that dtype
    (`methods.frozen`: frozen, unshared fp32 weights), as `linear_params` counts them."""
    frozen_head_params: int = 0
    """Elements of the output head when a bf16/fp16 run stores it in that dtype (0: trained or
    tied to the embedding)."""


def model_shape(config: object) -> ModelShape:
    """Read the sizes of a decoder-only HF config (Llama, Qwen2, Mistral, SmolLM...).

    Raises:
        ValueError: the config lacks one of the fields the planner needs.
    """

    def get(name: str) -> Any:
        return getattr(config, name, None)

    try:
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        shape = ModelShape(
            layers=int(get("num_hidden_layers")),
            hidden=hidden,
            intermediate=int(get("intermediate_size")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab=int(get("vocab_size")),
        )
    except TypeError as e:
        raise ValueError(
            f"model config {type(config).__name__} lacks a size field the memory planner needs "
            "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)"
        ) from e
    return shape


def build_meta_model(
    config: object,
    dtype: torch.dtype,
    attn_implementation: str,
    apply: Callable[[nn.Module], nn.Module],
    trust_remote_code: bool = False,
) -> nn.Module:
    """Build the model from `config` on the meta device and wrap it with `apply` (the method)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=dtype,
            # Only the parameters and layers are read: any kernel but eager counts as sdpa.
            attn_implementation="eager" if attn_implementation == "eager" else "sdpa",
            trust_remote_code=trust_remote_code,
        )
        return apply(model)


def _layer_training(layer: nn.Module) -> LayerTraining:
    saves_in: set[str] = set()
    saves_out: set[str] = set()
    rank = dora = drop = 0
    for name, module in layer.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in LINEAR_KINDS:
            continue
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        if not trained:
            continue
        if any("ia3_l" in n for n in trained) and not getattr(module, "is_feedforward", True):
            saves_out.add(kind)
            continue
        saves_in.add(kind)
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict):
            dropout: Any = getattr(module, "lora_dropout", None)
            mag: Any = getattr(module, "lora_magnitude_vector", None)
            for key, a in lora_a.items():
                weight: Any = a.weight
                width_in, width_out = int(weight.shape[1]), int(weight.shape[0])
                rank += width_out
                if isinstance(dropout, nn.ModuleDict) and key in dropout:
                    drop += width_in if isinstance(dropout[key], nn.Dropout) else 0
                if isinstance(mag, nn.ModuleDict) and key in mag:
                    dora += int(cast(Any, mag[key]).weight.numel())  # one per output feature
    norms = any(
        p.requires_grad
        for n, m in layer.named_modules()
        if "norm" in n.rsplit(".", 1)[-1].lower()
        for p in m.parameters()
    )
    return LayerTraining(
        trains=any(p.requires_grad for p in layer.parameters()),
        saves_input=frozenset(saves_in),
        saves_output=frozenset(saves_out),
        norms_train=norms,
        lora_rank_sum=rank,
        dora_out_features=dora,
        dropout_in_features=drop,
    )


def _linear_kind(name: str) -> str:
    """`self_attn.q_proj` -> q_proj; a peft adapter wraps the linear as `q_proj.base_layer`."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def model_facts(model: nn.Module, config: object) -> ModelFacts:
    """Count bytes and trainable parameters of `model` (a meta model with its method applied)."""
    params = dict(model.named_parameters())  # shared tensors once
    tensors = list(params.values()) + [b for _, b in model.named_buffers()]
    trainable = [p for p in params.values() if p.requires_grad]
    layers = decoder_layers(model)
    linear = sum(
        m.weight.numel()
        for layer in layers
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and _linear_kind(n) in LINEAR_KINDS
    )
    emb = cast(nn.Module, model.get_input_embeddings())  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    low = {id(m) for m in frozen_linears(model)}
    frozen_linear = sum(
        m.weight.numel()
        for layer in layers
        for n, m in layer.named_modules()
        if id(m) in low and _linear_kind(n) in LINEAR_KINDS
    )
    return ModelFacts(
        shape=model_shape(config),
        weight_bytes=sum(t.numel() * t.element_size() for t in tensors),
        trainable_params=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        largest_trainable=max((p.numel() for p in trainable), default=0),
        total_params=sum(p.numel() for p in params.values()),
        linear_params=linear,
        embedding_trains=any(p.requires_grad for p in emb.parameters()),
        head_trains=isinstance(head, nn.Module) and any(p.requires_grad for p in head.parameters()),
        layers=[_layer_training(layer) for layer in layers],
        largest_tensor=max((p.numel() for p in params.values()), default=0),
        frozen_linear_params=frozen_linear,
        frozen_head_params=int(head.weight.numel()) if id(head) in low else 0,
    )
