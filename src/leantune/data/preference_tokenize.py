"""Turn preference records into token ids: a shared prompt and each answer with its labels.

Each side of a pair (prompt + chosen, prompt + rejected) is rendered with the chat template and
its answer located as an SFT conversation's assistant turns are
(`leantune.data.tokenize.answer_spans`). Lengths follow TRL's rules (`_fit`, `resolve_lengths`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.chat_spans import Span
from leantune.data.formats import BadLine
from leantune.data.preference_formats import PreferenceRecord, UnpairedRecord
from leantune.data.record_checks import Message
from leantune.data.tokenize import (
    IGNORE_INDEX,
    Example,
    TemplateError,
    answer_spans,
    supervised_mask,
    too_long,
)

__all__ = [
    "AUTO",
    "TRUNCATIONS",
    "Lengths",
    "PreferencePair",
    "UnpairedExample",
    "encode_pairs",
    "encode_sides",
    "encode_unpaired_records",
    "resolve_lengths",
]

Truncation = Literal["keep_end", "keep_start", "none"]
TRUNCATIONS: tuple[Truncation, ...] = ("keep_end", "keep_start", "none")
Answer = Literal["chosen", "rejected"]
BATCH = 512
"""Records rendered and tokenised per tokenizer call (bounds the memory of one call)."""


def _sequence(prompt: Sequence[int], ids: Sequence[int], labels: Sequence[int]) -> Example:
    """prompt + answer as an `Example`, its labels shifted as leantune stores them."""
    # Shift by one: position t is trained to predict token t + 1, so the last position has
    # no target.
    targets = [IGNORE_INDEX] * len(prompt) + list(labels)
    return Example([*prompt, *ids], [*targets[1:], IGNORE_INDEX])


@dataclass(frozen=True)
class PreferencePair:
    """One tokenised pair; each answer's labels are aligned with its ids (not shifted).

    A label is the token where it is supervised, IGNORE_INDEX where it is not (a user turn
    inside a multi-turn answer); `sequence` gives the shifted form the trainer reads.
    """

    # Unshifted labels: truncation cuts ids and labels at the same index, and the prompt is
    # shared by both answers, so the shift is applied only when a sequence is assembled.

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_labels: list[int]
    rejected_ids: list[int]
    rejected_labels: list[int]
    source: str = ""
    line: int = 0

    @property
    def num_supervised(self) -> int:
        """Supervised tokens of both answers."""
        return sum(t != IGNORE_INDEX for t in (*self.chosen_labels, *self.rejected_labels))

    def sequence(self, answer: Answer) -> Example:
        """prompt + `answer`, labels shifted: what SFT would train on for that answer."""
        if answer == "chosen":
            return _sequence(self.prompt_ids, self.chosen_ids, self.chosen_labels)
        return _sequence(self.prompt_ids, self.rejected_ids, self.rejected_labels)


@dataclass(frozen=True)
class UnpairedExample:
    """One tokenised unpaired (KTO) example; labels aligned with `completion_ids`."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_labels: list[int]
    label: bool
    source: str = ""
    line: int = 0

    @property
    def num_supervised(self) -> int:
        return sum(t != IGNORE_INDEX for t in self.completion_labels)

    def sequence(self) -> Example:
        """prompt + completion, labels shifted."""
        return _sequence(self.prompt_ids, self.completion_ids, self.completion_labels)


@dataclass(frozen=True)
class Lengths:
    """The length rules, as given (`auto` allowed) or as resolved from the data (ints)."""

    max_prompt_len: int | Literal["auto"] = "auto"
    max_completion_len: int | Literal["auto"] = "auto"
    truncation: Truncation = "keep_end"


AUTO = Lengths()
"""The default rules: both lengths from the data, prompts keeping their end."""

Side = tuple[list[int], list[int], list[int]]
"""(prompt ids, answer ids, answer labels aligned) of one side, untruncated."""


class _TooLong(ValueError):
    """A record certainly over the length limit, known before tokenising it."""


def _render_side(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[Message],
    answer: Sequence[Message],
    system_message: str,
    limit: int | None,
) -> tuple[str, list[Span]]:
    """prompt + answer rendered, and the character spans of the answer's assistant turns.

    Raises:
        TemplateError: the template refuses it or its answer cannot be located.
        _TooLong: the render is certainly longer than `limit` tokens.
    """
    full, spans = answer_spans(tokenizer, [*prompt, *answer], len(prompt), system_message)
    # Checked on the text before tokenising: a certainly-too-long record skips the tokenizer.
    rejected = too_long(tokenizer, full, limit)
    if rejected is not None:
        raise _TooLong(str(rejected))
    return full, spans


def _cut(ids: np.ndarray, offsets: Any, spans: list[Span]) -> Side:
    """A tokenised side cut where its answer's first supervised token is.

    The prompt is every token before that one; what follows the last supervised token (a
    template's trailing text) is not kept.

    Raises:
        TemplateError: no token of the answer is left after tokenisation.
    """
    mask = supervised_mask(offsets, spans)
    where = np.flatnonzero(mask)
    if where.size == 0:
        raise TemplateError("the answer has no token of its own after tokenisation")
    first, last = int(where[0]), int(where[-1]) + 1
    # Unsupervised tokens inside the answer (a user turn of a multi-turn answer) stay in the
    # ids as context but get IGNORE_INDEX.
    labels = np.where(mask[first:last], ids[first:last], IGNORE_INDEX)
    return ids[:first].tolist(), ids[first:last].tolist(), labels.tolist()


def encode_sides(
    tokenizer: PreTrainedTokenizerBase,
    sides: Sequence[tuple[Sequence[Message], Sequence[Message]]],
    system_message: str = "auto",
    limit: int | None = None,
) -> list[Side | str]:
    """Each (prompt, answer) rendered and tokenised untruncated, in one tokenizer call; a
    string where it cannot be (the reason: the template refuses it, its answer cannot be
    located, or it is certainly longer than `limit` tokens)."""
    # Results stay at their input index: the caller pairs sides 2k and 2k + 1.
    out: list[Side | str] = ["" for _ in sides]
    rendered: list[tuple[int, str, list[Span]]] = []
    for i, (prompt, answer) in enumerate(sides):
        try:
            rendered.append((i, *_render_side(tokenizer, prompt, answer, system_message, limit)))
        except (TemplateError, _TooLong) as e:
            out[i] = str(e)
    if not rendered:
        return out
    # One batched call: a fast tokenizer parallelises a batch, one call per side is slow.
    # No special tokens: the chat template writes its own BOS.
    enc: Any = tokenizer(
        [full for _, full, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    for j, (i, _, spans) in enumerate(rendered):
        ids = np.asarray(enc["input_ids"][j], dtype=np.int64)
        try:
            out[i] = _cut(ids, enc["offset_mapping"][j], spans)
        except TemplateError as e:
            out[i] = str(e)
    return out


def _fit(
    what: str, ids: list[int], limit: int, truncation: Truncation, field: str
) -> list[int] | str:
    """`ids` within `limit` tokens under the truncation rule, or why the record is dropped."""
    if len(ids) <= limit:
        return ids
    if truncation == "none":
        return f"{what} has {len(ids)} tokens > {field}={limit} (truncation none)"
    if what == "prompt":
        # keep_end keeps the part of the prompt next to the answer (TRL's default).
        return ids[-limit:] if truncation == "keep_end" else ids[:limit]
    return ids[:limit]  # an answer keeps its start, as TRL cuts completions


@dataclass(frozen=True)
class _Longest:
    prompt: int
    prompt_at: str
    answer: int
    answer_at: str


def _longest(encoded: Sequence[tuple[str, Side]]) -> _Longest:
    p = max(encoded, key=lambda e: len(e[1][0]), default=("", ([], [], [])))
    a = max(encoded, key=lambda e: len(e[1][1]), default=("", ([], [], [])))
    return _Longest(len(p[1][0]), p[0], len(a[1][1]), a[0])


def resolve_lengths(
    lengths: Lengths, longest_prompt: int, longest_answer: int, max_seq_len: int | None
) -> tuple[int, int]:
    """(max_prompt_len, max_completion_len) with `auto` taken from the data.

    The longest prompt and the longest answer when both fit in `max_seq_len` (None: no limit).
    When they do not, the prompt keeps what the longest answer leaves, but at least half of
    `max_seq_len`, and the answer the rest; an auto value beside a set one takes what that one
    leaves.
    """
    p, c = lengths.max_prompt_len, lengths.max_completion_len
    room = max_seq_len if max_seq_len is not None else longest_prompt + longest_answer
    if isinstance(p, int) and isinstance(c, int):
        return p, c
    if isinstance(c, int):
        return max(min(longest_prompt, room - c), 1), c
    if isinstance(p, int):
        return p, max(min(longest_answer, room - p), 1)
    # At least half for the prompt, as TRL's defaults give it (512 of 1024 tokens), so one
    # very long answer in the data does not squeeze every prompt to nothing.
    prompt = min(longest_prompt, max(room // 2, room - longest_answer))
    return max(prompt, 1), max(min(longest_answer, room - prompt), 1)


def _said(lengths: Lengths, resolved: tuple[int, int], longest: _Longest, limit: int | None) -> str:
    within = f", within data.max_seq_len={limit}" if limit is not None else ""
    parts = []
    if lengths.max_prompt_len == "auto":
        parts.append(
            f"max_prompt_len=auto: {resolved[0]} tokens (longest prompt {longest.prompt} at "
            f"{longest.prompt_at}{within})"
        )
    if lengths.max_completion_len == "auto":
        parts.append(
            f"max_completion_len=auto: {resolved[1]} tokens (longest answer {longest.answer} at "
            f"{longest.answer_at}{within})"
        )
    return "; ".join(parts) + f"; truncation={lengths.truncation}"


def _fit_answer(side: Side, limit: int, truncation: Truncation, name: str) -> Side | str:
    """The side with its answer within `limit`, or why the record is dropped."""
    ids = _fit(name, side[1], limit, truncation, "max_completion_len")
    if isinstance(ids, str):
        return ids
    labels = side[2][: len(ids)]
    # A cut that keeps only unsupervised tokens would give a sequence with no log-prob to
    # compare; such a record is dropped.
    if all(t == IGNORE_INDEX for t in labels):
        return f"{name} truncated to nothing supervised"
    return side[0], ids, labels


def _fit_record(
    prompt: list[int],
    sides: list[Side],
    resolved: tuple[int, int],
    truncation: Truncation,
    names: tuple[str, ...] = ("chosen", "rejected"),
) -> tuple[list[int], list[Side]] | str:
    """The shared prompt and each side within the resolved lengths, or why the record is
    dropped (the prompt is checked once, then each answer by its name)."""
    cut = _fit("prompt", prompt, resolved[0], truncation, "max_prompt_len")
    if isinstance(cut, str):
        return cut
    fitted = []
    for side, name in zip(sides, names, strict=True):
        answer = _fit_answer(side, resolved[1], truncation, name)
        if isinstance(answer, str):
            return answer
        fitted.append(answer)
    return cut, fitted


def _pair_problem(chosen: Side | str, rejected: Side | str) -> str | None:
    """Why a pair's two encoded sides cannot be trained on, or None."""
    if isinstance(chosen, str):
        return f"chosen: {chosen}"
    if isinstance(rejected, str):
        return f"rejected: {rejected}"
    # The prompt is stored once per pair, so both sides must give the same prompt tokens.
    if chosen[0] != rejected[0]:
        return (
            "the prompt renders to other tokens before chosen than before rejected (the chat "
            "template writes the prompt depending on the answer)"
        )
    return None


def _precheck_limit(lengths: Lengths, max_seq_len: int | None) -> int | None:
    # With truncation a long record is cut, not dropped, so it must be tokenised (as SFT).
    return max_seq_len if lengths.truncation == "none" else None


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[PreferenceRecord],
    lengths: Lengths = AUTO,
    max_seq_len: int | None = None,
    system_message: str = "auto",
    log: Callable[[str], None] | None = None,
) -> tuple[list[PreferencePair], list[BadLine], tuple[int, int]]:
    """Tokenise pairs under the length rules; returns (pairs, bad lines, (max_prompt_len,
    max_completion_len) as resolved), the `auto` values said through `log`."""
    bad: list[BadLine] = []
    encoded: list[tuple[PreferenceRecord, Side, Side]] = []
    limit = _precheck_limit(lengths, max_seq_len)
    for start in range(0, len(records), BATCH):
        batch = records[start : start + BATCH]
        sides = encode_sides(
            tokenizer,
            # Interleaved: record k's sides are 2k (chosen) and 2k + 1 (rejected).
            [(r.prompt, answer) for r in batch for answer in (r.chosen, r.rejected)],
            system_message,
            limit,
        )
        for k, r in enumerate(batch):
            chosen, rejected = sides[2 * k], sides[2 * k + 1]
            why = _pair_problem(chosen, rejected)
            if why is not None:
                bad.append(BadLine(r.source, r.line, why))
                continue
            assert not isinstance(chosen, str) and not isinstance(rejected, str)
            encoded.append((r, chosen, rejected))
    # The auto lengths need the whole data's longest prompt and answer, so fitting waits until
    # every record is encoded.
    named = [(f"{r.source}:{r.line}", s) for r, c, j in encoded for s in (c, j)]
    longest = _longest(named)
    resolved = resolve_lengths(lengths, longest.prompt, longest.answer, max_seq_len)
    if log is not None:
        log(_said(lengths, resolved, longest, max_seq_len))
    pairs: list[PreferencePair] = []
    for r, chosen, rejected in encoded:
        fitted = _fit_record(chosen[0], [chosen, rejected], resolved, lengths.truncation)
        if isinstance(fitted, str):
            bad.append(BadLine(r.source, r.line, fitted))
            continue
        prompt, (fc, fr) = fitted
        pairs.append(PreferencePair(prompt, fc[1], fc[2], fr[1], fr[2], r.source, r.line))
    # Bad lines come from two passes (encoding, fitting); sorted, the report reads in file order.
    bad.sort(key=lambda b: (b.file, b.line))
    return pairs, bad, resolved


def encode_unpaired_records(
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[UnpairedRecord],
    lengths: Lengths = AUTO,
    max_seq_len: int | None = None,
    system_message: str = "auto",
    log: Callable[[str], None] | None = None,
) -> tuple[list[UnpairedExample], list[BadLine], tuple[int, int]]:
    """Tokenise unpaired (KTO) examples under the length rules, as `encode_pairs`."""
    bad: list[BadLine] = []
    encoded: list[tuple[UnpairedRecord, Side]] = []
    limit = _precheck_limit(lengths, max_seq_len)
    for start in range(0, len(records), BATCH):
        batch = records[start : start + BATCH]
        sides = encode_sides(
            tokenizer, [(r.prompt, r.completion) for r in batch], system_message, limit
        )
        for r, side in zip(batch, sides, strict=True):
            if isinstance(side, str):
                bad.append(BadLine(r.source, r.line, side))
            else:
                encoded.append((r, side))
    longest = _longest([(f"{r.source}:{r.line}", s) for r, s in encoded])
    resolved = resolve_lengths(lengths, longest.prompt, longest.answer, max_seq_len)
    if log is not None:
        log(_said(lengths, resolved, longest, max_seq_len))
    out: list[UnpairedExample] = []
    for r, side in encoded:
        fitted = _fit_record(side[0], [side], resolved, lengths.truncation, ("completion",))
        if isinstance(fitted, str):
            bad.append(BadLine(r.source, r.line, fitted))
            continue
        prompt, [(_, ids, labels)] = fitted
        out.append(UnpairedExample(prompt, ids, labels, r.label, r.source, r.line))
    bad.sort(key=lambda b: (b.file, b.line))
    return out, bad, resolved
