"""Read training data in the alpaca, chat or text format, validating every record.

Every bad record is reported with its file, line number, field and reason; nothing is dropped
silently. Alpaca records are normalised to chat messages so one tokeniser path serves both.
Files are read by `leantune.data.prepare.readers` (JSONL, gzip/zstd JSONL, JSON arrays,
Parquet, CSV), the same readers `leantune prepare` uses.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.data.prepare.readers import DecodeError, RawItem, decode_item, read_items

FORMATS = ("alpaca", "chat", "text")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Record:
    """One valid example: chat `messages` (chat and alpaca) or `text` (text format)."""

    source: str
    line: int
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None


@dataclass(frozen=True)
class BadLine:
    """A rejected line: where it is and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class BadRecordError(ValueError):
    """A record fails validation; the message names the field."""


# A lone surrogate (JSON "\ud800", or bytes a CSV could not decode) is not text: no tokenizer
# or UTF-8 file takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: str, where: str) -> str:
    bad = _SURROGATE.search(value)
    if bad:
        raise BadRecordError(
            f"{where} is not valid Unicode (a lone surrogate U+{ord(bad.group()):04X})"
        )
    return value


def _describe(value: Any) -> str:
    """A short description of a wrong value for a message (never the whole of it)."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    return f"a {type(value).__name__}" if value is not None else "nothing"


def _require_str(obj: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    if key not in obj:
        raise BadRecordError(f"missing field '{key}'")
    value = obj[key]
    if not isinstance(value, str):
        raise BadRecordError(f"field '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRecordError(f"field '{key}' is empty")
    return _check_text(value, f"field '{key}'")


def parse_alpaca(obj: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]]:
    """`instruction`, optional `input`, `output` -> system?/user/assistant messages."""
    instruction = _require_str(obj, "instruction")
    extra = obj.get("input", "")
    if extra is None:
        extra = ""
    if not isinstance(extra, str):
        raise BadRecordError(f"field 'input' must be a string, got {type(extra).__name__}")
    _check_text(extra, "field 'input'")
    output = _require_str(obj, "output")
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def parse_chat(obj: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]]:
    """OpenAI-shaped `messages`; the last message must be a non-empty assistant answer."""
    messages = obj.get("messages")
    if messages is None:
        raise BadRecordError("missing field 'messages'")
    if not isinstance(messages, list) or not messages:
        raise BadRecordError("field 'messages' must be a non-empty list")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRecordError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise BadRecordError(
                f"messages[{i}].role must be one of {'/'.join(ROLES)}, got {_describe(role)}"
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise BadRecordError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": _check_text(content, f"messages[{i}].content")})
    if out[-1]["role"] != "assistant":
        raise BadRecordError("the last message must be from the assistant (the answer to learn)")
    for i, msg in enumerate(out):
        if msg["role"] == "assistant" and not msg["content"].strip():
            raise BadRecordError(f"messages[{i}].content: empty assistant answer")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def parse_record(obj: Any, fmt: str, system_prompt: str | None = None) -> dict[str, Any]:
    """Validate one decoded JSON value; returns `{"messages": ...}` or `{"text": ...}`.

    Raises:
        BadRecordError: naming the field and the problem.
    """
    if not isinstance(obj, dict):
        raise BadRecordError(f"expected a JSON object, got {type(obj).__name__}")
    if fmt == "text":
        return {"text": _require_str(obj, "text")}
    parsers: dict[str, Callable[[dict[str, Any], str | None], list[dict[str, str]]]] = {
        "alpaca": parse_alpaca,
        "chat": parse_chat,
    }
    return {"messages": parsers[fmt](obj, system_prompt)}


def _items(path: str | Path) -> Iterator[tuple[RawItem, Any]]:
    """(item, decoded value or DecodeError) for every record of a file; blank lines skipped."""
    with contextlib.closing(read_items(path)) as items:
        for item in items:
            try:
                yield item, decode_item(item)
            except DecodeError as e:
                if e.kind != "empty_line":
                    yield item, e


def read_records(
    path: str | Path, fmt: str, system_prompt: str | None = None
) -> tuple[list[Record], list[BadLine]]:
    """Read and validate a data file of any supported kind; every bad record is reported.

    Raises:
        ValueError: unknown format. FileNotFoundError: missing file. DataError: a file that
            cannot be read as its kind (a damaged archive, not Parquet, ...).
    """
    if fmt not in FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {' | '.join(FORMATS)}")
    records: list[Record] = []
    bad: list[BadLine] = []
    for item, obj in _items(path):
        if isinstance(obj, DecodeError):
            bad.append(BadLine(item.source, item.line, str(obj)))
            continue
        try:
            parsed = parse_record(obj, fmt, system_prompt)
        except BadRecordError as e:
            bad.append(BadLine(item.source, item.line, str(e)))
            continue
        messages = parsed.get("messages")
        records.append(
            Record(
                source=item.source,
                line=item.line,
                messages=tuple(messages) if messages is not None else None,
                text=parsed.get("text"),
            )
        )
    return records, bad


read_jsonl = read_records  # the name it had when only JSONL was read


def detect_format(path: str | Path) -> str:
    """The format of a data file from its first record: chat (`messages`), alpaca
    (`instruction`), else text."""
    for _, obj in _items(path):
        if isinstance(obj, dict):
            if "messages" in obj:
                return "chat"
            if "instruction" in obj:
                return "alpaca"
        break
    return "text"
