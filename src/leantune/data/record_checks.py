"""What every record parser checks: text fields, message lists, and the records leantune refuses.

Each check raises `BadRecordError` with a message that names the field; the reader turns it into
a bad line with the file and line number.
"""

from __future__ import annotations

import json
import re
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]
"""`role` and `content` (a string), and for assistant messages optionally `tool_calls` (OpenAI's
list of function calls, their arguments an object), `reasoning_content` and `weight` (present
only as 0: a turn not to learn); for tool results optionally `tool_call_id` and `name`."""

UNWEIGHTED = 0
"""The `weight` of an assistant turn that is rendered but not learned (OpenAI's fine-tuning
format and Axolotl's); 1, the default, learns it, and is not kept."""


class BadRecordError(ValueError):
    """A record fails validation; the message names the field."""


# A lone surrogate (JSON "\ud800", or bytes a CSV could not decode) is not text: no tokenizer
# or UTF-8 file takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: str, where: str) -> str:
    """`value`, unless it holds a lone surrogate."""
    bad = _SURROGATE.search(value)
    if bad:
        raise BadRecordError(
            f"{where} is not valid Unicode (a lone surrogate U+{ord(bad.group()):04X})"
        )
    return value


def describe(value: Any) -> str:
    """A short description of a wrong value for a message (never the whole of it)."""
    # Cut at 40 characters: a bad line's reason must stay one readable line in the report.
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    return f"a {type(value).__name__}" if value is not None else "nothing"


def require_str(obj: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    """The string field `key` of `obj` (non-blank unless `allow_empty`)."""
    if key not in obj:
        raise BadRecordError(f"missing field '{key}'")
    value = obj[key]
    if not isinstance(value, str):
        raise BadRecordError(f"field '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRecordError(f"field '{key}' is empty")
    return check_text(value, f"field '{key}'")


def parse_messages(value: Any, key: str) -> list[Message]:
    """An OpenAI-shaped message list, validated and normalised to `Message`s.

    Each object has a `role` in ROLES and a `content` that is a string or a list of
    `{"type": "text", "text": ...}` parts (joined into one string). Assistant messages may carry
    `tool_calls`, `reasoning_content` and a `weight` of 0 or 1; tool results a `tool_call_id`
    and `name`. Other fields are not kept.
    """
    if not isinstance(value, list) or not value:
        raise BadRecordError(f"field '{key}' must be a non-empty list")
    return [_message(msg, f"{key}[{i}]") for i, msg in enumerate(value)]


def _message(msg: Any, where: str) -> Message:
    if not isinstance(msg, dict):
        raise BadRecordError(f"{where} must be an object")
    # OpenAI's older form is read as the newer one: a `function` message is a tool result.
    role = "tool" if msg.get("role") == "function" else msg.get("role")
    if role not in ROLES:
        raise BadRecordError(
            f"{where}.role must be one of {'/'.join(ROLES)}, got {describe(msg.get('role'))}"
        )
    calls = _calls_of(msg, role, where)
    content = msg.get("content")
    # OpenAI writes null content beside tool calls; templates expect a string.
    if content is None and calls:
        content = ""
    parsed: Message = {"role": role, "content": _content(content, f"{where}.content")}
    if calls:
        parsed["tool_calls"] = calls
    extra = (("reasoning_content",) if role == "assistant" else ()) + (
        ("tool_call_id", "name") if role == "tool" else ()
    )
    for field in extra:
        if msg.get(field) is not None:
            parsed[field] = check_text(_string(msg[field], f"{where}.{field}"), where)
    # Only a 0 is kept: 1 is the default, and keeping it would make otherwise equal records
    # differ (dedup, the stored messages).
    if parse_weight(msg.get("weight"), role, where) == UNWEIGHTED and role == "assistant":
        parsed["weight"] = UNWEIGHTED
    return parsed


def _number(value: Any) -> str:
    """A short form of a value that should have been a number."""
    if isinstance(value, float):
        return f"{value:g}"
    # Huge ints are described, not printed: the message must stay short.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**9:
        return str(value)
    return describe(value)


def _calls_of(msg: dict[str, Any], role: str, where: str) -> list[dict[str, Any]] | None:
    """The message's tool calls, from `tool_calls` or OpenAI's older `function_call`."""
    legacy = msg.get("function_call")
    # Both forms at once would be ambiguous about which calls the model made.
    if legacy is not None and msg.get("tool_calls") not in (None, []):
        raise BadRecordError(f"{where}: both 'tool_calls' and 'function_call': keep one of them")
    value = (
        [{"type": "function", "function": legacy}] if legacy is not None else msg.get("tool_calls")
    )
    if role != "assistant":
        if value not in (None, []):
            field = "function_call" if legacy is not None else "tool_calls"
            raise BadRecordError(
                f"{where}.{field}: only an assistant message makes tool calls, not a {role} message"
            )
        return None
    return _tool_calls(value, where)


def parse_weight(value: Any, role: str, where: str) -> int:
    """A message's `weight`: 0 (rendered, not learned) or 1 (learned, the default for an
    assistant turn).

    Raises:
        BadRecordError: any other value, or 1 on a turn leantune never learns.
    """
    if value is None:
        return 1
    # Refused rather than rounded: a fractional or non-assistant weight would train differently
    # from what the record says. bool is excluded because True == 1 in Python.
    if isinstance(value, bool) or not isinstance(value, int | float) or value not in (0, 1):
        raise BadRecordError(
            f"{where}.weight: must be 0 (do not learn this turn) or 1 (learn it), "
            f"got {_number(value)}"
        )
    if value == 1 and role != "assistant":
        raise BadRecordError(
            f"{where}.weight: 1 on a {role} message, but only assistant turns are learned; "
            "drop the weight"
        )
    return int(value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRecordError(f"{where} must be a string, got {describe(value)}")
    return value


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts joined (as OpenAI reads them)."""
    if isinstance(value, str):
        return check_text(value, where)
    if not isinstance(value, list):
        raise BadRecordError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRecordError(
                f'{where}[{j}] must be a text part {{"type": "text", "text": ...}}, got '
                f"{describe(kind) if kind else describe(part)} (images and audio are not supported)"
            )
        texts.append(check_text(part["text"], f"{where}[{j}].text"))
    return "".join(texts)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI tool calls: `[{"type": "function", "function": {"name", "arguments"}}]`, the
    arguments a JSON object or a string of one; None when there are none."""
    if value in (None, []):
        return None
    if not isinstance(value, list):
        raise BadRecordError(f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise BadRecordError(
                f'{where}.tool_calls[{j}] must be {{"type": "function", "function": '
                f'{{"name": ..., "arguments": ...}}}}'
            )
        assert isinstance(fn, dict)
        kept = {"name": name, "arguments": _arguments(fn.get("arguments", {}), where, j)}
        calls.append({"type": "function", "function": kept, **_call_id(call)})
    return calls


def _arguments(value: Any, where: str, j: int) -> dict[str, Any]:
    """A call's arguments as an object (OpenAI writes them as a JSON string)."""
    field = f"{where}.tool_calls[{j}].function.arguments"
    # Parsed, because chat templates expect the object: Qwen2.5's and Llama 3.1's pass it
    # through `tojson`, which would write a string JSON-escaped and teach the model to call
    # with a string.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise BadRecordError(f"{field}: a string that is not JSON") from None
    if not isinstance(value, dict):
        raise BadRecordError(f"{field} must be a JSON object (or a string of one)")
    return value


def _call_id(call: dict[str, Any]) -> dict[str, str]:
    return {"id": call["id"]} if isinstance(call.get("id"), str) else {}


def parse_tools(value: Any, functions: Any = None) -> list[dict[str, Any]] | None:
    """A chat record's `tools`: OpenAI function descriptions (`{"type": "function",
    "function": {"name", "description", "parameters"}}`), which the chat template writes
    where the model reads them; or OpenAI's older `functions` (the inner descriptions), read
    as tools. None when there are none."""
    if functions not in (None, []):
        if value not in (None, []):
            raise BadRecordError("both 'tools' and 'functions': keep one of them")
        if not isinstance(functions, list):
            raise BadRecordError("field 'functions' must be a list of function descriptions")
        for j, fn in enumerate(functions):
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadRecordError(f'functions[{j}] must be {{"name": ..., "parameters": ...}}')
        return [{"type": "function", "function": fn} for fn in functions]
    if value in (None, []):
        return None
    if not isinstance(value, list):
        raise BadRecordError("field 'tools' must be a list of function descriptions")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecordError(
                f'tools[{j}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": ...}}}}'
            )
    return value


def is_empty_answer(msg: Message) -> bool:
    """An assistant message with neither text nor tool calls: nothing to learn."""
    return msg["role"] == "assistant" and not msg["content"].strip() and not msg.get("tool_calls")


def with_system_prompt(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """`messages` opened by `system_prompt` when given and they have no system message first."""
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


# Fields of records made for something else than supervised fine-tuning on text: each is refused
# with the reason, rather than trained on without what the field says (an image the model never
# sees, a tool list it is never shown, a rejected answer learned as if it were good).
_REFUSED = {
    "chosen": "preference data (chosen/rejected) is not supported: leantune does supervised "
    "fine-tuning, which learns every answer it is given",
    "rejected": "preference data (chosen/rejected) is not supported: leantune does supervised "
    "fine-tuning, which learns every answer it is given",
    "images": "images, videos and audio are not supported (leantune trains text-only models)",
    "videos": "images, videos and audio are not supported (leantune trains text-only models)",
    "audios": "images, videos and audio are not supported (leantune trains text-only models)",
    "tools": "tool descriptions are not supported in this format (the chat format takes them: "
    "'tools' beside 'messages')",
    "functions": "tool descriptions are not supported in this format (the chat format takes "
    "them: 'tools' or 'functions' beside 'messages')",
}
UNSUPPORTED = "not supported"
"""Every refusal's reason says this, so a reader can count them as their own kind."""


def refuse_unsupported(obj: dict[str, Any]) -> None:
    """Refuse a record with a non-empty field of `_REFUSED` (preference pairs, media, tools)."""
    # Empty values ("[]" included, as CSV writes an empty list) are what exports leave in
    # unused columns: they carry nothing to refuse.
    for key, reason in _REFUSED.items():
        if obj.get(key) not in (None, "", "[]", [], {}):
            raise BadRecordError(f"field '{key}': {reason}")
