"""What `--format gguf` knows about each architecture it writes, one `GgufArch` per HF model type.

An architecture is listed only when llama.cpp runs it (its `convert_hf_to_gguf.py` maps the model
type to a GGUF architecture) and transformers' GGUF loader reads it back, so that every export is
checked by the parity check.

Each entry holds the facts of llama.cpp's conversion (the GGUF architecture, the Llama Q/K row
permutation, Gemma's norm offset, the extra metadata), the configurations llama.cpp cannot run
(refused before any weight is loaded) and the metadata transformers' GGUF loader does not read
back (it would leave the field at the config class's default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf

Fields = dict[str, Any]
"""A GGUF file's metadata, keyed without the `{arch}.` prefix (`attention.key_length`)."""


def _none(config: Any) -> list[str]:
    return []


def _no_extra(w: gguf.GGUFWriter, config: Any) -> None:
    return None


def _no_readback(fields: Fields) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GgufArch:
    """How one HF model type is written as GGUF and read back for the parity check."""

    arch: gguf.MODEL_ARCH
    permute_qk: bool = False
    """Reorder Q/K rows to llama.cpp's interleaved rope layout (llama.cpp's `LlamaModel`)."""
    norm_offset: float = 0.0
    """Added to every `*norm.weight`: Gemma's RMSNorm scales by (1 + w), llama.cpp's by w."""
    refuse: Callable[[Any], list[str]] = _none
    """Config settings llama.cpp would run differently from transformers, each as a reason."""
    write_extra: Callable[[gguf.GGUFWriter, Any], None] = _no_extra
    """Metadata beyond the common hyperparameters."""
    readback: Callable[[Fields], dict[str, Any]] = _no_readback
    """Config fields (HF name -> value) that transformers' GGUF loader leaves at the class
    default, derived from the GGUF metadata alone the way llama.cpp derives them."""
    label: str = field(default="")
    """The family names users know the model type by, for the refusal message."""


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


def _every_nth_full(n_layers: int, n: int) -> list[str]:
    """llama.cpp's fixed sliding-window pattern: every n-th layer attends to the full context."""
    return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(n_layers)]


def _gemma_attention_scalar(n_layers: int, hidden: int, heads: int, head_dim: int, big: int) -> int:
    """The query scale llama.cpp uses: hidden/heads for the 27B shape (`big` layers), else the
    head dimension (llama.cpp does not read `query_pre_attn_scalar`)."""
    return hidden // heads if n_layers == big else head_dim


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    # A config may hold head_dim = None, which means the derived value too.
    return int(head_dim or config.hidden_size // config.num_attention_heads)


def _refuse_gemma(config: Any, big: int, pattern: int) -> list[str]:
    reasons = []
    want = _gemma_attention_scalar(
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        _head_dim(config),
        big,
    )
    # A config without the field runs as llama.cpp does: only a different value is refused.
    if getattr(config, "query_pre_attn_scalar", want) != want:
        reasons.append(
            f"query_pre_attn_scalar {config.query_pre_attn_scalar} (llama.cpp scales queries "
            f"by 1/sqrt({want}) for this shape)"
        )
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        reasons.append(f"hidden_activation {act!r} (llama.cpp uses the tanh GELU)")
    types = _layer_types(config)
    if types and types != _every_nth_full(config.num_hidden_layers, pattern):
        reasons.append(
            f"layer_types {types} (llama.cpp makes every {pattern}th layer full attention and "
            "the others sliding-window)"
        )
    return reasons


def _refuse_gemma2(config: Any) -> list[str]:
    # 46 layers is the 27B shape; Gemma 2 alternates sliding and full attention.
    reasons = _refuse_gemma(config, big=46, pattern=2)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is None:
            reasons.append(f"{name} None (llama.cpp's Gemma 2 always soft-caps)")
    return reasons


def _refuse_gemma3(config: Any) -> list[str]:
    # 62 layers is the 27B shape; Gemma 3 has five sliding-window layers per full one.
    reasons = _refuse_gemma(config, big=62, pattern=6)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            reasons.append(f"{name} {getattr(config, name)} (llama.cpp's Gemma 3 has none)")
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
    if local and (local.get("rope_theta") != 10000.0 or local.get("rope_type") != "default"):
        reasons.append(f"sliding-window rope {local} (llama.cpp fixes it at theta 10000)")
    return reasons


def _write_gemma2(w: gguf.GGUFWriter, config: Any) -> None:
    w.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    w.add_final_logit_softcapping(float(config.final_logit_softcapping))
    w.add_sliding_window(int(config.sliding_window))


def _write_gemma3(w: gguf.GGUFWriter, config: Any) -> None:
    w.add_sliding_window(int(config.sliding_window))


def _read_gemma(fields: Fields, big: int) -> dict[str, Any]:
    scalar = _gemma_attention_scalar(
        int(fields["block_count"]),
        int(fields["embedding_length"]),
        int(fields["attention.head_count"]),
        int(fields["attention.key_length"]),
        big,
    )
    return {"query_pre_attn_scalar": scalar}


def _read_gemma2(fields: Fields) -> dict[str, Any]:
    return {
        **_read_gemma(fields, big=46),
        "attn_logit_softcapping": float(fields["attn_logit_softcapping"]),
        "final_logit_softcapping": float(fields["final_logit_softcapping"]),
    }


def _read_head_dim(fields: Fields) -> dict[str, Any]:
    return {"head_dim": int(fields["attention.key_length"])}


def _refuse_qwen_sliding(config: Any) -> list[str]:
    """llama.cpp's Qwen architectures have no sliding window."""
    if getattr(config, "use_sliding_window", False):
        return [f"use_sliding_window with sliding_window {config.sliding_window}"]
    return []


def _refuse_moe_routing(config: Any, normalised: bool) -> list[str]:
    reasons = _refuse_qwen_sliding(config)
    if bool(getattr(config, "norm_topk_prob", False)) != normalised:
        reasons.append(
            f"norm_topk_prob {config.norm_topk_prob} (llama.cpp's "
            f"{'always' if normalised else 'never'} renormalises the chosen experts' weights)"
        )
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        reasons.append("dense layers among the MoE layers (mlp_only_layers, decoder_sparse_step)")
    return reasons


def _write_moe(w: gguf.GGUFWriter, config: Any) -> None:
    w.add_expert_count(int(config.num_experts))
    w.add_expert_used_count(int(config.num_experts_per_tok))
    w.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared:
        w.add_expert_shared_feed_forward_length(int(shared))


def _read_moe(fields: Fields) -> dict[str, Any]:
    out = {"moe_intermediate_size": int(fields["expert_feed_forward_length"])}
    if "expert_shared_feed_forward_length" in fields:
        out["shared_expert_intermediate_size"] = int(fields["expert_shared_feed_forward_length"])
    return out


def _refuse_phi3(config: Any) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        return [f"partial_rotary_factor {factor} (transformers' GGUF loader does not read it)"]
    return []


def _write_sliding_window(w: gguf.GGUFWriter, config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window:
        w.add_sliding_window(int(window))


def _read_sliding_window(fields: Fields) -> dict[str, Any]:
    window = fields.get("attention.sliding_window")
    return {"sliding_window": int(window)} if window else {}


# OLMo 2, Mixtral and SmolLM3 convert in llama.cpp, but transformers cannot load their GGUF
# files: they are left out, so refused rather than written without a parity check.
ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch(gguf.MODEL_ARCH.LLAMA, permute_qk=True, label="Llama, SmolLM2"),
    # llama.cpp writes Mistral as Llama; its Llama has no sliding window (see `context_length`).
    "mistral": GgufArch(gguf.MODEL_ARCH.LLAMA, permute_qk=True, label="Mistral"),
    "qwen2": GgufArch(gguf.MODEL_ARCH.QWEN2, refuse=_refuse_qwen_sliding, label="Qwen2, Qwen2.5"),
    "qwen3": GgufArch(
        gguf.MODEL_ARCH.QWEN3,
        refuse=_refuse_qwen_sliding,
        # Qwen3's head_dim is its own setting, not hidden_size / heads.
        readback=_read_head_dim,
        label="Qwen3",
    ),
    "phi3": GgufArch(
        gguf.MODEL_ARCH.PHI3,
        refuse=_refuse_phi3,
        write_extra=_write_sliding_window,
        readback=_read_sliding_window,
        label="Phi-3, Phi-4",
    ),
    "gemma2": GgufArch(
        gguf.MODEL_ARCH.GEMMA2,
        norm_offset=1.0,  # RMSNorm scales by (1 + w) in transformers, by w in llama.cpp
        refuse=_refuse_gemma2,
        write_extra=_write_gemma2,
        readback=_read_gemma2,
        label="Gemma 2",
    ),
    "gemma3_text": GgufArch(
        gguf.MODEL_ARCH.GEMMA3,
        norm_offset=1.0,
        refuse=_refuse_gemma3,
        write_extra=_write_gemma3,
        readback=lambda f: _read_gemma(f, big=62),
        label="Gemma 3 text-only, e.g. 1B",
    ),
    "qwen2_moe": GgufArch(
        gguf.MODEL_ARCH.QWEN2MOE,
        refuse=lambda c: _refuse_moe_routing(c, normalised=False),
        write_extra=_write_moe,
        readback=_read_moe,
        label="Qwen1.5/Qwen2 MoE",
    ),
    "qwen3_moe": GgufArch(
        gguf.MODEL_ARCH.QWEN3MOE,
        refuse=lambda c: _refuse_moe_routing(c, normalised=True),
        write_extra=_write_moe,
        readback=_read_moe,
        label="Qwen3 MoE",
    ),
}
"""HF `model_type` -> how llama.cpp runs it. Anything else is refused before loading."""


def supported_list() -> str:
    """The supported model types with their family names, for messages."""
    return ", ".join(f"{t} ({a.label})" for t, a in ARCHITECTURES.items())
