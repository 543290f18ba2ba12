"""Tiny random-weight models of the architectures people fine-tune, each with its family's special
tokens and its real chat template (tests/chat_templates.py), built from transformers configs in
seconds: no download.

`FAMILIES` is the matrix the architecture tests run over. Each entry holds what the tests need
to know about the family: its config, the tokens its template writes, and the text it ends an
assistant turn with (what must be supervised after the answer, so the model learns to stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chat_templates as ct
import torch
import transformers
from support import train_bpe
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

# Plant-care chats: the words the tiny tokenizers are trained on (the matrix's data, too).
PLANT_CORPUS = [
    "Water the fern twice a week and keep the soil moist but not wet.",
    "A cactus needs bright light, sandy soil and very little water in winter.",
    "Yellow leaves on a monstera often mean too much water; let the soil dry out.",
    "You are a careful gardener who answers briefly. Repot the basil in spring.",
    'Tool call: {"name": "get_weather", "arguments": {"city": "Paris"}} -> sunny, 21 C',
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ' \" ( ) [ ] { } < > = + - * /",
    "Think step by step: the pot has no drainage hole, so the roots rot. Answer: drill one.",
]


@dataclass(frozen=True)
class Family:
    """One architecture with its chat template, as the tests build it."""

    name: str
    config: Callable[..., PretrainedConfig]
    """(vocab size, **special token ids) -> a 2-layer config of the architecture."""
    template: str
    special_tokens: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    end_of_turn: str = ""
    """The text the template writes after each assistant message's content (supervised)."""
    generation_eos: tuple[str, ...] = ()
    """Tokens that end generation (generation_config.eos_token_id), beside `eos`."""
    extra: dict[str, Any] = field(default_factory=dict)


_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _cfg(cls_name: str, **extra: Any) -> Callable[..., PretrainedConfig]:
    def build(vocab: int, **ids: int | None) -> PretrainedConfig:
        cls = getattr(transformers, cls_name)
        return cls(**{**_COMMON, "vocab_size": vocab, **ids, **extra})  # type: ignore[no-any-return]

    return build


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# What the families of one template lineage share.
_CHATML: dict[str, Any] = {
    "special_tokens": ct.QWEN_TOKENS,
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "end_of_turn": "<|im_end|>\n",
}
_MISTRAL: dict[str, Any] = {
    "special_tokens": ct.MISTRAL_TOKENS,
    "eos": "</s>",
    "pad": "<unk>",
    "bos": "<s>",
    "end_of_turn": "</s>",
}
_GEMMA: dict[str, Any] = {
    "special_tokens": ct.GEMMA_TOKENS,
    "eos": "<eos>",
    "pad": "<pad>",
    "bos": "<bos>",
    "end_of_turn": "<end_of_turn>\n",
    "generation_eos": ("<end_of_turn>",),
}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "llama3",
            _cfg("LlamaConfig", tie_word_embeddings=True),
            ct.LLAMA31,
            ct.LLAMA3_TOKENS,
            eos="<|eot_id|>",
            pad="<|finetune_right_pad_id|>",
            bos="<|begin_of_text|>",
            end_of_turn="<|eot_id|>",
        ),
        Family(
            "qwen2.5",
            _cfg("Qwen2Config", tie_word_embeddings=False),
            ct.QWEN25,
            **_CHATML,
        ),
        Family(
            "qwen3",
            _cfg("Qwen3Config", head_dim=16, tie_word_embeddings=True),
            ct.QWEN3,
            **_CHATML,
        ),
        Family(
            "qwen3-moe",
            _cfg("Qwen3MoeConfig", head_dim=16, **_MOE),
            ct.QWEN3,
            **_CHATML,
        ),
        Family(
            "qwen2-moe",
            _cfg("Qwen2MoeConfig", shared_expert_intermediate_size=64, **_MOE),
            ct.QWEN25,
            **_CHATML,
        ),
        Family(
            "mixtral",
            _cfg("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
            ct.MIXTRAL,
            **_MISTRAL,
        ),
        Family(
            "mistral",
            _cfg("MistralConfig", head_dim=16, sliding_window=8),
            ct.MISTRAL_V03,
            **_MISTRAL,
        ),
        Family(
            "gemma2",
            _cfg(
                "Gemma2Config",
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=8,
                final_logit_softcapping=30.0,
                attn_logit_softcapping=50.0,
            ),
            ct.GEMMA2,
            **_GEMMA,
        ),
        Family(
            "gemma3",
            _cfg(
                "Gemma3TextConfig",
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
            ct.GEMMA3,
            **_GEMMA,
        ),
        Family(
            "phi3",
            _cfg("Phi3Config", tie_word_embeddings=False),
            ct.PHI3,
            ct.PHI3_TOKENS,
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            end_of_turn="<|end|>\n",
            generation_eos=("<|end|>",),
        ),
        Family(
            "phi4",
            _cfg("Phi3Config", tie_word_embeddings=False),
            ct.PHI4,
            ct.PHI4_TOKENS,
            eos="<|im_end|>",
            pad="<|dummy_85|>",
            end_of_turn="<|im_end|>",
        ),
        Family(
            "olmo2",
            _cfg("Olmo2Config"),
            ct.TULU,
            ct.OLMO2_TOKENS,
            eos="<|endoftext|>",
            pad="<|pad|>",
            bos="<|endoftext|>",
            end_of_turn="<|endoftext|>",  # the "\n" after it is written only before another turn
        ),
        Family(
            "smollm2",
            _cfg("LlamaConfig", tie_word_embeddings=True),
            ct.SMOLLM2,
            **_CHATML,
        ),
        Family(
            "smollm3",
            _cfg("SmolLM3Config", tie_word_embeddings=True),
            ct.SMOLLM3,
            **_CHATML,
        ),
    ]
}
"""The architecture matrix: every family the README lists as tested."""

OUTPUT_SCALED_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "cohere",
            _cfg("CohereConfig", logit_scale=0.5, tie_word_embeddings=True),
            ct.QWEN25,
            **_CHATML,
        ),
        Family(
            "granite",
            _cfg("GraniteConfig", logits_scaling=2.0, tie_word_embeddings=True),
            ct.QWEN25,
            **_CHATML,
        ),
    ]
}
"""Architectures that scale their logits after the output projection (Cohere's `logit_scale`
multiplies, Granite's `logits_scaling` divides), for the loss tests; they reuse the ChatML
template and are not part of the matrix."""


def family_tokenizer(family: Family, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab <= 448) with the family's special tokens as single
    tokens and its chat template; saved to `out_dir` when given."""
    tok = train_bpe(PLANT_CORPUS, list(dict.fromkeys(family.special_tokens)), 448)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=None,
    )
    fast.chat_template = family.template
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def family_config(family: Family, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The family's tiny config with the tokenizer's vocabulary and special token ids."""
    ids = tokenizer.convert_tokens_to_ids
    return family.config(
        len(tokenizer),
        eos_token_id=ids(family.eos),
        pad_token_id=ids(family.pad),
        bos_token_id=ids(family.bos) if family.bos else None,
    )


def save_family_model(
    out_dir: Path,
    family: Family | str,
    seed: int = 0,
    initializer_range: float | None = None,
    **config_overrides: Any,
) -> Path:
    """Build the family's 2-layer model from config with a fixed init and save it, with its
    tokenizer and chat template, as a model directory `leantune train model.path=` takes.

    A larger `initializer_range` than the default 0.02 gives logits of realistic size (tens),
    where soft-capping and logit scaling change the loss measurably."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    tokenizer = family_tokenizer(fam, out_dir)
    config = family_config(fam, tokenizer)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    if initializer_range is not None:
        config.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    ends = [config.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in fam.generation_eos)]
    model.generation_config.eos_token_id = ends if len(ends) > 1 else ends[0]
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def plant_chats(n: int, system_every: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """`n` plant-care chats of 1-3 turns; every `system_every`-th has a system message."""
    plants = ["fern", "cactus", "monstera", "basil", "orchid", "ivy"]
    rows = []
    for i in range(n):
        plant = plants[(i + seed) % len(plants)]
        messages: list[dict[str, str]] = []
        if system_every and i % system_every == 0:
            messages.append({"role": "system", "content": "You are a careful gardener."})
        for turn in range(1 + i % 3):
            messages.append({"role": "user", "content": f"How often should I water the {plant}?"})
            messages.append(
                {"role": "assistant", "content": f"Water the {plant} {turn + 1} times a week."}
            )
        rows.append({"messages": messages})
    return rows
