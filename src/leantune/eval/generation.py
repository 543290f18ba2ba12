"""Batched text generation for evaluation: sampling settings, stop tokens, prompt rendering.

`generate_texts` is the one place that calls `model.generate`: it left-pads sorted batches, stops at
every end-of-turn token the tokenizer and model know, and returns only the new text, in the order
of the prompts. It works the same for a plain transformers model and a peft `PeftModel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from peft import PeftModel
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from leantune.data.chat_spans import (
    NoChatTemplateError,
    TemplateError,
    render_conversation,
    template_facts,
)
from leantune.eval.progress import ProgressCallback, ProgressTracker
from leantune.methods.prompt import prompt_learning_generate_inputs

# End-of-turn markers of the common chat templates (ChatML/Qwen, Llama 3, Gemma, GPT-style).
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class SamplingSettings:
    """How to decode: greedy when `temperature` is 0, otherwise sampling."""

    max_new_tokens: int = 256
    """Most tokens generated per prompt (the stop tokens usually end it sooner)."""
    temperature: float = 0.0
    """Softmax temperature; 0 means greedy decoding (no sampling)."""
    top_p: float = 0.9
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the top_k most likely tokens when sampling; 0 turns the filter off."""
    repetition_penalty: float = 1.2
    """Penalises tokens already in the sequence; 1.0 turns the penalty off."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(
                f"SamplingSettings.max_new_tokens must be > 0, got {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(
                f"SamplingSettings.temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingSettings.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingSettings.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"SamplingSettings.repetition_penalty must be > 0 (1.0 = off), "
                f"got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        """True when these settings decode greedily (temperature 0)."""
        return self.temperature == 0.0


GREEDY = SamplingSettings(temperature=0.0, repetition_penalty=1.0)
"""Plain greedy decoding, for deterministic evaluation."""

# What transformers' `generate` uses for a field the model's generation_config leaves unset
# (`GenerationConfig._get_default_generation_params`); max_new_tokens is ours: transformers'
# max_length of 20 tokens, prompt included, cuts most answers.
_UNSET_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
    "max_new_tokens": GREEDY.max_new_tokens,
}


def model_sampling(config: GenerationConfig | None) -> SamplingSettings:
    """How `config` (a model's `generation_config`) says to decode, as its `generate` would.

    Unset fields take transformers' defaults, so a model without a generation_config.json, or
    one without `do_sample: true`, decodes greedily (repetition penalty 1 unless it sets one).

    Raises:
        ValueError: the config holds a value SamplingSettings refuses (named in the message).
    """

    def value(name: str) -> Any:
        got = getattr(config, name, None) if config is not None else None
        return _UNSET_DEFAULTS[name] if got is None else got

    sampling = bool(value("do_sample")) and float(value("temperature")) != 0.0
    try:
        # A greedy result keeps the sampling values too: `with_overrides` starts from them
        # when the command line asks for sampling.
        return SamplingSettings(
            max_new_tokens=int(value("max_new_tokens")),
            temperature=float(value("temperature")) if sampling else 0.0,
            top_p=float(value("top_p")),
            top_k=int(value("top_k")),
            repetition_penalty=float(value("repetition_penalty")),
        )
    except ValueError as e:
        raise ValueError(f"the model's generation_config: {e}") from None


def with_overrides(
    base: SamplingSettings,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    repetition_penalty: float | None = None,
) -> SamplingSettings:
    """`base` with every value that is given (not None) replaced.

    `top_p` or `top_k` without `temperature` on a greedy `base` samples at temperature 1
    (transformers' default): the filters only act when sampling.
    """
    given: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "repetition_penalty": repetition_penalty,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    filters = top_p is not None or top_k is not None
    if base.greedy and temperature is None and filters:
        changes["temperature"] = _UNSET_DEFAULTS["temperature"]
    return replace(base, **changes)


def _as_id_list(ids: int | Iterable[int] | None) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _template_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special token the chat template closes an answer with (Phi-3's `<|end|>`), which the
    model was trained to write: learned from the template, so no list has to know it."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        end = template_facts(tokenizer).end_of_turn
    except (TemplateError, NoChatTemplateError):
        return []
    ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    # Only a special token: an end written in plain text starts with an ordinary token (a newline,
    # a "<"), and stopping on that would cut answers that merely contain it.
    added = tokenizer.get_added_vocab()
    first = tokenizer.convert_ids_to_tokens(ids[0]) if ids else None
    return [ids[0]] if first in added else []


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    model_generation_config: GenerationConfig | None = None,
) -> list[int]:
    """Token ids that end a generated answer.

    Args:
        tokenizer: Tokenizer of the model.
        model_generation_config: The model's `generation_config`, whose eos ids are added if given.

    Returns:
        The tokenizer's eos id, the ids of the end-of-turn tokens in `END_OF_TURN_TOKENS` that
        exist in the vocabulary, the special token the chat template ends an answer with, and
        the generation config's eos ids, without duplicates, in that order.
    """
    ids = _as_id_list(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in END_OF_TURN_TOKENS if token in vocab]
    ids += _template_end_of_turn(tokenizer)
    if model_generation_config is not None:
        ids += _as_id_list(model_generation_config.eos_token_id)
    return list(dict.fromkeys(ids))  # dedupe, keeping the documented order


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: str | None = None
) -> str:
    """Render chat messages with the tokenizer's chat template, ending with the assistant cue.

    Args:
        tokenizer: Tokenizer with a chat template.
        messages: `{"role": ..., "content": ...}` dicts, oldest first.
        template: how a refusal names the template (--chat-template); default: the model's.

    Returns:
        The prompt text, special tokens included, ready for `generate_texts`.

    Raises:
        ConversationRefused: the template refuses the conversation (exit 2).
    """
    # A system message the template refuses (Gemma 2) is folded as training folded it.
    return render_conversation(tokenizer, messages, add_generation_prompt=True, template=template)


def _decoding_kwargs(settings: SamplingSettings) -> dict[str, Any]:
    # Every decoding knob is passed explicitly so that values from the model's
    # generation_config.json (e.g. do_sample=True, top_k=20) cannot leak into the evaluation. Greedy
    # omits the sampling-only knobs: transformers warns when they are set together with
    # do_sample=False.
    if settings.greedy:
        return {"do_sample": False, "repetition_penalty": settings.repetition_penalty}
    return {
        "do_sample": True,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "repetition_penalty": settings.repetition_penalty,
    }


# Left, not right: a decoder-only model continues from the last column, which must be every
# prompt's own last token rather than padding.
def _left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


# generate keeps the stop token, and in a batch pads the rows that finished early (the pad may
# be eos, or not a stop token at all): everything from the first stop token goes.
def _cut_at_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[:position]
    return ids


def _encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    # The rendered prompts hold the template's BOS already; adding special tokens would double it.
    encoded: list[list[int]] = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    for index, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {index} is empty after tokenization")
    return encoded


def _generate_batch(
    model: PreTrainedModel | PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: SamplingSettings,
    stop_ids: list[int],
    pad_id: int,
    watch: StoppingCriteria | None = None,
) -> list[list[int]]:
    """The new token ids of one left-padded batch (prompt-learning methods add their tokens);
    `watch` is called after every new token (progress), without stopping anything."""
    # Prompt-learning adapters decode through the base model with their virtual tokens added
    # by hand: peft's own generate gets them wrong under transformers 5.
    runner, inputs = prompt_learning_generate_inputs(model, input_ids, attention_mask) or (
        model,
        {"input_ids": input_ids, "attention_mask": attention_mask},
    )
    # transformers 5 no longer declares `generate` on PreTrainedModel (only on GenerationMixin
    # subclasses), so the type checker sees it through __getattr__.
    generate = cast(Callable[..., torch.Tensor], runner.generate)
    # Each row stops at its first stop token (transformers pads it from there on and ends the
    # call when every row has stopped: tests/unit/eval/test_generation_progress.py shows it).
    generated = generate(
        **inputs,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
        stopping_criteria=StoppingCriteriaList([watch] if watch is not None else []),
        **_decoding_kwargs(settings),
    )
    # The output starts with input_ids (prompt-learning inputs too), and left padding ends every
    # prompt at the same column, so one slice keeps exactly the new tokens of each row.
    new_tokens: list[list[int]] = generated[:, input_ids.shape[1] :].tolist()
    return new_tokens


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # Padding with eos is safe: the attention mask hides it, and new tokens are cut at stops.
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token; set one of them")
    return int(pad_id)


def generate_texts(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    settings: SamplingSettings,
    batch_size: int = 16,
    seed: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> list[str]:
    """Generate a completion for every prompt, in batches, and return only the new text.

    Prompts are sorted by token length (longest first) so that each batch holds similar lengths,
    and left-padded, as decoder-only generation needs. The model is put in eval mode for the call
    and its previous mode restored; the tokenizer is not modified.

    Args:
        model: A causal LM, plain or wrapped in a peft `PeftModel`.
        tokenizer: Its tokenizer. Without a pad token, the eos token pads.
        prompts: Fully rendered prompts (see `render_prompt`); they already hold the template's
            special tokens, so none are added.
        settings: Decoding settings; greedy when `settings.temperature` is 0.
        batch_size: Prompts per `generate` call.
        seed: Seeds sampling, for reproducible outputs with the same prompts and batch_size. The
            caller's global RNG state is left untouched.
        on_progress: Called after every decoding step and every batch with where the call
            stands (`GenerationProgress`), e.g. to show a progress bar.

    Returns:
        One completion per prompt, in the order of `prompts`, cut at the first stop token,
        decoded without special tokens and stripped.

    Raises:
        ValueError: If `batch_size` < 1, a prompt tokenizes to nothing, or the tokenizer has
            neither a pad nor an eos token.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        return []
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    pad_id = _pad_id(tokenizer)

    encoded = _encode_prompts(tokenizer, prompts)
    # Longest first: a batch that does not fit in memory fails at once, not at the end.
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]), reverse=True)
    device = next(model.parameters()).device
    outputs: list[str] = [""] * len(prompts)
    stop_set = set(stop_ids)
    tracker = ProgressTracker(len(prompts), settings.max_new_tokens, stop_ids, on_progress)

    was_training = model.training
    model.eval()
    # A seeded call runs on a forked RNG so that the caller's random stream is left as it was;
    # an unseeded call draws from (and advances) the global stream like any other sampling.
    # Only the model's GPU: by default fork_rng saves and restores every visible device.
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    rng = torch.random.fork_rng(devices=rng_devices) if seed is not None else nullcontext()
    try:
        with rng, torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                input_ids, attention_mask = _left_pad([encoded[i] for i in batch], pad_id)
                new_tokens = _generate_batch(
                    model,
                    input_ids.to(device),
                    attention_mask.to(device),
                    settings,
                    stop_ids,
                    pad_id,
                    tracker.batch(len(batch)),
                )
                tracker.end_batch(len(batch))
                for index, ids in zip(batch, new_tokens, strict=True):
                    text = tokenizer.decode(_cut_at_stop(ids, stop_set), skip_special_tokens=True)
                    outputs[index] = cast(str, text).strip()
    finally:
        model.train(was_training)
    return outputs
