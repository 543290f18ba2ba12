"""Prompt-learning methods through peft: prompt tuning, prefix tuning and P-Tuning v2.

- `prompt`: learned virtual-token embeddings prepended to the input (Lester et al. 2021; peft
  `PromptTuningConfig`).
- `prefix`: learned key/value prefixes on every layer, reparameterised through a two-layer MLP
  during training as in Li & Liang 2021 (peft `PrefixTuningConfig(prefix_projection=True)`).
- `ptuning_v2`: deep prompt tuning on every layer (Liu et al. 2022). It is the same mechanism as
  prefix tuning - peft has no separate type - with the reparameterisation off by default, as in
  the paper's reference code (`prefix_projection=False`); `method.prefix_projection` switches it.

All three start from real tokens by default (`methods.virtual_init`), not peft's N(0, 1).

Both prefix variants save in peft's format; with the MLP on, peft saves the computed key/value
prefixes (not the MLP), which is all inference needs.

The helpers below compute what peft's forward and generate compute, from peft's public
`get_prompt`, for the two places that cannot use peft's own path: the loss (which runs the output
projection only on supervised positions; `with_virtual_tokens` hands it `prompt_learning_hidden`
through the model) and generation (peft 0.21.2's generation hooks predate transformers 5's
`cache` argument: prefix tuning decodes wrong tokens with a KV cache, prompt tuning ignores left
padding).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar, cast

import torch
from peft import PeftModel, PrefixTuningConfig, PromptTuningConfig, get_peft_model
from peft.utils import PeftType
from torch import nn
from transformers import DynamicCache

from leantune.methods.lora import quiet_peft
from leantune.methods.virtual_init import (
    VirtualInit,
    init_prefix_from_activations,
    init_prompt_embeddings,
    init_token_ids,
)
from leantune.models.loss import VIRTUAL_TOKENS_HOOK

M = TypeVar("M", bound=nn.Module)


def apply_prefix(
    model: nn.Module,
    num_virtual_tokens: int,
    prefix_projection: bool,
    encoder_hidden_size: int | None = None,
    init: VirtualInit | None = None,
) -> nn.Module:
    """Wrap `model` in peft prefix tuning: `num_virtual_tokens` learned keys/values per layer.

    Args:
        model: A causal LM.
        num_virtual_tokens: Prefix length.
        prefix_projection: Train the prefixes through a two-layer tanh MLP (reparameterisation).
        encoder_hidden_size: Hidden width of that MLP (peft default: the model's key/value width).
        init: Start from the model's keys/values for real tokens; None = peft's N(0, 1).
    """
    config = PrefixTuningConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=num_virtual_tokens,
        prefix_projection=prefix_projection,
        encoder_hidden_size=encoder_hidden_size,  # type: ignore[arg-type]
    )
    with quiet_peft():
        peft_model = get_peft_model(model, config)
    if init is not None:
        ids = init_token_ids(model, num_virtual_tokens, init.text, init.tokenizer_path)
        init_prefix_from_activations(peft_model, ids)
    return with_virtual_tokens(peft_model)


def apply_prompt_tuning(
    model: nn.Module, num_virtual_tokens: int, init: VirtualInit | None = None
) -> nn.Module:
    """Wrap `model` in peft prompt tuning: `num_virtual_tokens` learned input embeddings.

    Args:
        model: A causal LM.
        num_virtual_tokens: Number of virtual tokens.
        init: Start from the input embeddings of real tokens; None = peft's N(0, 1).
    """
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens)
    with quiet_peft():
        peft_model = get_peft_model(model, config)
    if init is not None:
        ids = init_token_ids(model, num_virtual_tokens, init.text, init.tokenizer_path)
        init_prompt_embeddings(peft_model, ids)
    return with_virtual_tokens(peft_model)


def with_virtual_tokens(model: M) -> M:
    """Give a prompt-learning `PeftModel` the loss's forward for its virtual tokens
    (`models.loss.VIRTUAL_TOKENS_HOOK`: `prompt_learning_hidden`); returns `model`.

    Called where such models are made: by the apply functions above and when a saved adapter
    loads (`methods.artifacts`). Other models pass unchanged.
    """
    if isinstance(model, PeftModel) and model.active_peft_config.is_prompt_learning:
        setattr(model, VIRTUAL_TOKENS_HOOK, functools.partial(prompt_learning_hidden, model))
    return model


def prompt_learning_type(model: nn.Module) -> PeftType | None:
    """peft's type of an active, enabled prompt-learning adapter on `model`, else None."""
    if not isinstance(model, PeftModel):
        return None
    config = model.active_peft_config
    # peft's `disable_adapter` context (used for the KL term) sets this flag.
    if not config.is_prompt_learning or getattr(model, "_adapters_disabled", False):
        return None
    kind = PeftType(config.peft_type)
    if kind not in (PeftType.PREFIX_TUNING, PeftType.PROMPT_TUNING):
        raise ValueError(f"leantune does not support the prompt-learning type {kind}")
    return kind


def _prefix_cache(model: PeftModel, batch_size: int) -> DynamicCache:
    cache = model.get_prompt(batch_size)
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"peft returned {type(cache).__name__} for the prefix, expected a cache")
    return cache


def prompt_learning_hidden(
    model: nn.Module, decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor | None:
    """Last hidden states at the input positions, with the virtual tokens in effect.

    Matches peft's forward for unpadded or right-padded rows: prompt tuning prepends the virtual
    tokens (positions 0..P-1, the input follows at P..); prefix tuning puts the prefix in the KV
    cache and offsets the input positions by P. Returns None when `model` has no active
    prompt-learning adapter.
    """
    kind = prompt_learning_type(model)
    if kind is None:
        return None
    assert isinstance(model, PeftModel)
    n_virtual = model.active_peft_config.num_virtual_tokens
    batch_size = input_ids.shape[0]
    if kind == PeftType.PREFIX_TUNING:
        # The prefix occupies positions 0..P-1 in the cache, so the input follows at P.., as
        # peft's forward places it.
        out = decoder(
            input_ids=input_ids,
            position_ids=position_ids + n_virtual,
            cache=_prefix_cache(model, batch_size),
            use_cache=False,
        )
        return out.last_hidden_state
    embeds = cast(nn.Module, model.word_embeddings)(input_ids)
    # The prompt encoder's dtype need not be the embeddings' (a bf16 base): one for the concat.
    prompts = model.get_prompt(batch_size).to(embeds.dtype)
    virtual = torch.arange(n_virtual, device=input_ids.device).expand(batch_size, -1)
    out = decoder(
        inputs_embeds=torch.cat([prompts, embeds], dim=1),
        position_ids=torch.cat([virtual, position_ids + n_virtual], dim=1),
        use_cache=False,
    )
    # The virtual tokens carry no labels: only the input positions go on to the loss.
    return out.last_hidden_state[:, n_virtual:]


def prompt_learning_generate_inputs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[nn.Module, dict[str, Any]] | None:
    """The base model and `generate` inputs that decode `model`'s prompt-learning adapter exactly.

    The virtual tokens are added once, before decoding: prompt tuning as input embeddings in front
    of the (left-padded) prompt, prefix tuning as a pre-filled KV cache; the attention mask gains
    P ones in front, so transformers derives the same positions as training used, with a KV cache.
    `input_ids` stay the running sequence, so repetition penalties see the prompt as usual and
    the returned sequences start with `input_ids`. Returns None without such an adapter.
    """
    kind = prompt_learning_type(model)
    if kind is None:
        return None
    assert isinstance(model, PeftModel)
    n_virtual = model.active_peft_config.num_virtual_tokens
    batch_size = input_ids.shape[0]
    # P ones in front: transformers derives positions from the mask's cumulative sum, so the
    # prompt lands at P.. as in training, and left padding stays masked.
    ones = attention_mask.new_ones((batch_size, n_virtual))
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.cat([ones, attention_mask], dim=1),
    }
    if kind == PeftType.PREFIX_TUNING:
        # Passed as the cache, not through peft's generation hooks: peft 0.21.2's predate
        # transformers 5's `cache` argument and decode wrong tokens with a KV cache.
        inputs["cache"] = _prefix_cache(model, batch_size)
    else:
        embeds = cast(nn.Module, model.word_embeddings)(input_ids)
        prompts = model.get_prompt(batch_size).to(embeds.dtype)
        inputs["inputs_embeds"] = torch.cat([prompts, embeds], dim=1)
    # The base model generates: the virtual tokens are already in `inputs`, and peft's own
    # generate would add them a second time.
    return model.get_base_model(), inputs
