"""What every record parser checks: text fields, message lists, and the records leantune refuses.

Each check raises `BadRecordError` with a message that names the field; the reader turns it into
a bad line with the file and line number.
"""

from __future__ import annotations

import re
from typing import Any

ROLES = ("system", "user", "assistant")
Message = dict[str, str]


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
    """An OpenAI-shaped message list: objects with a `role` in ROLES and a string `content`."""
    if not isinstance(value, list) or not value:
        raise BadRecordError(f"field '{key}' must be a non-empty list")
    out: list[Message] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise BadRecordError(f"{key}[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise BadRecordError(
                f"{key}[{i}].role must be one of {'/'.join(ROLES)}, got {describe(role)}"
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise BadRecordError(f"{key}[{i}].content must be a string")
        out.append({"role": role, "content": check_text(content, f"{key}[{i}].content")})
    return out


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
    "tools": "tool descriptions are not supported (leantune trains system, user and assistant "
    "turns)",
}
UNSUPPORTED = "not supported"
"""Every refusal's reason says this, so a reader can count them as their own kind."""


def refuse_unsupported(obj: dict[str, Any]) -> None:
    """Refuse a record with a non-empty field of `_REFUSED` (preference pairs, media, tools)."""
    for key, reason in _REFUSED.items():
        if obj.get(key) not in (None, "", "[]", [], {}):
            raise BadRecordError(f"field '{key}': {reason}")
