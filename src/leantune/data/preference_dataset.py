"""From a preference data file to tokenised pairs (or unpaired examples), tokenised at most once.

`preference_data` reads and validates the file (`preference_formats`), tokenises it under the
length rules (`preference_tokenize`) and refuses data that is mostly bad or has nothing to learn
from, as `dataset.check_usable` does for SFT data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.core.digests import content_digest
from leantune.core.writes import write_file
from leantune.data.dataset import check_usable
from leantune.data.errors import DataError
from leantune.data.formats import BadLine
from leantune.data.preference_formats import (
    PREFERENCE_FORMATS,
    detect_preference_format,
    read_pairs,
    read_unpaired,
)
from leantune.data.preference_tokenize import (
    AUTO,
    Lengths,
    PreferencePair,
    UnpairedExample,
    encode_pairs,
    encode_unpaired_records,
)
from leantune.data.prepare.provenance import tokenizer_fingerprint

__all__ = ["PreferenceData", "preference_cache_key", "preference_data"]

CACHE_VERSION = 1
"""Bumped when what the cache holds changes, so that older entries are not read."""


@dataclass
class PreferenceData:
    """Tokenised preference data and what was dropped."""

    format: str
    """preference (pairs) or kto (unpaired examples)."""
    pairs: list[PreferencePair] = field(default_factory=list)
    unpaired: list[UnpairedExample] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)
    total_lines: int = 0
    max_prompt_len: int = 0
    max_completion_len: int = 0
    said: list[str] = field(default_factory=list)
    """The log lines the reading said (format, auto lengths), said again from the cache."""

    @property
    def examples(self) -> Sequence[PreferencePair | UnpairedExample]:
        return self.pairs if self.format == "preference" else self.unpaired


@dataclass(frozen=True)
class _Settings:
    format: str
    max_prompt_len: int | str
    max_completion_len: int | str
    truncation: str
    max_seq_len: int | None
    system_prompt: str | None
    system_message: str


def preference_cache_key(
    path: str | Path, settings: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> str:
    """The cache key: file contents, tokenizer with its chat template, settings."""
    parts = {
        "version": CACHE_VERSION,
        "file": content_digest(path),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _tokenise(
    path: Path, s: _Settings, tokenizer: PreTrainedTokenizerBase, lengths: Lengths
) -> PreferenceData:
    data = PreferenceData(s.format)
    # What the reading says is recorded, not logged directly, so a run served from the cache
    # says the same lines (the form of the pairs, the auto lengths).
    say = data.said.append
    if s.format == "preference":
        records, bad = read_pairs(path, s.system_prompt, say)
        data.pairs, later, resolved = encode_pairs(
            tokenizer, records, lengths, s.max_seq_len, s.system_message, say
        )
    else:
        unpaired, bad = read_unpaired(path, s.system_prompt, say)
        data.unpaired, later, resolved = encode_unpaired_records(
            tokenizer, unpaired, lengths, s.max_seq_len, s.system_message, say
        )
    # Reading and tokenising each find bad lines; merged, the report reads in file order.
    data.bad = sorted([*bad, *later], key=lambda b: b.line)
    data.total_lines = len(data.examples) + len(data.bad)
    data.max_prompt_len, data.max_completion_len = resolved
    return data


def _write_cache(file: Path, data: PreferenceData) -> None:
    payload = {
        "format": data.format,
        "pairs": [asdict(p) for p in data.pairs],
        "unpaired": [asdict(e) for e in data.unpaired],
        "bad": [asdict(b) for b in data.bad],
        "total_lines": data.total_lines,
        "lengths": [data.max_prompt_len, data.max_completion_len],
        "said": data.said,
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    # write_file replaces the file whole, so a crash mid-write leaves no half cache to read.
    write_file(file, json.dumps(payload))


def _read_cache(file: Path) -> PreferenceData | None:
    """The cached data, or None when absent or damaged (then tokenised again and rewritten)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        return PreferenceData(
            raw["format"],
            [PreferencePair(**p) for p in raw["pairs"]],
            [UnpairedExample(**e) for e in raw["unpaired"]],
            [BadLine(**b) for b in raw["bad"]],
            raw["total_lines"],
            raw["lengths"][0],
            raw["lengths"][1],
            raw["said"],
        )
    # Any damage (truncated JSON, an entry of another shape) is a cache miss, never an error:
    # the data is tokenised again.
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _hint(path: Path, fmt: str) -> str:
    """A line naming the data.format `path` looks like, when it is not `fmt`."""
    found = detect_preference_format(path)
    if found == fmt:
        return ""
    if found is None:
        return (
            f"\n{path} does not look like data.format={fmt} (its first record has neither "
            "chosen/rejected nor prompt/completion/label): is it SFT data (data.format=chat, ...)?"
        )
    return f"\nthis looks like data.format={found}; use data.format={found}"


def preference_data(
    path: str | Path,
    *,
    fmt: str,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Lengths = AUTO,
    max_seq_len: int | None = None,
    system_prompt: str | None = None,
    system_message: str = "auto",
    max_bad_fraction: float = 0.0,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> PreferenceData:
    """A preference data file tokenised, at most once per (contents, tokenizer, settings).

    Args:
        path: The JSONL (or other `prepare.readers` kind) file.
        fmt: preference (pairs) or kto (unpaired examples).
        lengths: max_prompt_len, max_completion_len (`auto` from the data) and truncation.
        max_seq_len: The limit `auto` lengths share out (None: the data's longest).
        cache_dir: Where the tokenised data is kept for the next run (None: not kept).
        log: Where the format and the resolved lengths are said.

    Raises:
        ValueError: `fmt` is not a preference format. DataError: more than `max_bad_fraction`
            of the lines are bad, nothing is supervised, or the file cannot be read.
        FileNotFoundError: `path` does not exist.
    """
    if fmt not in PREFERENCE_FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {' | '.join(PREFERENCE_FORMATS)}")
    path = Path(path)
    s = _Settings(
        fmt,
        lengths.max_prompt_len,
        lengths.max_completion_len,
        lengths.truncation,
        max_seq_len,
        system_prompt,
        system_message,
    )
    # Keyed by (file contents, tokenizer and chat template, settings): a re-run or a resumed run
    # reads the cache instead of tokenising again; the format in the name keeps a preference
    # and a kto reading of one file apart at a glance.
    file = None
    if cache_dir is not None:
        key = preference_cache_key(path, asdict(s), tokenizer)
        file = Path(cache_dir) / f"{key[:24]}.{fmt}.json"
    data = _read_cache(file) if file is not None else None
    if data is None:
        data = _tokenise(path, s, tokenizer, lengths)
        if file is not None:
            _write_cache(file, data)
    for line in data.said:
        if log is not None:
            log(line)
    try:
        check_usable(path, data.total_lines, data.bad, data.examples, max_bad_fraction)
    except DataError as e:
        # The hint reads the file again, so it runs only on failure.
        raise DataError(f"{e}{_hint(path, fmt)}") from None
    return data
