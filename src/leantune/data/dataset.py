"""From a data file to training rows: the one path that `train`, `eval` and `plan` share.

`prepared_data` runs the prepare pipeline (`leantune.data.prepare.pipeline.prepare_dataset`)
into a directory and reads it back as `PreparedData`.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.errors import DataError
from leantune.data.formats import BadLine, Record, format_hint
from leantune.data.packing import Row
from leantune.data.prepare.pipeline import cache_key, prepare_dataset, read_report
from leantune.data.prepare.provenance import check_tokenizer
from leantune.data.prepare.records import PrepareSettings
from leantune.data.prepare.shards import best_fit_decreasing, read_examples, read_rows, rows_of
from leantune.data.tokenize import Example
from leantune.layout import PreparedPaths

__all__ = [
    "NOT_BAD",
    "DataError",
    "PreparedData",
    "check_token_range",
    "check_usable",
    "load_prepared",
    "prepared_data",
]

# Dropped on purpose, not bad data: they do not count against data.max_bad_fraction.
NOT_BAD = frozenset({"empty_line", "exact_duplicate", "near_duplicate"})


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


def prepared_data(
    path: str | Path,
    *,
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | Path | None = None,
    max_bad_fraction: float = 0.0,
    limit: int | None = None,
    log: Callable[[str], None] | None = None,
    engine: dict[str, Any] | None = None,
) -> PreparedData:
    """A data file as `PreparedData`, tokenised at most once per (contents, tokenizer, settings).

    Args:
        path: The data file, or a prepared directory (from `leantune prepare`), read as is.
        settings: What decides the rows (format, max_seq_len, packing, cleaning, dedup, ...).
        tokenizer: The model's tokenizer, chat template applied.
        cache_dir: Where the prepared directory is kept for the next run; None prepares into
            a temporary directory, removed once read.
        max_bad_fraction: The share of bad lines tolerated (1.0: any).
        limit: Use only the first `limit` kept records (and the bad lines among them); packed
            again when `settings.pack`.
        log: Where the pipeline's progress lines go.
        engine: `prepare_dataset`'s engine keyword arguments (engine, scheduler, partition_mb).

    Raises:
        DataError: more than `max_bad_fraction` of the lines are bad, nothing is supervised, the
            file cannot be read as its kind, or a prepared directory of another data.format.
        TokenizerMismatch: a prepared directory made by another tokenizer or chat template, or
            one that does not record which (a DataError too).
        FileNotFoundError: `path` does not exist.
    """
    path = Path(path)
    if path.is_dir():
        _check_prepared_with(path, settings, tokenizer, log)
        return _load(path, path, settings, max_bad_fraction, limit)
    # eval and plan give no cache directory: nothing is left behind.
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="leantune-prepared-") as tmp:
            out = Path(tmp) / "data"
            prepare_dataset([str(path)], settings, tokenizer, out, log=log, **(engine or {}))
            return _load(out, path, settings, max_bad_fraction, limit)
    # train keeps the directory, keyed by (contents, tokenizer, template, settings): a re-run or
    # a resume after a crash reads the shards instead of tokenising again. 24 hex characters
    # (96 bits) make a collision between two datasets negligible while keeping paths short.
    out = Path(cache_dir) / cache_key([str(path)], settings, tokenizer)[:24]
    prepare_dataset([str(path)], settings, tokenizer, out, log=log, **(engine or {}))
    return _load(out, path, settings, max_bad_fraction, limit)


def _check_prepared_with(
    out: Path,
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    log: Callable[[str], None] | None,
) -> None:
    """Refuse a prepared directory of another format or made by another tokenizer (or chat
    template); warn when its rows have another length."""
    report = read_report(out)
    if report is None:
        return  # `load_prepared` says it is not a prepared directory
    made = report.get("settings", {})
    # A report without a field (an older directory) is given the benefit of the doubt.
    if made.get("format", settings.format) != settings.format:
        raise DataError(
            f"{out}: prepared as data.format={made['format']}, but data.format="
            f"{settings.format}; prepare it again or fix data.format"
        )
    check_tokenizer(out, report, tokenizer, settings.format)
    # Only a warning: rows packed to another length still train correctly, at another shape.
    if made.get("max_seq_len", settings.max_seq_len) != settings.max_seq_len and log:
        log(
            f"warning: {out} was packed with max_seq_len={made['max_seq_len']}, "
            f"not data.max_seq_len={settings.max_seq_len}; its rows are used as they are"
        )


def _load(
    out: Path, name: Path, settings: PrepareSettings, max_bad_fraction: float, limit: int | None
) -> PreparedData:
    """The prepared directory `out` (called `name` in messages), cut to `limit` records."""
    if limit is None:
        return load_prepared(out, max_bad_fraction=max_bad_fraction, name=name)
    # Load tolerating every bad line, then check the bad fraction on the cut alone: bad lines
    # past the limit are not this run's business.
    data = load_prepared(out, max_bad_fraction=1.0, name=name)
    data.examples, data.records = data.examples[:limit], data.records[:limit]
    last = data.records[-1].line if data.records else 0
    data.bad = [b for b in data.bad if b.line <= last]
    data.total_lines = len(data.examples) + len(data.bad)
    # The stored rows pack all examples; a cut set is packed again with the same packer.
    lengths = [len(e.input_ids) for e in data.examples]
    groups = best_fit_decreasing(lengths, settings.max_seq_len) if settings.pack else None
    data.rows = rows_of(data.examples, groups)
    _check(name, data, max_bad_fraction, settings.format)
    return data


def load_prepared(
    out: str | Path, *, max_bad_fraction: float = 1.0, name: str | Path | None = None
) -> PreparedData:
    """Read a prepared directory (from `leantune prepare`) into `PreparedData`.

    `name` (default `out`) is what error messages call the data, e.g. the input file.

    Raises:
        DataError: not a prepared directory, more than `max_bad_fraction` bad lines, or nothing
            to train on.
    """
    out = Path(out)
    report = read_report(out)
    if report is None:
        raise DataError(f"{out}: not a prepared directory (run `leantune prepare` first)")
    records, examples = _examples(out)
    bad: list[BadLine] = []
    with PreparedPaths(out).rejected.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            # Empty lines and duplicates are in rejected.jsonl for the report, not bad data.
            if row["kind"] not in NOT_BAD:
                bad.append(BadLine(row["file"], row["line"], row["reason"]))
    data = PreparedData(read_rows(out), examples, records, bad, len(examples) + len(bad))
    fmt = report.get("settings", {}).get("format")
    _check(Path(name) if name is not None else out, data, max_bad_fraction, fmt)
    return data


def _examples(out: Path) -> tuple[list[Record], list[Example]]:
    table = read_examples(out)
    if table is None:
        return [], []
    # Text data stores its text; chat data its messages as JSON (one string column for any
    # conversation shape).
    column = "text" if "text" in table.column_names else "messages"
    records = [
        Record(source=s, line=n, text=r) if column == "text" else _chat_record(s, n, r)
        for s, n, r in zip(
            table.column("source").to_pylist(),
            table.column("line").to_pylist(),
            table.column(column).to_pylist(),
            strict=True,
        )
    ]
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    return records, [Example(a, b) for a, b in zip(ids, labels, strict=True)]


def _chat_record(source: str, line: int, stored: str) -> Record:
    parsed = json.loads(stored)
    return Record(
        source=source,
        line=line,
        messages=tuple(parsed["messages"]),
        supervise_from=parsed.get("supervise_from", 0),
        tools=tuple(parsed["tools"]) if "tools" in parsed else None,
    )


def _check(
    where: Path, data: PreparedData, max_bad_fraction: float, fmt: str | None = None
) -> None:
    check_usable(where, data.total_lines, data.bad, data.examples, max_bad_fraction, fmt)


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


def check_token_range(data: PreparedData, vocab_size: int, where: str | Path) -> None:
    """Refuse token ids outside [0, vocab_size).

    An embedding of `vocab_size` rows would fail on them with an IndexError (or, on some
    devices, read other memory).

    Raises:
        DataError: naming `where`, the first record with such an id, the id and the size.
    """
    # Inputs only: the labels are the same ids shifted, so checking the inputs covers them.
    # A whole-data min/max first: the per-example search below runs only when one is bad.
    ids = [e.input_ids for e in data.examples if e.input_ids]
    if not ids or (min(map(min, ids)) >= 0 and max(map(max, ids)) < vocab_size):
        return
    for i, example in enumerate(data.examples):
        bad = next((t for t in example.input_ids if not 0 <= t < vocab_size), None)
        if bad is None:
            continue
        record = data.records[i] if i < len(data.records) else None
        if record is None:
            which = f"{where}: example {i}"
        elif record.source == str(where):
            which = f"{where}:{record.line}"
        else:
            which = f"{where}: record {record.source}:{record.line}"
        raise DataError(
            f"{which}: token id {bad} is outside the model's vocabulary (its "
            f"embedding has {vocab_size} rows, ids 0..{vocab_size - 1}): the ids were made by "
            "a tokenizer with more tokens than the model has embeddings. Give model.path a "
            "model whose tokenizer and weights belong together; prepared data: prepare it "
            "again with this model"
        )
