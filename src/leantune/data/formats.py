"""Read training data in the alpaca, chat, text, sharegpt or prompt_completion format.

Every record is validated, and every bad one is reported with its file, line number, field and
reason; nothing is dropped silently. Files are read by `leantune.data.prepare.readers` (JSONL,
gzip/zstd JSONL, JSON arrays, Parquet, CSV).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.data.conversation_formats import parse_prompt_completion, parse_sharegpt
from leantune.data.errors import DataError
from leantune.data.prepare.readers import (
    DecodeError,
    decoded_items,
)
from leantune.data.record_checks import (
    ROLES,
    BadRecordError,
    check_text,
    is_empty_answer,
    parse_messages,
    parse_tools,
    refuse_unsupported,
    require_str,
    with_system_prompt,
)

__all__ = [
    "FORMATS",
    "ROLES",
    "BadLine",
    "BadRecordError",
    "Record",
    "detect_format",
    "format_hint",
    "parse_record",
    "read_records",
]

FORMATS = ("alpaca", "chat", "text", "sharegpt", "prompt_completion")


@dataclass(frozen=True)
class Record:
    """One valid example: chat `messages` (every format but text) or `text` (text format)."""

    source: str
    line: int
    messages: tuple[dict[str, Any], ...] | None = None
    text: str | None = None
    supervise_from: int = 0
    """Index of the first message whose assistant turns are learned (prompt/completion: the
    completion's; 0 = every assistant turn)."""
    tools: tuple[dict[str, Any], ...] | None = None
    """Function descriptions the chat template writes for the model (chat format)."""


@dataclass(frozen=True)
class BadLine:
    """A rejected line: where it is and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def parse_alpaca(obj: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]]:
    """`instruction`, optional `input`, `output` -> system?/user/assistant messages.

    Also reads LLaMA-Factory's optional `system` (the system message) and `history` (earlier
    `[instruction, answer]` pairs, learned like the last answer, as LLaMA-Factory does).
    """
    # Alpaca is normalised to chat messages, so one tokeniser path serves every format.
    refuse_unsupported(obj)
    instruction = require_str(obj, "instruction")
    extra = obj.get("input", "")
    # Exported datasets often write a missing input as null.
    if extra is None:
        extra = ""
    if not isinstance(extra, str):
        raise BadRecordError(f"field 'input' must be a string, got {type(extra).__name__}")
    check_text(extra, "field 'input'")
    output = require_str(obj, "output")
    # Stanford Alpaca's prompt puts the input after the instruction, separated by a blank line.
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    system = obj.get("system")
    # The record's own system message takes precedence over data.system_prompt.
    if system not in (None, ""):
        system_prompt = require_str(obj, "system")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        *messages,
        *_alpaca_history(obj.get("history")),
        {"role": "user", "content": user},
        {"role": "assistant", "content": output},
    ]


def _alpaca_history(value: Any) -> list[dict[str, str]]:
    """LLaMA-Factory's `history`: `[[instruction, answer], ...]` before the record's own turn."""
    # "[]": CSV and some exports write an empty list as its JSON text.
    if value in (None, "", "[]", []):
        return []
    if not isinstance(value, list):
        raise BadRecordError("field 'history' must be a list of [instruction, answer] pairs")
    out = []
    for i, pair in enumerate(value):
        texts = pair if isinstance(pair, list | tuple) and len(pair) == 2 else None
        if texts is None or not all(isinstance(t, str) and t.strip() for t in texts):
            raise BadRecordError(
                f"history[{i}] must be a pair of non-empty strings [instruction, answer]"
            )
        out.append({"role": "user", "content": check_text(texts[0], f"history[{i}][0]")})
        out.append({"role": "assistant", "content": check_text(texts[1], f"history[{i}][1]")})
    return out


def parse_chat(obj: dict[str, Any], system_prompt: str | None) -> list[dict[str, Any]]:
    """OpenAI-shaped `messages`; the last message must be a non-empty assistant answer."""
    messages = obj.get("messages")
    if messages is None:
        raise BadRecordError("missing field 'messages'")
    out = parse_messages(messages, "messages")
    if out[-1]["role"] != "assistant":
        raise BadRecordError("the last message must be from the assistant (the answer to learn)")
    # An empty answer anywhere, not only the last: it would teach the model to stop at once.
    for i, msg in enumerate(out):
        if is_empty_answer(msg):
            raise BadRecordError(f"messages[{i}].content: empty assistant answer")
    return with_system_prompt(out, system_prompt)


def parse_record(obj: Any, fmt: str, system_prompt: str | None = None) -> dict[str, Any]:
    """Validate one decoded JSON value; returns `{"messages": ...}` (with `supervise_from` when
    not every assistant turn is learned) or `{"text": ...}`.

    Raises:
        BadRecordError: naming the field and the problem.
    """
    if not isinstance(obj, dict):
        raise BadRecordError(f"expected a JSON object, got {type(obj).__name__}")
    if fmt == "text":
        return {"text": require_str(obj, "text")}
    if fmt == "prompt_completion":
        return parse_prompt_completion(obj, system_prompt)
    parsers: dict[str, Callable[[dict[str, Any], str | None], list[dict[str, str]]]] = {
        "alpaca": parse_alpaca,
        "chat": parse_chat,
        "sharegpt": parse_sharegpt,
    }
    parsed: dict[str, Any] = {"messages": parsers[fmt](obj, system_prompt)}
    # Only chat records carry tools; the other formats refuse the field (refuse_unsupported).
    tools = parse_tools(obj.get("tools"), obj.get("functions")) if fmt == "chat" else None
    if tools:
        parsed["tools"] = tools
    return parsed


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
    for item, obj in decoded_items(path):
        # A line that is not JSON is a bad line like any other, not an error for the file.
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
                supervise_from=parsed.get("supervise_from", 0),
                tools=tuple(parsed["tools"]) if "tools" in parsed else None,
            )
        )
    return records, bad


read_jsonl = read_records  # an alias kept for callers of the JSONL-only name


# The fields that mark each format, in the order detection tries them: the most specific first
# (a chat record may also carry a "text" field, which only marks text when nothing else does).
SIGNATURES: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction",),
    "text": ("text",),
}
LABELS = {
    "chat": "chat (OpenAI messages)",
    "sharegpt": "ShareGPT",
    "prompt_completion": "TRL prompt/completion",
    "alpaca": "Alpaca",
    "text": "plain text",
}
HINT_SCAN = 1000
"""Records `format_hint` reads at most (the first ones of the file)."""


def formats_of(obj: dict[str, Any]) -> list[str]:
    """The formats whose fields `obj` has, in detection order."""
    return [f for f, keys in SIGNATURES.items() if all(k in obj for k in keys)]


def detect_format(path: str | Path) -> str:
    """The format of a data file from its first record (`messages`: chat, `conversations`:
    sharegpt, `prompt` + `completion`: prompt_completion, `instruction`: alpaca), else text."""
    for _, obj in decoded_items(path):
        if isinstance(obj, dict):
            found = formats_of(obj)
            if found:
                return found[0]
        break  # the first record only: detection must not read a large file
    return "text"


def format_hint(path: str | Path, fmt: str) -> str | None:
    """Which data.format to use, when most of the first records of `path` lack the fields of
    `fmt` and have those of another format; None otherwise (or when the file cannot be read)."""
    seen = 0
    other: Counter[str] = Counter()
    lacking: dict[str, str] = {}
    try:
        for _, obj in decoded_items(path):
            if seen >= HINT_SCAN:
                break
            seen += 1
            found = formats_of(obj) if isinstance(obj, dict) else []
            if found and fmt not in found:
                other[found[0]] += 1
                lacking.setdefault(found[0], next(k for k in SIGNATURES[fmt] if k not in obj))
    except (DataError, OSError):
        return None
    if not other:
        return None
    best, n = other.most_common(1)[0]
    # Only a majority earns a hint: a few stray records of another shape are just bad lines.
    if 2 * n <= seen:
        return None
    lacks, has = lacking[best], SIGNATURES[best][0]
    count = (
        f"every record lacks '{lacks}' but has '{has}'"
        if n == seen
        else f"{n} of the first {seen} records lack '{lacks}' but have '{has}'"
    )
    return f"{count}: this looks like {LABELS[best]}; use data.format={best}"
