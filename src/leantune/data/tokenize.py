"""Turn records into token ids with labels that supervise only the answers.

Labels are stored already shifted: `labels[i]` is the token that position `i` must predict, or
-100. A chat record is rendered once with the tokenizer's chat template and its assistant turns
are found in that render (`leantune.data.chat_spans`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data import chat_spans
from leantune.data.bounds import token_floor
from leantune.data.chat_spans import (
    NoChatTemplateError,
    Span,
    TemplateError,
    for_template,
    renderer,
)
from leantune.data.formats import Record

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "NoChatTemplateError",
    "TemplateError",
    "TooLong",
    "answer_spans",
    "encode_chat",
    "encode_record",
    "encode_rendered",
    "encode_text",
    "render_chat",
    "shifted_labels",
    "supervised_mask",
    "too_long",
]

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index


@dataclass(frozen=True)
class Example:
    """Token ids of one example and its shifted labels (same length)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def num_supervised(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


@dataclass(frozen=True)
class TooLong:
    """A record rejected before tokenising: it certainly has more than `limit` tokens."""

    at_least: int
    limit: int

    def __str__(self) -> str:
        return (
            f"too long: at least {self.at_least} tokens > data.max_seq_len={self.limit} "
            "(known from its length, without tokenising it)"
        )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the chat template writes it (no generation prompt).

    Raises:
        NoChatTemplateError: the tokenizer has none. TemplateError: the template refused it.
    """
    return renderer(tokenizer)(messages, False, tools)


def answer_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    supervise_from: int = 0,
    system_message: str = "auto",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[Span]]:
    """Render the conversation (its system messages handled as data.system_message says) and
    find the character span of each assistant turn (from message `supervise_from` on).
    """
    messages, supervise_from = for_template(tokenizer, messages, system_message, supervise_from)
    full = render_chat(tokenizer, messages, tools)
    return full, chat_spans.answer_spans(tokenizer, messages, full, supervise_from)


def too_long(tokenizer: PreTrainedTokenizerBase, text: str, limit: int | None) -> TooLong | None:
    """`TooLong` when `text` certainly has more than `limit` tokens (decided without
    tokenising: see `leantune.data.bounds`), else None."""
    floor = token_floor(tokenizer) if limit is not None else None
    if floor is None or limit is None:
        return None
    n = floor.exceeds(text, limit)
    return TooLong(n, limit) if n is not None else None


def supervised_mask(offsets: np.ndarray, spans: list[Span]) -> np.ndarray:
    """Which tokens overlap one of `spans` (sorted, disjoint).

    `offsets` holds each token's (start, end) characters. A token that straddles a span's
    start is the answer's first token, so it is supervised.
    """
    # reshape: an empty offset list must still be (0, 2) for the column slices below.
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans:
        return np.zeros(len(offsets), dtype=bool)
    bounds = np.asarray(spans, dtype=np.int64)
    # Overlap, not containment: a word piece that takes the space the template wrote before
    # the answer (Mistral's " " + answer) starts outside the span yet is the answer's first
    # token. A zero-width offset (some tokenizers give one to added tokens) is widened to one
    # character so that it can still fall inside a span.
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    # A merge by binary search (the last span starting before each token's end), not a
    # tokens x spans comparison, which long multi-turn conversations make quadratic.
    k = np.searchsorted(bounds[:, 0], ends, side="left") - 1
    return (k >= 0) & (starts < bounds[np.maximum(k, 0), 1])


def shifted_labels(ids: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """Labels for `ids`: the next token where it is supervised, else IGNORE_INDEX."""
    # Shifted per example, not per packed row: no position learns to predict the first token
    # of the next packed example.
    labels = np.full(ids.size, IGNORE_INDEX, dtype=ids.dtype)
    labels[:-1] = np.where(supervised[1:], ids[1:], IGNORE_INDEX)
    return labels


def encode_rendered(tokenizer: PreTrainedTokenizerBase, full: str, spans: list[Span]) -> Example:
    """Tokenise a rendered conversation; supervise the tokens that start inside `spans`."""
    # No special tokens: the chat template writes its own BOS; adding one would double it.
    enc: Any = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    labels = shifted_labels(ids, supervised_mask(enc["offset_mapping"], spans))
    return Example(input_ids=ids.tolist(), labels=labels.tolist())


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    supervise_from: int = 0,
    system_message: str = "auto",
    tools: list[dict[str, Any]] | None = None,
) -> Example:
    """Tokenise a conversation with the tokenizer's chat template; supervise assistant turns
    (those from message `supervise_from` on)."""
    full, spans = answer_spans(tokenizer, messages, supervise_from, system_message, tools)
    return encode_rendered(tokenizer, full, spans)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> Example:
    """Tokenise plain text (with BOS if the tokenizer uses one, and EOS); supervise all of it."""
    ids: list[int] = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    # Tokenizers rarely add EOS themselves; without it the model never learns where a document
    # ends. Not doubled where the tokenizer does add one.
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return _shift(ids, [True] * len(ids))


def _shift(ids: list[int], supervised: list[bool]) -> Example:
    labels = [ids[i + 1] if supervised[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
    return Example(input_ids=ids, labels=[*labels, IGNORE_INDEX])


def encode_record(
    tokenizer: PreTrainedTokenizerBase, record: Record, system_message: str = "auto"
) -> Example:
    """Encode a validated record of any format."""
    if record.messages is not None:
        tools = list(record.tools) if record.tools else None
        return encode_chat(
            tokenizer, list(record.messages), record.supervise_from, system_message, tools
        )
    assert record.text is not None
    return encode_text(tokenizer, record.text)
