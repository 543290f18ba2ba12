"""Stream records from JSONL (plain, gzip, zstd), JSON arrays, Parquet and CSV files.

Each item keeps its source file and line so a rejected record can be found: the physical line
for JSONL and JSON arrays, the row number for Parquet (1-based) and the line a CSV record starts
on (the header is line 1).

A file that is not what its name says is refused whole with a `ReaderError` naming the file and
where; a bad record in a readable file becomes an item that `decode_item` rejects, to be counted.
"""

from __future__ import annotations

import contextlib
import csv
import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.data.errors import DataError
from leantune.data.prepare.archive import (
    ArchiveError,
    check_zstd_frames,
    decompression_errors,
    open_jsonl,
)

SUFFIXES = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some Windows tools write; skipped
# csv's own limit (128 KiB) refused real long conversations; past this, an unclosed quote is
# the likely cause, and the rest of the file would be read as one field.
CSV_FIELD_LIMIT = 64 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")  # what undecodable bytes become (surrogateescape)
# A cheap pre-test before json.loads: only text that opens like a list of objects is parsed.
_JSON_LIST = re.compile(r"\s*\[\s*\{")
_REFUSED = "the whole file is refused"


class ReaderError(DataError):
    """A data file that cannot be read as what its name says; it is refused whole."""


class DecodeError(ValueError):
    """A record that is not valid JSON (or not readable at all); `kind` names the reason."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Unreadable:
    """The payload of a record that could not be read, with the kind and reason of its drop."""

    kind: str
    reason: str


@dataclass(frozen=True)
class RawItem:
    """One input record before validation.

    `payload` is the raw line (bytes) for JSONL, the decoded value for the other kinds, or an
    `Unreadable`. `size` approximates its bytes, to cut partitions of a given size.
    """

    source: str
    line: int
    payload: bytes | Any
    size: int


def file_kind(path: str | Path) -> str:
    """The reader a file needs, from its suffix.

    Raises:
        ReaderError: unknown suffix, listing the supported ones.
    """
    name = str(path).lower()
    # Longest suffix first, so ".jsonl.gz" is not taken for something ending in ".gz" alone
    # and ".jsonl" is matched before ".json" could be.
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIXES[suffix]
    raise ReaderError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")


def _read_jsonl(path: Path, kind: str) -> Generator[RawItem, None, None]:
    lineno = 0
    try:
        # Checked up front: a truncated zstd stream can otherwise end quietly at a frame
        # boundary, and its missing records would pass unnoticed.
        if kind == "jsonl.zst":
            check_zstd_frames(path)
        with open_jsonl(path, kind) as f:
            # Lines stay bytes: decoding and JSON parsing happen per record in the workers,
            # where a bad line is one rejection, not a failure of the reader.
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM) :]
                yield RawItem(str(path), lineno, raw, len(raw))
    # A damaged archive is refused whole: what it holds is not the data that was compressed.
    except ArchiveError as e:
        raise ReaderError(
            f"{path}: {e}; {_REFUSED}, since it is not the data that was compressed: "
            "write or download it again"
        ) from e
    except decompression_errors(kind) as e:
        raise ReaderError(
            f"{path}: the compressed data is damaged or truncated after line {lineno} ({e}); "
            f"{_REFUSED}, since it is not the data that was compressed: write or download "
            "it again"
        ) from e


def _read_json_array(path: Path) -> Generator[RawItem, None, None]:
    # Read whole: the standard library has no streaming JSON parser (use JSONL at scale).
    # raw_decode one element at a time still gives each record its own line number.
    raw = path.read_bytes()
    raw = raw[len(BOM) :] if raw.startswith(BOM) else raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ReaderError(f"{path}:{line}: not valid UTF-8 (byte {e.start}); {_REFUSED}") from e
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ReaderError(f"{path}:1: a .json file must hold an array of records; use .jsonl")
    pos = _skip_ws(text, pos + 1)
    line, counted = 1, 0
    while pos >= len(text) or text[pos] != "]":
        # Newlines are counted incrementally from the last position: counting from 0 for each
        # record would make a large array quadratic.
        line += text.count("\n", counted, pos)
        counted = pos
        if pos >= len(text):
            raise ReaderError(f"{path}:{line}: the array is not closed (a truncated file?)")
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ReaderError(f"{path}:{e.lineno}: invalid JSON: {e.msg}; {_REFUSED}") from e
        except RecursionError:
            raise ReaderError(f"{path}:{line}: nested too deeply; {_REFUSED}") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise ReaderError(f"{path}:{line}: invalid JSON: {e}; {_REFUSED}") from e
        yield RawItem(str(path), line, obj, end - pos)
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            where = line + text.count("\n", counted, pos)
            raise ReaderError(f"{path}:{where}: expected ',' or ']' after a record; {_REFUSED}")
    end = _skip_ws(text, pos + 1)
    if end < len(text):
        where = text.count("\n", 0, end) + 1
        raise ReaderError(f"{path}:{where}: unexpected text after the array; {_REFUSED}")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_parquet(path: Path) -> Generator[RawItem, None, None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Batches of row groups keep memory bounded however large the file is.
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
    except (pa.ArrowException, OSError) as e:
        raise ReaderError(f"{path}: not a Parquet file ({e})") from e
    row = 0
    try:
        for batch in batches:
            for obj in batch.to_pylist():
                row += 1
                # Size estimate for partitioning: the text of the values plus a per-row overhead.
                yield RawItem(str(path), row, obj, 64 + sum(len(str(v)) for v in obj.values()))
    except (pa.ArrowException, OSError) as e:
        raise ReaderError(f"{path}: damaged after row {row} ({e}); {_REFUSED}") from e


def _message_list(text: str) -> list[Any] | None:
    """The list of objects a CSV cell holds as JSON, or None for any other text."""
    if not _JSON_LIST.match(text):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return value
    return None


def _csv_payload(obj: dict[Any, Any], columns: int) -> dict[str, Any] | Unreadable:
    if None in obj:  # DictReader puts the fields past the header's under None
        n = columns + len(obj[None])
        return Unreadable("bad_csv_row", f"{n} fields, but the header has {columns}")
    # Keys too: a header that is not UTF-8 would otherwise reach the parser as a field name.
    if any(isinstance(v, str) and _SURROGATE.search(v) for v in (*obj, *obj.values())):
        return Unreadable("not_utf8", "not valid UTF-8")
    # A CSV cell is text: prompt/completion are TRL's message lists when they hold one as JSON,
    # else the strings they are (a prompt may well start with '[').
    for key in ("prompt", "completion"):
        value = obj.get(key)
        messages = _message_list(value) if isinstance(value, str) else None
        if messages is not None:
            obj[key] = messages
    return obj


def _read_csv(path: Path) -> Generator[RawItem, None, None]:
    # Only ever raised (the limit is process-wide): another caller's higher limit stays.
    if csv.field_size_limit() < CSV_FIELD_LIMIT:
        csv.field_size_limit(CSV_FIELD_LIMIT)
    # surrogateescape: a record with bytes that are not UTF-8 is dropped alone (see
    # `_csv_payload`), not the file; the quoting, in ASCII, is unaffected.
    # utf-8-sig skips a byte order mark; newline="" is what the csv module needs to read
    # newlines inside quoted cells. strict=True raises on broken quoting instead of guessing.
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f, strict=True)
        start = 1
        try:
            columns = len(reader.fieldnames or [])
            start = reader.line_num + 1
            for obj in reader:
                # A record may span several lines (quoted newlines): it is named by its first.
                size = 64 + sum(len(v or "") for v in obj.values() if isinstance(v, str))
                yield RawItem(str(path), start, _csv_payload(obj, columns), size)
                start = reader.line_num + 1
        except csv.Error as e:
            raise ReaderError(
                f"{path}:{start}: {e}; {_REFUSED}, since past broken quoting the records "
                "cannot be told apart"
            ) from e


def read_items(path: str | Path) -> Generator[RawItem, None, None]:
    """Stream the raw records of one file.

    Raises:
        FileNotFoundError: the file does not exist. ReaderError: unsupported type, a
            directory, or a file that cannot be read as its kind (raised while iterating).
    """
    path = Path(path)
    # Checked here, eagerly: the readers are generators, which would raise only when iterated.
    if path.is_dir():
        raise ReaderError(f"{path}: is a directory, not a data file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    kind = file_kind(path)
    if kind.startswith("jsonl"):
        return _read_jsonl(path, kind)
    readers = {"json": _read_json_array, "parquet": _read_parquet, "csv": _read_csv}
    return readers[kind](path)


def parse_json(text: str | bytes, where: str = "") -> Any:
    """`json.loads`, with every way it fails as a `DecodeError` (`where` prefixes the reason)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DecodeError(
            "invalid_json", f"{where}invalid JSON: {e.msg} at column {e.colno}"
        ) from e
    except RecursionError:
        raise DecodeError("too_deep", f"{where}nested too deeply for the JSON parser") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DecodeError("invalid_json", f"{where}invalid JSON: {e}") from e


def decode_item(item: RawItem) -> Any:
    """The record's JSON value. Chat `messages` and ShareGPT `conversations` stored as a JSON
    string (CSV) are decoded too.

    Raises:
        DecodeError: with its kind and reason (not UTF-8, invalid JSON, nested too deeply,
            empty line, an unreadable CSV row).
    """
    payload = item.payload
    if isinstance(payload, Unreadable):
        raise DecodeError(payload.kind, payload.reason)
    if isinstance(payload, bytes):
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError("not_utf8", f"not valid UTF-8 (byte {e.start})") from e
        # A blank line is its own kind: it is dropped, but not counted as bad data.
        if not text.strip():
            raise DecodeError("empty_line", "empty line")
        payload = parse_json(text)
    # CSV cells are text, so a chat record's messages arrive as a JSON string.
    if isinstance(payload, dict) and isinstance(payload.get("messages"), str):
        payload = {**payload, "messages": parse_json(payload["messages"], "field 'messages': ")}
    if isinstance(payload, dict) and isinstance(payload.get("conversations"), str):
        # Decoded only when it is JSON: a record of another format may have such a text column
        # (the ShareGPT parser says what is wrong with one that is not).
        with contextlib.suppress(DecodeError):
            payload = {**payload, "conversations": parse_json(payload["conversations"])}
    return payload


def decoded_items(path: str | Path) -> Iterator[tuple[RawItem, Any]]:
    """(item, decoded value or DecodeError) for every record of a file; blank lines skipped."""
    # closing(): a caller that stops early (format detection reads one record) closes the
    # generator, and with it the file it holds open.
    with contextlib.closing(read_items(path)) as items:
        for item in items:
            try:
                yield item, decode_item(item)
            except DecodeError as e:
                if e.kind != "empty_line":
                    yield item, e
