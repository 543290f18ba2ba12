"""Per-example causal attention for packed rows (`model.attn_implementation=segments`).

A packed row holds several examples with restarting position ids. With sdpa, transformers turns
those position ids into a block-diagonal (row x row) mask, SDPA computes the whole row's
attention and throws most of it away, and every block keeps a float copy of the mask for
backward. Here the row is cut at every position-id restart and each example runs causal SDPA
alone (`is_causal=True`, no mask: the flash kernel, nothing of size row x row). The result
equals the masked path to float rounding.

The attention finds the examples from the `position_ids` every decoder layer receives, so no
caller can forget to pass them. The matching mask function builds no mask for that case.
Anything else (a padding mask, a KV cache with a prefix, one-token decoding) goes to
transformers' own sdpa mask and attention unchanged, so prefix methods and generation compute
exactly what sdpa computes. FlexAttention has no backward on CPU (torch 2.13) and torch's varlen
attention is CUDA-only, so one SDPA call per example is what runs on both; on CPU under bf16
autocast, examples of up to `SHORT_SEGMENT` tokens run as whole-segment matmuls instead
(`models.short_attention`: the flash kernel's bf16 backward is slow for them), and q, k and v
are cast to bf16 once per layer rather than at every example's call.

Segments compute only what sdpa computes. `resolve_attention` decides from the model's config
and class, before any weights load, whether they can: a model that soft-caps its attention
logits (Gemma 2), has no sdpa path in transformers (attention sinks, ...) or does not call
transformers' attention functions is refused by name when asked for segments, and `auto` gives
it the masked attention it supports (eager for Gemma 2), which keeps the examples of a packed
row apart with a mask built from the same position ids.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from leantune.errors import UserError
from leantune.models.short_attention import SHORT_SEGMENT, short_causal


class UnsupportedAttention(ValueError, UserError):
    """The model cannot attend with the configured model.attn_implementation."""


SEGMENTS = "leantune_segments"
"""The name the attention and its mask function are registered under in transformers."""
CONFIG_NAMES = {"segments": SEGMENTS, "sdpa": "sdpa", "eager": "eager"}
"""model.attn_implementation (resolved) -> transformers' attn_implementation."""


_registered: list[Callable[..., Any]] = []
"""The attention function registered under SEGMENTS (empty: the plain one)."""


def register_segment_attention() -> str:
    """Register the segment attention and its mask function with transformers (idempotent);
    returns the name to load a model with."""
    AttentionInterface.register(
        SEGMENTS, _registered[0] if _registered else segment_attention_forward
    )
    AttentionMaskInterface.register(SEGMENTS, segment_mask)
    return SEGMENTS


def keep_eager_under_compile() -> None:
    """From now on in this process, register the segment attention as a function that
    torch.compile does not trace (`train.compile`: each new layout of a packed row would be a
    new graph). The same function runs, so eager callers compute exactly what they did."""
    if not _registered:
        _registered.append(torch.compiler.disable(segment_attention_forward))
    register_segment_attention()


def transformers_name(attn_implementation: str) -> str:
    """transformers' name for a resolved model.attn_implementation (registering `segments`).

    Raises:
        ValueError: `auto` (resolve it first with `resolve_attention`) or an unknown name.
    """
    if attn_implementation not in CONFIG_NAMES:
        raise ValueError(f"model.attn_implementation={attn_implementation} is not resolved")
    if attn_implementation == "segments":
        register_segment_attention()
    return CONFIG_NAMES[attn_implementation]


AttnImplementation = Literal["auto", "segments", "sdpa", "eager"]
RESOLVED: tuple[AttnImplementation, ...] = ("segments", "sdpa", "eager")
FIELD = "model.attn_implementation"


@dataclass(frozen=True)
class AttentionChoice:
    """The attention a model is loaded with, and why when `auto` did not pick its usual one."""

    name: AttnImplementation
    """segments, sdpa or eager."""
    note: str | None = None
    """One line for the log when `auto` fell back (the model cannot use its usual pick)."""


def causal_lm_class(config: PreTrainedConfig | None, remote_code: bool = False) -> type | None:
    """The class transformers builds for `config` as a causal LM; None when no config is
    given or the model code is not transformers' own (remote code, an unknown model type)."""
    if config is None:
        return None
    auto_map = getattr(config, "auto_map", None) or {}
    # With trust_remote_code the repository's own class wins over transformers' mapping, so
    # that mapping says nothing about the class that will be built.
    if remote_code and "AutoModelForCausalLM" in auto_map:
        return None
    try:
        found: Any = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None
    # Some model types map to several classes; the first is the one from_pretrained builds.
    cls = found[0] if isinstance(found, tuple) else found
    return cls if isinstance(cls, type) else None


def segments_refusal(cls: type, config: PreTrainedConfig | None) -> str | None:
    """Why segments cannot compute the attention of model class `cls` (None: they can).

    Segments call sdpa once per example, so they compute only what sdpa computes: a model
    transformers gives no sdpa path (soft-capped logits, attention sinks, ...) is refused, and
    so is one that does not call transformers' attention functions (it would ignore them)."""
    name = cls.__name__
    # transformers' flag for model code that dispatches through AttentionInterface: without it
    # the registered segment attention would never be called.
    if not getattr(cls, "_supports_attention_backend", False):
        return f"{name} does not use transformers' attention functions"
    # The text config: a multimodal config keeps the decoder's settings one level down.
    text = config.get_text_config() if config is not None else None
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"{name} soft-caps its attention logits (attn_logit_softcapping={softcap})"
    if _masked(cls) != "sdpa":
        return f"{name} has an attention sdpa does not compute (transformers gives it no sdpa)"
    return None


def _masked(cls: type | None) -> AttnImplementation:
    """The masked attention the model can use: sdpa, or eager where transformers has no sdpa
    for it (an unknown class is sdpa's: transformers says so when loading, if it is not)."""
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def _refusal(
    name: str, cls: type | None, config: PreTrainedConfig | None, field: str
) -> str | None:
    """Why `name` cannot attend for `cls` (None: it can, or the class is not known here)."""
    if cls is None or name == "eager":
        return None
    reason = segments_refusal(cls, config) if name == "segments" else None
    if name == "sdpa" and _masked(cls) != "sdpa":
        reason = f"{cls.__name__} has no sdpa attention in transformers"
    if reason is None:
        return None
    return f"{field}={name}: {reason}; set {field}={_masked(cls)} (or auto)"


def resolve_attention(
    configured: AttnImplementation,
    *,
    packed: bool,
    model_config: PreTrainedConfig | None,
    remote_code: bool = False,
    recorded: str | None = None,
    field: str = FIELD,
) -> AttentionChoice:
    """The attention a model loads with, decided from its config before any weights load.

    `auto` is `segments` when the run trains on packed rows with transformers' own model code
    and the model's attention is what segments compute; otherwise the masked attention the
    model supports (sdpa, or eager where transformers has no sdpa for it, e.g. Gemma 2's
    soft-capped attention): it finds the examples of a packed row from the position ids and
    masks across them. One example per row gains nothing from cutting rows (its causal sdpa
    has no mask either). A resumed run keeps the one it `recorded`, so a run started before
    `auto` existed resumes unchanged.

    Args:
        configured: model.attn_implementation (or eval/generate/export's override).
        packed: the rows hold several examples (training with data.pack).
        model_config: the model's transformers config (None: not known, taken as sdpa's).
        remote_code: the model's own code builds it (trust_remote_code).
        recorded: what the run being resumed recorded.
        field: how messages name the setting.

    Raises:
        UnsupportedAttention: an explicit choice (segments or sdpa) this model cannot use.
    """
    cls = causal_lm_class(model_config, remote_code)
    if configured != "auto":
        problem = _refusal(configured, cls, model_config, field)
        if problem is not None:
            raise UnsupportedAttention(problem)
        return AttentionChoice(configured)
    # A resumed run keeps what it started with, so a run started before `auto` existed (or
    # before auto's pick changed) resumes on the same numerics.
    for kept in RESOLVED:
        if recorded == kept and _refusal(kept, cls, model_config, field) is None:
            return AttentionChoice(kept)
    masked = _masked(cls)
    if cls is None:  # remote code may not call transformers' attention functions
        return AttentionChoice(masked)
    if not packed:
        # One example per row gains nothing from cutting rows: its causal sdpa has no mask.
        lacks = f"{cls.__name__} has no sdpa attention in transformers"
        return AttentionChoice(
            masked, None if masked == "sdpa" else f"{field}=auto -> {masked}: {lacks}"
        )
    reason = segments_refusal(cls, model_config)
    if reason is None:
        return AttentionChoice("segments")
    return AttentionChoice(
        masked,
        f"{field}=auto -> {masked}: {reason}, which segments (sdpa per example) cannot "
        f"compute; packed rows attend through {masked} with a mask that keeps their examples "
        "apart",
    )


def check_supported(model: nn.Module, attn_implementation: str) -> None:
    """Refuse segments for a loaded model they cannot compute (the class a remote-code model
    brings is known only now).

    Raises:
        UnsupportedAttention: such a model with attn_implementation=segments.
    """
    if attn_implementation != "segments":
        return
    reason = segments_refusal(type(model), getattr(model, "config", None))
    if reason is not None:
        raise UnsupportedAttention(
            f"{FIELD}=segments: {reason}; set {FIELD}={_masked(type(model))} (or auto)"
        )


# ---------------------------------------------------------------------------------------------
# The mask function: none where the attention cuts rows itself, sdpa's everywhere else


def segment_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask for full-length causal attention without padding (packed or not: the attention
    reads the examples from the position ids); `sdpa_mask` for everything else."""
    if _cuts_rows(q_length, kv_length, q_offset, kv_offset, attention_mask, use_vmap):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        **kwargs,
    )


def _cuts_rows(
    q_length: int,
    kv_length: int,
    q_offset: Any,
    kv_offset: Any,
    attention_mask: torch.Tensor | None,
    use_vmap: bool,
) -> bool:
    """Whether the attention sees the whole row as queries and keys, with nothing masked but
    causality and the examples (`use_vmap` marks a model's own mask overlay)."""
    # q != kv: a KV cache (a prefix, generation); one query: decoding. Both are sdpa's.
    if use_vmap or q_length != kv_length or q_length < 2:
        return False
    # Offsets can arrive as tensors; anything but a literal 0 goes to sdpa's mask.
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int)) or q_offset or kv_offset:
        return False
    return attention_mask is None or bool(attention_mask.all())


# ---------------------------------------------------------------------------------------------
# The attention


def segment_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per example of each row: (batch, heads, seq, dim) in, (batch, seq, heads,
    dim) out, as transformers' attention functions.

    The examples are the runs of consecutive position ids. Other calls (a mask, a cache longer
    than the queries, one query) are sdpa's.

    Raises:
        UnsupportedAttention: a model feature this attention does not compute (softcap,
            position bias, non-causal attention, attention layers given no position ids).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    # The same cases `segment_mask` gives a mask: padding, a KV cache, one-token decoding.
    if attention_mask is not None or q_len != kv_len or q_len < 2:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise UnsupportedAttention(
            "model.attn_implementation=segments: this model uses attention softcapping or a "
            "position bias; set model.attn_implementation=eager"
        )
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise UnsupportedAttention(
            "model.attn_implementation=segments is for causal (decoder) attention; set "
            "model.attn_implementation=sdpa"
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # the masked path would still find the examples: refuse
        raise UnsupportedAttention(
            "model.attn_implementation=segments: this model does not pass position ids to its "
            "attention layers, so the examples of a packed row cannot be found; set "
            "model.attn_implementation=sdpa"
        )
    # One SDPA call per example: FlexAttention has no backward on CPU (torch 2.13) and torch's
    # varlen attention is CUDA-only, so this is what runs on both.
    lengths = segment_lengths(position_ids, query.shape[0], q_len)
    query, key, value = _autocast_once(query, key, value)
    groups = int(getattr(module, "num_key_value_groups", 1))
    window = kwargs.get("sliding_window")
    attend = _segment_kernel(groups, dropout, scaling, window)
    per_row = zip(query.unbind(0), key.unbind(0), value.unbind(0), lengths, strict=True)
    rows = [_row_attention(q, k, v, row, attend) for q, k, v, row in per_row]
    out = torch.stack(rows, dim=0) if len(rows) > 1 else rows[0].unsqueeze(0)
    return out.contiguous(), None  # a no-op unless the batch is one row of one example


def _autocast_once(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under CPU autocast, q, k and v in its dtype, as autocast would cast them at every
    segment's SDPA call: cast once per layer instead (rotary leaves q and k in fp32; the same
    values, and backward's casts of the gradients become one per tensor too)."""
    if tensors[0].device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    # The tensors autocast casts: floating point, not fp64.
    return tuple(
        t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], attend: Kernel
) -> torch.Tensor:
    """One row, (heads, seq, dim) in: attention within each segment, concatenated back in
    (seq, heads, dim), the layout the output projection reads (no transposed copy after)."""
    if len(lengths) == 1:
        return attend(q, k, v).transpose(0, 1)
    # `split` (not slicing) so that backward writes each input's gradient once, not one
    # zero-filled row-sized tensor per segment.
    parts = zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True)
    return torch.cat([attend(qs, ks, vs).transpose(0, 1) for qs, ks, vs in parts], dim=0)


def _short(q: torch.Tensor, n: int, dropout: float) -> bool:
    """Whether a segment runs as whole-segment matmuls (`models.short_attention`): short, bf16,
    on CPU (where the flash kernel's bf16 backward is slow for it), without dropout."""
    cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    return cpu_bf16 and n <= SHORT_SEGMENT and not dropout


def _segment_kernel(
    groups: int, dropout: float, scaling: float | None, window: int | None
) -> Kernel:
    """Causal SDPA on one segment (heads, len, dim), with grouped KV heads and an optional
    sliding window (a segment no longer than the window is plain causal)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[1]
        if _short(q, n, dropout) and (window is None or n <= window):
            return short_causal(q, k, v, q.shape[-1] ** -0.5 if scaling is None else scaling)
        # (1, heads, len, dim): the CPU flash kernel takes 4-D inputs only (3-D ones fall
        # back to the math kernel, which materialises the attention weights).
        q, k, v = q[None], k[None], v[None]
        if window is None or n <= window:
            # Grouped KV heads go to the kernel as they are (enable_gqa), as sdpa does
            # without a mask: no repeated copy of K and V.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=groups > 1
            )[0]
        # A segment longer than the window needs a banded mask (causal and within the window),
        # and with a mask the KV heads are expanded, as transformers' sdpa path does.
        i = torch.arange(n, device=q.device)
        d = i[:, None] - i[None, :]
        mask = (d >= 0) & (d < window)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling
        )[0]

    return attend


# ---------------------------------------------------------------------------------------------
# Segments from position ids


_cache: tuple[weakref.ref[torch.Tensor], int, int, list[list[int]]] | None = None
"""The last position ids' segments: every layer (and checkpointing's recompute) asks again
for the same tensor, and reading it costs a device sync on an accelerator."""


def segment_lengths(position_ids: torch.Tensor, batch: int, seq: int) -> list[list[int]]:
    """Per row, the lengths of its runs of consecutive position ids (they sum to `seq`).

    A new example starts wherever a position id is not the previous one plus one, as
    transformers' `find_packed_sequence_indices` decides for the masked path."""
    global _cache
    if _cache is not None:
        ref, version, rows, lengths = _cache
        # A weak reference and the tensor's version counter: a freed tensor whose id is reused,
        # or one written in place, is not mistaken for the cached one.
        if ref() is position_ids and version == position_ids._version and rows == batch:
            return lengths
    # expand: one position-id row may stand for the whole batch (broadcast by the model).
    lengths = _lengths(position_ids.expand(batch, seq))
    _cache = (weakref.ref(position_ids), position_ids._version, batch, lengths)
    return lengths


def _lengths(position_ids: torch.Tensor) -> list[list[int]]:
    pos = position_ids.detach()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    seq = pos.shape[1]
    out = []
    for row in starts.cpu():  # one transfer (one device sync) for the whole batch
        idx = [*row.nonzero().flatten().tolist(), seq]
        out.append([b - a for a, b in itertools.pairwise(idx)])
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation keeps sdpa


def _hf_model(model: nn.Module) -> PreTrainedModel | None:
    """The transformers model inside `model` (itself, or under peft's wrappers)."""
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    return None


@contextmanager
def sdpa_attention(model: nn.Module) -> Any:
    """Within the block, `model` attends with sdpa (evaluation and generation stay on the
    path they always took); the training attention comes back afterwards."""
    hf = _hf_model(model)
    current = hf.config._attn_implementation if hf is not None else None
    if hf is None or current != SEGMENTS:
        yield
        return
    # Evaluation and generation keep sdpa, the path they always took: their padding masks and
    # KV caches are sdpa's cases anyway.
    hf.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        hf.set_attn_implementation(SEGMENTS)
