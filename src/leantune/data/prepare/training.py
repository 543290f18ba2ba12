"""What `train` uses: a prepared directory as `PreparedData`, and the tokenise-once cache.

`prepared_data` gives the training loop the same `PreparedData` as `dataset.prepare_file`, but
through `prepare_dataset` and a cache directory keyed by (input contents, tokenizer, template,
settings): a re-run or a run resumed after a crash reads the shards instead of tokenising again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.dataset import DataError, PreparedData, check_usable
from leantune.data.formats import BadLine, Record
from leantune.data.prepare.pipeline import REJECTED, cache_key, prepare_dataset, read_report
from leantune.data.prepare.records import PrepareSettings
from leantune.data.prepare.shards import best_fit_decreasing, read_examples, read_rows, rows_of
from leantune.data.tokenize import Example

# Dropped on purpose, not bad data: they do not count against data.max_bad_fraction.
NOT_BAD = frozenset({"empty_line", "exact_duplicate", "near_duplicate"})


def load_prepared(
    out: str | Path, max_bad_fraction: float = 1.0, name: str | Path | None = None
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
    with (out / REJECTED).open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
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
    )


def _check(
    where: Path, data: PreparedData, max_bad_fraction: float, fmt: str | None = None
) -> None:
    check_usable(where, data.total_lines, data.bad, data.examples, max_bad_fraction, fmt)


def prepared_data(
    path: str | Path,
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | Path,
    max_bad_fraction: float = 0.0,
    limit: int | None = None,
    log: Callable[[str], None] | None = None,
    engine: dict[str, Any] | None = None,
) -> PreparedData:
    """A data file as `PreparedData`, tokenised at most once per (contents, tokenizer, settings).

    `path` may also be a prepared directory, which is read as is. With `limit`, only the first
    `limit` kept records (and the bad lines among them) are used, as `prepare_file` does.
    """
    path = Path(path)
    if path.is_dir():
        out = path
        made = (read_report(out) or {}).get("settings", {})
        if made.get("format", settings.format) != settings.format:
            raise DataError(
                f"{out}: prepared as data.format={made['format']}, but data.format="
                f"{settings.format}; prepare it again or fix data.format"
            )
        if made.get("max_seq_len", settings.max_seq_len) != settings.max_seq_len and log:
            log(
                f"warning: {out} was packed with max_seq_len={made['max_seq_len']}, "
                f"not data.max_seq_len={settings.max_seq_len}; its rows are used as they are"
            )
    else:
        out = Path(cache_dir) / cache_key([str(path)], settings, tokenizer)[:24]
        prepare_dataset([str(path)], settings, tokenizer, out, log=log, **(engine or {}))
    if limit is None:
        return load_prepared(out, max_bad_fraction, name=path)
    data = load_prepared(out, 1.0, name=path)
    data.examples, data.records = data.examples[:limit], data.records[:limit]
    last = data.records[-1].line if data.records else 0
    data.bad = [b for b in data.bad if b.line <= last]
    data.total_lines = len(data.examples) + len(data.bad)
    lengths = [len(e.input_ids) for e in data.examples]
    groups = best_fit_decreasing(lengths, settings.max_seq_len) if settings.pack else None
    data.rows = rows_of(data.examples, groups)
    _check(path, data, max_bad_fraction, settings.format)
    return data
