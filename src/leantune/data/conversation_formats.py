"""ShareGPT and TRL prompt/completion records, turned into chat messages.

ShareGPT, as LLaMA-Factory documents it: `conversations`, a list of `{"from", "value"}` turns
(`{"role", "content"}` is read too) with `from` one of human/gpt/system (user/assistant also),
and an optional `system` field. Tool turns, `tools`, multimodal fields and preference pairs are
refused with the reason.

TRL's prompt/completion: `prompt` and `completion`, each a string or a list of messages. Only the
completion is supervised: an assistant message inside the prompt is context, as in TRL.
"""

from __future__ import annotations

from typing import Any

from leantune.data.record_checks import (
    UNWEIGHTED,
    BadRecordError,
    Message,
    check_text,
    describe,
    is_empty_answer,
    parse_messages,
    parse_weight,
    refuse_unsupported,
    with_system_prompt,
)

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
TOOL_ROLES = ("function_call", "observation", "function", "tool")


def _turn(turn: Any, i: int) -> Message:
    """One ShareGPT turn as a message."""
    where = f"conversations[{i}]"
    if not isinstance(turn, dict):
        raise BadRecordError(f"{where} must be an object")
    # Parquet gives every turn every key a file uses, the missing ones as null.
    from_value = turn.get("from") is not None or turn.get("value") is not None
    role_key, content_key = ("from", "value") if from_value else ("role", "content")
    who = turn.get(role_key)
    # Refused, not skipped: training on a conversation with its tool turns removed would teach
    # answers without the results they were based on.
    if isinstance(who, str) and who in TOOL_ROLES:
        raise BadRecordError(
            f"{where}.{role_key}={who!r}: tool calls and tool results are not supported "
            "(leantune trains system, user and assistant turns); drop these turns or the record"
        )
    role = SHAREGPT_ROLES.get(who) if isinstance(who, str) else None
    if role is None:
        raise BadRecordError(
            f"{where}.{role_key} must be one of human/gpt/system (or user/assistant), "
            f"got {describe(who)}"
        )
    value = turn.get(content_key)
    if not isinstance(value, str):
        raise BadRecordError(f"{where}.{content_key} must be a string, got {describe(value)}")
    msg: Message = {"role": role, "content": check_text(value, f"{where}.{content_key}")}
    if parse_weight(turn.get("weight"), role, where) == UNWEIGHTED and role == "assistant":
        msg["weight"] = UNWEIGHTED
    return msg


def parse_sharegpt(obj: dict[str, Any], system_prompt: str | None) -> list[Message]:
    """`conversations` (+ optional `system`) -> system?/user/assistant messages."""
    refuse_unsupported(obj)
    turns = obj.get("conversations")
    if turns is None:
        raise BadRecordError("missing field 'conversations'")
    # CSV and some exports store the list as a JSON string; one that failed to parse is named
    # as such rather than as "not a list".
    if isinstance(turns, str):
        raise BadRecordError(
            "field 'conversations' must be a list of turns, got text that is not JSON"
        )
    if not isinstance(turns, list) or not turns:
        raise BadRecordError("field 'conversations' must be a non-empty list")
    out = [_turn(t, i) for i, t in enumerate(turns)]
    if out[-1]["role"] != "assistant":
        raise BadRecordError("the last turn must be from gpt (the answer to learn)")
    for i, msg in enumerate(out):
        if msg["role"] == "assistant" and not msg["content"].strip():
            raise BadRecordError(f"conversations[{i}].value: empty answer")
    system = obj.get("system")
    if system is None or system == "":
        return with_system_prompt(out, system_prompt)
    if not isinstance(system, str):
        raise BadRecordError(f"field 'system' must be a string, got {describe(system)}")
    if out[0]["role"] == "system":
        raise BadRecordError("both a 'system' field and a system turn: keep one of them")
    return [{"role": "system", "content": check_text(system, "field 'system'")}, *out]


def _side(obj: dict[str, Any], key: str, role: str) -> list[Message]:
    """`prompt` or `completion`: a string (one `role` message) or a list of messages."""
    if key not in obj:
        raise BadRecordError(f"missing field '{key}'")
    value = obj[key]
    # A string becomes one message and is rendered with the chat template like every
    # conversation, so `generate` (which applies the template) sees what was trained. TRL
    # tokenises its string form as plain text; for a plain continuation use data.format=text.
    if isinstance(value, str):
        if not value.strip():
            raise BadRecordError(f"field '{key}' is empty")
        return [{"role": role, "content": check_text(value, f"field '{key}'")}]
    if isinstance(value, list):
        return parse_messages(value, key)
    raise BadRecordError(
        f"field '{key}' must be a string or a list of messages, got {describe(value)}"
    )


def parse_prompt_completion(obj: dict[str, Any], system_prompt: str | None) -> dict[str, Any]:
    """`prompt` + `completion` -> `{"messages": ...}`, plus `supervise_from` (the index of the
    completion's first message) when the prompt holds an assistant message not to be learned."""
    refuse_unsupported(obj)
    # A boolean label is KTO data, which shares prompt/completion's fields: learning its
    # undesirable completions by SFT would teach exactly what the data says to avoid.
    if isinstance(obj.get("label"), bool):
        raise BadRecordError(
            "field 'label': unpaired preference data (label) is not supported: leantune does "
            "supervised fine-tuning, which learns every completion it is given"
        )
    prompt = _side(obj, "prompt", "user")
    completion = _side(obj, "completion", "assistant")
    for i, msg in enumerate(completion):
        if msg["role"] != "assistant":
            raise BadRecordError(
                f"completion[{i}].role must be assistant (the completion is what the model "
                f"learns to write), got {describe(msg['role'])}"
            )
        if is_empty_answer(msg):
            raise BadRecordError(f"completion[{i}].content: empty answer")
    messages = with_system_prompt([*prompt, *completion], system_prompt)
    start = len(messages) - len(completion)
    parsed: dict[str, Any] = {"messages": messages}
    # Without an assistant turn in the prompt every assistant turn is the completion's, and
    # the default (supervise all) says the same: the field is kept only when it matters.
    if any(m["role"] == "assistant" for m in messages[:start]):
        parsed["supervise_from"] = start
    return parsed
