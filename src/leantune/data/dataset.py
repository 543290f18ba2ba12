"""From a data file to training rows: read, validate, tokenise, length-check, pack."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.errors import DataError
from leantune.data.formats import BadLine, Record, format_hint, read_records
from leantune.data.packing import Row, pack_examples, single_rows
from leantune.data.tokenize import Example, TemplateError, TooLong, encode_within

__all__ = ["DataError", "PreparedData", "check_usable", "prepare_file"]


@dataclass
class PreparedData:
    """Rows ready for the trainer plus what was rejected."""

    rows: list[Row]
    examples: list[Example]
    records: list[Record]
    bad: list[BadLine] = field(default_factory=list)
    total_lines: int = 0

    @property
    def supervised_tokens(self) -> int:
        return sum(e.num_supervised for e in self.examples)


def prepare_file(
    path: str | Path,
    fmt: str,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    pack: bool,
    system_prompt: str | None = None,
    max_bad_fraction: float = 0.0,
    limit: int | None = None,
) -> PreparedData:
    """Read, validate and tokenise `path` (its first `limit` records if given); pack when asked.

    A record certainly longer than `max_seq_len` is rejected before it is tokenised, and one
    the chat template refuses is a bad line like any other.

    Raises:
        DataError: more than `max_bad_fraction` of the lines are bad, nothing is supervised, or
            the file cannot be read as its kind.
    """
    records, bad = read_records(path, fmt, system_prompt)
    if limit is not None:  # the first `limit` valid records (and the bad lines among them)
        records = records[:limit]
        last = records[-1].line if records else 0
        bad = [b for b in bad if b.line <= last]
    kept_records: list[Record] = []
    examples: list[Example] = []
    for rec in records:
        try:
            ex = encode_within(tokenizer, rec, max_seq_len)
        except TemplateError as e:
            bad.append(BadLine(rec.source, rec.line, str(e)))
            continue
        if isinstance(ex, TooLong):
            bad.append(BadLine(rec.source, rec.line, str(ex)))
        elif len(ex.input_ids) > max_seq_len:
            reason = f"too long: {len(ex.input_ids)} tokens > data.max_seq_len={max_seq_len}"
            bad.append(BadLine(rec.source, rec.line, reason))
        elif ex.num_supervised == 0:
            bad.append(BadLine(rec.source, rec.line, "no supervised tokens after tokenisation"))
        else:
            kept_records.append(rec)
            examples.append(ex)
    bad.sort(key=lambda b: b.line)
    total = len(examples) + len(bad)
    check_usable(path, total, bad, examples, max_bad_fraction, fmt)
    rows = pack_examples(examples, max_seq_len) if pack else single_rows(examples)
    return PreparedData(rows, examples, kept_records, bad, total)


class Supervised(Protocol):
    """An example as `check_usable` sees it: how many of its tokens are supervised."""

    @property
    def num_supervised(self) -> int: ...


def check_usable(
    where: str | Path,
    total: int,
    bad: list[BadLine],
    examples: Sequence[Supervised],
    max_bad_fraction: float,
    fmt: str | None = None,
) -> None:
    """Refuse data that is empty, mostly bad, or has nothing to learn from.

    When most lines lack a field of `fmt` and `where` is a file in another format, the message
    ends with the data.format to use.

    Raises:
        DataError: naming `where`, the share of bad lines and the first few of them.
    """
    if total == 0:
        raise DataError(f"{where}: no records (the input is empty)")
    hint = _hint(where, total, bad, fmt)
    if bad and len(bad) / total > max_bad_fraction:
        shown = "\n  ".join(str(b) for b in bad[:10])
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise DataError(
            f"{where}: {len(bad)} of {total} lines are bad ({len(bad) / total:.1%} > "
            f"data.max_bad_fraction={max_bad_fraction:g}):\n  {shown}{more}{hint}"
        )
    if not examples or sum(e.num_supervised for e in examples) == 0:
        raise DataError(f"{where}: no supervised tokens; refusing to train on nothing{hint}")


def _hint(where: str | Path, total: int, bad: list[BadLine], fmt: str | None) -> str:
    """A line naming the format `where` is really in, when most of its lines miss a field."""
    missing = sum(1 for b in bad if b.reason.startswith("missing field"))
    if fmt is None or 2 * missing <= total or not Path(where).is_file():
        return ""
    hint = format_hint(where, fmt)
    return f"\n{hint}" if hint else ""
