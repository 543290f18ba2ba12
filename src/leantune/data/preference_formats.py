"""Read preference data in TRL's formats: pairs (`data.format=preference`) and unpaired
examples (`data.format=kto`).

A pair is a prompt and two answers to it, the better (`chosen`) and the worse (`rejected`), in
one of TRL's three forms, detected per record:

- standard: `{"prompt": str, "chosen": str, "rejected": str}` (the prompt one user message,
  each answer one assistant message);
- conversational: `prompt` a list of messages, `chosen` and `rejected` lists of messages that
  start with the assistant's answer;
- implicit prompt: only `chosen` and `rejected`, two whole conversations; the prompt is their
  longest common prefix of messages, and each answer what follows it.

An unpaired example (KTO) is `{"prompt", "completion", "label"}`: a prompt, one answer (a string
or a list of messages) and whether that answer is desirable (`true`) or not (`false`).

Every record is rendered with the chat template like an SFT conversation (a string prompt is a
user message). Every bad record is a `BadLine` with its file, line and reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from leantune.data.formats import BadLine
from leantune.data.prepare.readers import DecodeError, RawItem, decoded_items
from leantune.data.record_checks import (
    BadRecordError,
    Message,
    check_text,
    describe,
    is_empty_answer,
    parse_messages,
    refuse_unsupported,
    with_system_prompt,
)

__all__ = [
    "PREFERENCE_FORMATS",
    "PairKind",
    "PreferenceRecord",
    "UnpairedRecord",
    "detect_preference_format",
    "parse_pair",
    "parse_unpaired",
    "read_pairs",
    "read_unpaired",
]

PREFERENCE_FORMATS = ("preference", "kto")
"""The data.format values of preference data (beside the SFT formats of `formats.FORMATS`)."""

PairKind = Literal["standard", "conversational", "implicit"]
KIND_LABELS: dict[str, str] = {
    "standard": "TRL standard preference pairs (prompt, chosen, rejected strings)",
    "conversational": "TRL conversational preference pairs (prompt, chosen, rejected messages)",
    "implicit": "TRL implicit-prompt preference pairs (chosen, rejected conversations)",
    "kto": "TRL unpaired preference examples (prompt, completion, label)",
}


@dataclass(frozen=True)
class PreferenceRecord:
    """One valid pair: the shared prompt's messages and each answer's messages."""

    source: str
    line: int
    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...]
    kind: PairKind


@dataclass(frozen=True)
class UnpairedRecord:
    """One valid unpaired example (KTO): a prompt, an answer and whether it is desirable."""

    source: str
    line: int
    prompt: tuple[Message, ...]
    completion: tuple[Message, ...]
    label: bool


def _side(obj: dict[str, Any], key: str, role: str) -> list[Message]:
    """A field that is a string (one `role` message) or a list of messages."""
    if key not in obj or obj[key] is None:
        raise BadRecordError(f"missing field '{key}'")
    value = obj[key]
    # A string becomes one message, so it is rendered with the chat template like any
    # conversation: `generate`, which applies the template, then sees what was trained.
    if isinstance(value, str):
        if not value.strip():
            raise BadRecordError(f"field '{key}' is empty" + (" (empty answer)" * (role != "user")))
        return [{"role": role, "content": check_text(value, f"field '{key}'")}]
    if isinstance(value, list):
        return parse_messages(value, key)
    raise BadRecordError(
        f"field '{key}' must be a string or a list of messages, got {describe(value)}"
    )


def _check_answer(messages: list[Message], key: str) -> None:
    """An answer starts and ends with an assistant message, none of them empty."""
    if messages[0]["role"] != "assistant":
        raise BadRecordError(
            f"{key}[0].role must be assistant (the answer that follows the prompt), got "
            f"{describe(messages[0]['role'])}"
        )
    if messages[-1]["role"] != "assistant":
        raise BadRecordError(f"{key}: the last message must be from the assistant")
    for i, msg in enumerate(messages):
        if is_empty_answer(msg):
            raise BadRecordError(f"{key}[{i}].content: empty answer")


def _split_implicit(
    chosen: list[Message], rejected: list[Message]
) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen answer, rejected answer) of two conversations: the prompt is their longest
    common prefix of messages, as TRL's `maybe_extract_prompt` takes it."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    # No shared prefix: the answers would be compared without a common context.
    if n == 0:
        raise BadRecordError(
            "chosen and rejected share no prompt (their first messages differ): give 'prompt', "
            "or start both conversations with the same messages"
        )
    if n == len(chosen) == len(rejected):
        raise BadRecordError("chosen and rejected are identical: nothing to prefer")
    for key, side in (("chosen", chosen), ("rejected", rejected)):
        if n == len(side):
            raise BadRecordError(
                f"{key} has no message after the prompt it shares with the other answer "
                "(empty answer)"
            )
        # A divergence at a user turn means two different conversations, not two answers.
        if side[n]["role"] != "assistant":
            raise BadRecordError(
                f"chosen and rejected first differ at message {n}, a {side[n]['role']} message: "
                "they must be two answers (assistant messages) to the same prompt"
            )
    return chosen[:n], chosen[n:], rejected[n:]


def parse_pair(
    obj: Any, system_prompt: str | None = None
) -> tuple[list[Message], list[Message], list[Message], PairKind]:
    """Validate one decoded preference record: (prompt, chosen, rejected, its kind).

    Raises:
        BadRecordError: naming the field and the problem.
    """
    if not isinstance(obj, dict):
        raise BadRecordError(f"expected a JSON object, got {type(obj).__name__}")
    # chosen/rejected are what refuse_unsupported turns away from SFT data; here they are the
    # data, so only the other refusals (media, tools) apply.
    refuse_unsupported({k: v for k, v in obj.items() if k not in ("chosen", "rejected")})
    has_prompt = obj.get("prompt") is not None
    # Without a prompt, the prompt is the common prefix of two conversations; plain strings
    # have no message structure to take it from.
    if not has_prompt and (
        isinstance(obj.get("chosen"), str) or isinstance(obj.get("rejected"), str)
    ):
        raise BadRecordError(
            "missing field 'prompt': chosen and rejected as strings need one (leantune renders "
            "pairs with the chat template; without 'prompt', write both as conversations)"
        )
    chosen = _side(obj, "chosen", "assistant")
    rejected = _side(obj, "rejected", "assistant")
    kind: PairKind
    if has_prompt:
        prompt = _side(obj, "prompt", "user")
        strings = all(isinstance(obj[k], str) for k in ("prompt", "chosen", "rejected"))
        kind = "standard" if strings else "conversational"
    else:
        prompt, chosen, rejected = _split_implicit(chosen, rejected)
        kind = "implicit"
    _check_answer(chosen, "chosen")
    _check_answer(rejected, "rejected")
    # Identical answers give a zero margin: a pair with no preference in it.
    if chosen == rejected:
        raise BadRecordError("chosen and rejected are identical: nothing to prefer")
    return with_system_prompt(prompt, system_prompt), chosen, rejected, kind


def parse_unpaired(
    obj: Any, system_prompt: str | None = None
) -> tuple[list[Message], list[Message], bool]:
    """Validate one decoded KTO record: (prompt, completion, label).

    Raises:
        BadRecordError: naming the field and the problem.
    """
    if not isinstance(obj, dict):
        raise BadRecordError(f"expected a JSON object, got {type(obj).__name__}")
    refuse_unsupported(obj)
    if "label" not in obj:
        raise BadRecordError("missing field 'label' (true: a desirable completion, false: not)")
    label = obj["label"]
    # Strictly a JSON boolean: a number may be a rating, which is not a desirability label.
    if not isinstance(label, bool):
        raise BadRecordError(f"field 'label' must be true or false, got {describe(label)}")
    prompt = _side(obj, "prompt", "user")
    completion = _side(obj, "completion", "assistant")
    _check_answer(completion, "completion")
    return with_system_prompt(prompt, system_prompt), completion, label


Record = TypeVar("Record")


def _read(
    path: str | Path, parse: Callable[[RawItem, Any], Record]
) -> tuple[list[Record], list[BadLine]]:
    """Every record `parse` accepts, and a bad line for each it refuses or that is not JSON."""
    records: list[Record] = []
    bad: list[BadLine] = []
    for item, obj in decoded_items(path):
        try:
            # Raised so that an undecodable line and a refused record share one handler.
            if isinstance(obj, DecodeError):
                raise obj
            records.append(parse(item, obj))
        except (DecodeError, BadRecordError) as e:
            bad.append(BadLine(item.source, item.line, str(e)))
    return records, bad


def _say_kind(path: str | Path, kind: str, log: Callable[[str], None] | None) -> None:
    if log is not None:
        log(f"{path}: {KIND_LABELS[kind]}")


def read_pairs(
    path: str | Path, system_prompt: str | None = None, log: Callable[[str], None] | None = None
) -> tuple[list[PreferenceRecord], list[BadLine]]:
    """Read and validate a file of preference pairs (any of TRL's three forms, detected per
    record); the form of the first valid record is said once through `log`.

    Raises:
        FileNotFoundError: missing file. DataError: a file that cannot be read as its kind.
    """

    def pair(item: RawItem, obj: Any) -> PreferenceRecord:
        prompt, chosen, rejected, kind = parse_pair(obj, system_prompt)
        return PreferenceRecord(
            item.source, item.line, tuple(prompt), tuple(chosen), tuple(rejected), kind
        )

    records, bad = _read(path, pair)
    if records:
        _say_kind(path, records[0].kind, log)
    return records, bad


def read_unpaired(
    path: str | Path, system_prompt: str | None = None, log: Callable[[str], None] | None = None
) -> tuple[list[UnpairedRecord], list[BadLine]]:
    """Read and validate a file of unpaired (KTO) examples; said once through `log`.

    Raises:
        FileNotFoundError: missing file. DataError: a file that cannot be read as its kind.
    """

    def example(item: RawItem, obj: Any) -> UnpairedRecord:
        prompt, completion, label = parse_unpaired(obj, system_prompt)
        return UnpairedRecord(item.source, item.line, tuple(prompt), tuple(completion), label)

    records, bad = _read(path, example)
    if records:
        _say_kind(path, "kto", log)
    return records, bad


def detect_preference_format(path: str | Path) -> str | None:
    """`preference` when the first record of `path` has `chosen` and `rejected`, `kto` when it
    has `prompt`, `completion` and `label`; None for any other data (an SFT format)."""
    for _, obj in decoded_items(path):
        if isinstance(obj, dict):
            if "chosen" in obj and "rejected" in obj:
                return "preference"
            # label is what tells KTO data from SFT prompt_completion data.
            if all(k in obj for k in ("prompt", "completion", "label")):
                return "kto"
        break  # the first record only
    return None
