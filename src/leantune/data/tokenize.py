"""Turn records into token ids with labels that supervise only the answers.

Labels are stored already shifted: `labels[i]` is the token that position `i` must predict, or
-100. Shifting per example (not per packed row) means no position ever learns to predict the
first token of the next packed example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.formats import Record

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """Token ids of one example and its shifted labels (same length)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def num_supervised(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used to locate answer tokens."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], gen: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    if not isinstance(text, str):
        raise TemplateError("the chat template did not render to a string")
    return text


def answer_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation and find the character span of each assistant turn.

    A span starts after the template's assistant header (the generation prompt) and ends after
    the turn's closing tokens, so the model also learns to stop.
    """
    full = _render(tokenizer, messages, gen=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], gen=True) if i else ""
        last = i == len(messages) - 1  # the whole conversation is already rendered
        through = full if last else _render(tokenizer, messages[: i + 1], gen=False)
        if not (full.startswith(before) and full.startswith(through)):
            raise TemplateError(
                "the chat template renders a conversation differently from its prefixes; "
                "answer tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    return full, spans


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> Example:
    """Tokenise a conversation with the tokenizer's chat template; supervise assistant turns."""
    full, spans = answer_spans(tokenizer, messages)
    enc: Any = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    supervised = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    return _shift(ids, supervised)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> Example:
    """Tokenise plain text (with BOS if the tokenizer uses one, and EOS); supervise all of it."""
    ids: list[int] = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return _shift(ids, [True] * len(ids))


def _shift(ids: list[int], supervised: list[bool]) -> Example:
    labels = [ids[i + 1] if supervised[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
    return Example(input_ids=ids, labels=[*labels, IGNORE_INDEX])


def encode_record(tokenizer: PreTrainedTokenizerBase, record: Record) -> Example:
    """Encode a validated record of any format."""
    if record.messages is not None:
        return encode_chat(tokenizer, list(record.messages))
    assert record.text is not None
    return encode_text(tokenizer, record.text)
