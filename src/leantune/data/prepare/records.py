"""Per-record work, identical on every engine: validate, clean, hash, tokenise, length-filter.

`process_chunk` is a pure function of (raw items, settings, tokenizer); the driver's dedup pass
and packing, which need the whole dataset, run after it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data import chat_spans
from leantune.data.chat_spans import SYSTEM_POLICIES
from leantune.data.formats import FORMATS, BadRecordError, parse_record
from leantune.data.prepare.clean import check_rules, clean_record
from leantune.data.prepare.dedup import DEDUP_MODES, content_hash, minhash, record_text
from leantune.data.prepare.readers import DecodeError, RawItem, decode_item
from leantune.data.record_checks import UNSUPPORTED, is_empty_answer
from leantune.data.tokenize import (
    IGNORE_INDEX,
    TemplateError,
    render_chat,
    shifted_labels,
    supervised_mask,
    too_long,
)


@dataclass(frozen=True)
class PrepareSettings:
    """Everything that decides the prepared output besides the input files and the tokenizer."""

    format: str
    max_seq_len: int
    pack: bool = True
    system_prompt: str | None = None
    system_message: str = "auto"
    clean: tuple[str, ...] = ()
    dedup: str = "none"
    near_dup_threshold: float = 0.85
    num_perm: int = 64
    min_tokens: int = 1
    truncate: bool = False

    def __post_init__(self) -> None:
        # Checked at construction: the settings are part of the cache key, so a bad value must
        # not produce a directory keyed by it.
        if self.format not in FORMATS:
            raise ValueError(f"data.format: {self.format!r} is not one of {' | '.join(FORMATS)}")
        if self.dedup not in DEDUP_MODES:
            raise ValueError(f"data.dedup: {self.dedup!r} is not one of {' | '.join(DEDUP_MODES)}")
        if self.system_message not in SYSTEM_POLICIES:
            raise ValueError(
                f"data.system_message: {self.system_message!r} is not one of "
                f"{' | '.join(SYSTEM_POLICIES)}"
            )
        if self.max_seq_len < 1 or self.min_tokens < 0:
            raise ValueError("data.max_seq_len must be >= 1 and data.min_tokens >= 0")
        # Normalised (frozen dataclass, hence object.__setattr__) so that equal rule sets give
        # equal cache keys.
        object.__setattr__(self, "clean", check_rules(self.clean))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rejection:
    """A dropped record: where it is, a machine-readable kind and a readable reason."""

    source: str
    line: int
    kind: str
    reason: str

    def row(self) -> dict[str, Any]:
        return {"file": self.source, "line": self.line, "kind": self.kind, "reason": self.reason}


@dataclass
class Kept:
    """A record that passed validation and length filters (dedup comes later, on the driver)."""

    source: str
    line: int
    record: str  # the cleaned text, or the cleaned {"messages": [...]} as JSON
    digest: int
    signature: np.ndarray | None
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, shifted (see leantune.data.tokenize)


@dataclass
class ChunkResult:
    """The outcome of one chunk, in input order (`order` interleaves kept and rejected)."""

    kept: list[Kept] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    order: list[bool] = field(default_factory=list)  # True = next kept, False = next rejected
    cleaned: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _bad_kind(reason: str) -> str:
    # Kinds from the parser's message text: the record checks raise one exception type with a
    # readable reason, and the report wants them counted by kind.
    if reason.startswith("expected a JSON object"):
        return "not_object"
    if reason.startswith("missing field"):
        return "missing_field"
    if "is empty" in reason or "empty assistant answer" in reason:
        return "empty_field"
    if "not valid Unicode" in reason:
        return "not_unicode"
    if UNSUPPORTED in reason:
        return "unsupported"
    return "invalid_record"


def _after_cleaning(parsed: dict[str, Any]) -> str | None:
    """Why a cleaned record is unusable (a field cleaned to nothing), or None."""
    if "text" in parsed:
        return None if parsed["text"].strip() else "field 'text' is empty after cleaning"
    for i, msg in enumerate(parsed["messages"]):
        if is_empty_answer(msg):
            return f"messages[{i}].content: empty assistant answer after cleaning"
    return None


@dataclass(frozen=True)
class Dropped:
    """A record `encode_batch` did not tokenise: the kind and reason of its rejection."""

    kind: str
    reason: str


Encoded = tuple[np.ndarray, np.ndarray]


def encode_batch(
    tokenizer: PreTrainedTokenizerBase,
    parsed: list[dict[str, Any]],
    max_tokens: int | None = None,
    system_message: str = "auto",
) -> list[Encoded | Dropped]:
    """Tokenise records in one tokenizer call per kind; equals `encode_record` per record.

    A record certainly longer than `max_tokens` (None: no limit) is `Dropped` as too long
    before tokenising; one whose chat template fails is `Dropped` as a template error.
    """
    # Batched: one fast-tokenizer call per kind is much quicker than one call per record.
    out: list[Encoded | Dropped | None] = [None] * len(parsed)
    chats: list[tuple[int, str, list[tuple[int, int]]]] = []
    texts: list[int] = []
    for i, p in enumerate(parsed):
        text = p.get("text")
        try:
            if text is None:
                messages, start = chat_spans.for_template(
                    tokenizer, p["messages"], system_message, p.get("supervise_from", 0)
                )
                text = render_chat(tokenizer, messages, p.get("tools"))
            rejected = too_long(tokenizer, text, max_tokens)
            if rejected is not None:
                out[i] = Dropped("too_long", str(rejected))
            elif "messages" in p:
                spans = chat_spans.answer_spans(tokenizer, messages, text, start)
                chats.append((i, text, spans))
            else:
                texts.append(i)
        except TemplateError as e:
            out[i] = Dropped("template_error", str(e))
    if chats:
        enc: Any = tokenizer(
            [full for _, full, _ in chats], add_special_tokens=False, return_offsets_mapping=True
        )
        for j, (i, _, spans) in enumerate(chats):
            # int32 halves the memory of int64 and holds any vocabulary size in use.
            ids = np.asarray(enc["input_ids"][j], dtype=np.int32)
            out[i] = (ids, shifted_labels(ids, supervised_mask(enc["offset_mapping"][j], spans)))
    if texts:
        # As encode_text: the tokenizer's BOS, and an EOS added unless it wrote one.
        enc = tokenizer([parsed[i]["text"] for i in texts], add_special_tokens=True)
        eos = tokenizer.eos_token_id
        for j, i in enumerate(texts):
            toks = list(enc["input_ids"][j])
            if eos is not None and (not toks or toks[-1] != eos):
                toks.append(eos)
            ids = np.asarray(toks, dtype=np.int32)
            out[i] = (ids, shifted_labels(ids, np.ones(ids.size, dtype=bool)))
    return [o for o in out if o is not None]


def _length_check(
    ids: np.ndarray, labels: np.ndarray, s: PrepareSettings
) -> tuple[np.ndarray, np.ndarray, str, str]:
    """Apply the token length filters; returns (ids, labels, kind, reason), kind "" = keep."""
    n = int(ids.size)
    if n > s.max_seq_len:
        if not s.truncate:
            return (
                ids,
                labels,
                "too_long",
                f"too long: {n} tokens > data.max_seq_len={s.max_seq_len}",
            )
        # copy(): the slice is a view, and the last label is overwritten below.
        ids, labels = ids[: s.max_seq_len], labels[: s.max_seq_len].copy()
        labels[-1] = IGNORE_INDEX  # it pointed at a token that was cut off
        if not (labels != IGNORE_INDEX).any():
            reason = (
                f"answer truncated to nothing: {n} tokens cut to data.max_seq_len={s.max_seq_len}"
            )
            return ids, labels, "answer_truncated", reason
    if n < s.min_tokens:
        return ids, labels, "too_short", f"too short: {n} tokens < data.min_tokens={s.min_tokens}"
    if not (labels != IGNORE_INDEX).any():
        return ids, labels, "no_supervised", "no supervised tokens after tokenisation"
    return ids, labels, "", ""


def process_chunk(
    items: list[RawItem], settings: PrepareSettings, tokenizer: PreTrainedTokenizerBase
) -> ChunkResult:
    """Validate, clean, hash and tokenise one chunk of raw items."""
    start = time.perf_counter()
    result = ChunkResult()
    valid: list[tuple[int, dict[str, Any]]] = []
    outcome: list[Rejection | None] = [None] * len(items)
    for pos, item in enumerate(items):
        try:
            obj = decode_item(item)
        except DecodeError as e:
            outcome[pos] = Rejection(item.source, item.line, e.kind, str(e))
            continue
        try:
            parsed = parse_record(obj, settings.format, settings.system_prompt)
        except BadRecordError as e:
            outcome[pos] = Rejection(item.source, item.line, _bad_kind(str(e)), str(e))
            continue
        # Cleaning comes before hashing and tokenising, so dedup compares and training sees
        # the cleaned text.
        parsed = clean_record(parsed, settings.clean, result.cleaned)
        empty = _after_cleaning(parsed)
        if empty:
            outcome[pos] = Rejection(item.source, item.line, "empty_after_cleaning", empty)
            continue
        valid.append((pos, parsed))
    # With truncate, an over-long record is cut, not dropped: it must be tokenised.
    limit = None if settings.truncate else settings.max_seq_len
    encoded = encode_batch(tokenizer, [p for _, p in valid], limit, settings.system_message)
    kept_at: dict[int, Kept] = {}
    for (pos, parsed), enc in zip(valid, encoded, strict=True):
        item = items[pos]
        if isinstance(enc, Dropped):
            outcome[pos] = Rejection(item.source, item.line, enc.kind, enc.reason)
            continue
        ids, labels, kind, reason = _length_check(enc[0], enc[1], settings)
        if kind:
            outcome[pos] = Rejection(item.source, item.line, kind, reason)
            continue
        # Hashes are computed here, in the workers; the driver only compares them.
        sig = None
        if settings.dedup == "near":
            sig = minhash(record_text(parsed), settings.num_perm)
        record = parsed["text"] if "text" in parsed else json.dumps(parsed, ensure_ascii=False)
        kept_at[pos] = Kept(item.source, item.line, record, content_hash(parsed), sig, ids, labels)
    # Rebuilt in input order so the driver's dedup sees records as the file has them.
    for pos, rejection in enumerate(outcome):
        if rejection is not None:
            result.rejected.append(rejection)
            result.order.append(False)
        elif pos in kept_at:
            result.kept.append(kept_at[pos])
            result.order.append(True)
    result.seconds = time.perf_counter() - start
    return result
