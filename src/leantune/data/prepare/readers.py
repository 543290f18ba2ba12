"""Stream records from JSONL (plain, gzip, zstd), JSON arrays, Parquet and CSV files.

Each item keeps its source file and line so a rejected record can be found: the physical line
for JSONL and JSON arrays, the row number for Parquet (1-based) and the line a CSV record starts
on (the header is line 1). JSONL, Parquet and CSV are read in bounded memory; a JSON array is
parsed whole (the standard library has no streaming JSON parser), so use JSONL at scale.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SUFFIXES = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


@dataclass(frozen=True)
class RawItem:
    """One input record before validation.

    `payload` is the raw line (bytes) for JSONL, or the decoded value for the other kinds.
    `size` approximates its bytes, to cut partitions of a given size.
    """

    source: str
    line: int
    payload: bytes | Any
    size: int


def file_kind(path: str | Path) -> str:
    """The reader a file needs, from its suffix.

    Raises:
        ValueError: unknown suffix, listing the supported ones.
    """
    name = str(path).lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIXES[suffix]
    raise ValueError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")


def _open_jsonl(path: Path, kind: str) -> IO[bytes]:
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == "jsonl.zst":
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True)
        return io.BufferedReader(raw, buffer_size=1 << 20)
    return path.open("rb")


def _read_jsonl(path: Path, kind: str) -> Iterator[RawItem]:
    with _open_jsonl(path, kind) as f:
        for lineno, raw in enumerate(f, start=1):
            yield RawItem(str(path), lineno, raw, len(raw))


def _read_json_array(path: Path) -> Iterator[RawItem]:
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path}:1: a .json file must hold an array of records; use .jsonl")
    pos = _skip_ws(text, pos + 1)
    line, counted = 1, 0
    while pos < len(text) and text[pos] != "]":
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e
        yield RawItem(str(path), line, obj, end - pos)
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_parquet(path: Path) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            row += 1
            yield RawItem(str(path), row, obj, 64 + sum(len(str(v)) for v in obj.values()))


def _read_csv(path: Path) -> Iterator[RawItem]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        start = 2
        for obj in reader:
            yield RawItem(str(path), start, dict(obj), 64 + sum(len(v or "") for v in obj.values()))
            start = reader.line_num + 1


def read_items(path: str | Path) -> Iterator[RawItem]:
    """Stream the raw records of one file.

    Raises:
        FileNotFoundError: the file does not exist. ValueError: unsupported type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    kind = file_kind(path)
    if kind.startswith("jsonl"):
        return _read_jsonl(path, kind)
    readers = {"json": _read_json_array, "parquet": _read_parquet, "csv": _read_csv}
    return readers[kind](path)


def decode_item(item: RawItem) -> Any:
    """The record's JSON value. Chat `messages` stored as a JSON string (CSV) are decoded too.

    Raises:
        ValueError: with the reason (not UTF-8, invalid JSON, empty line).
    """
    payload = item.payload
    if isinstance(payload, bytes):
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not valid UTF-8 (byte {e.start})") from e
        if not text.strip():
            raise ValueError("empty line")
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from e
    if isinstance(payload, dict) and isinstance(payload.get("messages"), str):
        try:
            payload = {**payload, "messages": json.loads(payload["messages"])}
        except json.JSONDecodeError as e:
            raise ValueError(f"field 'messages': invalid JSON: {e.msg}") from e
    return payload
