"""Where the assistant turns of a rendered conversation are, from one render of it.

The chat template is probed once per tokenizer with sentinel messages, which shows what it
writes before and after each role's content and what its generation prompt is (`ChatShape`).
A conversation is then rendered once and walked piece by piece against that shape; when every
piece matches, each message's place is known, and the spans are the ones the prefix method
(`spans_by_prefixes`) finds, in time linear in the conversation's length. When a piece does not
match (a template that rewrites content, or renders a message differently by what follows it),
the prefix method runs instead, but only on conversations of at most `PREFIX_LIMIT` messages:
it renders every prefix, so its cost grows with the square of the turns (2,000 turns took 32 s).

A span starts after the generation prompt and ends after the turn's closing text, so the model
also learns to stop. An assistant message that opens a conversation is supervised from its
content on: what a template writes before it (a default system prompt, role headers) is not
the record's text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leantune.data.errors import DataError

ROLES = ("system", "user", "assistant")
PREFIX_LIMIT = 128
# Sentinel contents: no template alters them (no spaces to trim, no markup) or writes them.
_A, _B = "Lt7probeAq", "Lt7probeBq"

Message = dict[str, str]
Span = tuple[int, int]
Render = Callable[[list[Message], bool], str]


class TemplateError(ValueError):
    """The chat template cannot render a conversation, or its answers cannot be located."""


class NoChatTemplateError(DataError):
    """Conversation data (every format but text), but the tokenizer has no chat template."""


def renderer(tokenizer: Any) -> Render:
    """`render(messages, add_generation_prompt)` with the tokenizer's chat template.

    Raises:
        NoChatTemplateError: the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise NoChatTemplateError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', '') or 'this model'} has no "
            "chat template, and conversations (every data.format but text) are rendered with "
            "it; give it one with data.chat_template=chatml (or zephyr, llama3, or a Jinja "
            "file; it is saved with the trained model; --chat-template for eval and generate), use "
            "a model with one (an instruct/chat model), or use data.format=text"
        )

    def render(messages: list[Message], gen: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
        except Exception as e:  # the template is code: raise_exception(), jinja and type errors
            raise TemplateError(f"the chat template refused the conversation: {e}") from e
        if not isinstance(text, str):
            raise TemplateError("the chat template did not render to a string")
        return text

    return render


@dataclass(frozen=True)
class ChatShape:
    """What a chat template writes around each role's content.

    `first[role]` and `later[role]` are the (before, after) text of a message that opens the
    conversation or follows another one; `prompt[role]` is the generation prompt the template
    adds after a conversation whose last message has that role. Roles the template refused in
    a probe are missing.
    """

    first: dict[str, tuple[str, str]] = field(default_factory=dict)
    later: dict[str, tuple[str, str]] = field(default_factory=dict)
    prompt: dict[str, str] = field(default_factory=dict)


def _msg(role: str, content: str) -> Message:
    return {"role": role, "content": content}


def _around(text: str | None, content: str) -> tuple[str, str] | None:
    """(before, after) `content` when it occurs exactly once in `text`."""
    if text is None:
        return None
    i = text.find(content)
    if i < 0 or text.find(content, i + 1) >= 0:
        return None
    return text[:i], text[i + len(content) :]


def probe_shape(render: Render) -> ChatShape:
    """Learn a template's shape from a few renders of sentinel conversations."""

    def attempt(messages: list[Message], gen: bool) -> str | None:
        try:
            return render(messages, gen)
        except TemplateError:
            return None

    first: dict[str, tuple[str, str]] = {}
    later: dict[str, tuple[str, str]] = {}
    prompt: dict[str, str] = {}
    for role in ROLES:
        piece = _around(attempt([_msg(role, _A)], False), _A)
        if piece is not None:
            first[role] = piece
    base = attempt([_msg("user", _A)], False)
    for role in ROLES:
        two = attempt([_msg("user", _A), _msg(role, _B)], False)
        if base is not None and two is not None and two.startswith(base):
            piece = _around(two[len(base) :], _B)
            if piece is not None:
                later[role] = piece
    for conv in (
        [_msg("system", _A)],
        [_msg("user", _A)],
        [_msg("user", _A), _msg("assistant", _B)],
    ):
        plain, gen = attempt(conv, False), attempt(conv, True)
        if plain is not None and gen is not None and gen.startswith(plain):
            prompt[conv[-1]["role"]] = gen[len(plain) :]
    return ChatShape(first, later, prompt)


_SHAPES: dict[tuple[str, str], ChatShape] = {}


def chat_shape(tokenizer: Any) -> ChatShape:
    """The shape of the tokenizer's chat template, probed once per (template, special tokens)."""
    key = (repr(tokenizer.chat_template), repr(sorted(tokenizer.special_tokens_map.items())))
    shape = _SHAPES.get(key)
    if shape is None:
        shape = _SHAPES[key] = probe_shape(renderer(tokenizer))
    return shape


def spans_by_shape(shape: ChatShape, messages: list[Message], full: str) -> list[Span] | None:
    """The assistant spans of `full`, walking it once; None where it does not match `shape`."""
    pos = 0
    spans: list[Span] = []
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg["content"]
        piece = (shape.first if i == 0 else shape.later).get(role)
        if piece is None:
            return None
        before, after = piece
        start = pos
        if not full.startswith(before, pos):
            return None
        pos += len(before)
        if not full.startswith(content, pos):
            return None
        pos += len(content)
        if not full.startswith(after, pos):
            return None
        pos += len(after)
        if role != "assistant":
            continue
        if i == 0:  # nothing the template wrote before the record's first message
            spans.append((start + len(before), pos))
            continue
        header = shape.prompt.get(messages[i - 1]["role"])
        if header is None or len(header) > len(before) or not full.startswith(header, start):
            return None
        spans.append((start + len(header), pos))
    return spans if pos == len(full) else None


def spans_by_prefixes(render: Render, messages: list[Message], full: str) -> list[Span]:
    """The exact method for any template: render the prefix before and through each answer.

    Raises:
        TemplateError: the template renders a prefix differently from the whole conversation.
    """
    spans: list[Span] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            start = _opening_answer_start(render, full)
        else:
            before = render(messages[:i], True)
            if not full.startswith(before):
                raise TemplateError(_UNSTABLE)
            start = len(before)
        last = i == len(messages) - 1  # the whole conversation is already rendered
        through = full if last else render(messages[: i + 1], False)
        if not full.startswith(through):
            raise TemplateError(_UNSTABLE)
        spans.append((start, len(through)))
    return spans


_UNSTABLE = (
    "the chat template renders a conversation differently from its prefixes; "
    "answer tokens cannot be located"
)


def _opening_answer_start(render: Render, full: str) -> int:
    """Where the content of an assistant message that opens the conversation starts."""
    probe = render([_msg("assistant", _A)], False)
    i = probe.find(_A)
    if i < 0 or not full.startswith(probe[:i]):
        raise TemplateError("the chat template hides where the opening assistant message starts")
    return i


def answer_spans(
    tokenizer: Any, messages: list[Message], full: str, supervise_from: int = 0
) -> list[Span]:
    """The character spans of the assistant turns in `full`, the rendered `messages`, from
    message `supervise_from` on (the ones before it are context, not learned).

    Raises:
        TemplateError: the answers cannot be located (see the module docstring).
    """
    spans = spans_by_shape(chat_shape(tokenizer), messages, full)
    if spans is None:
        if len(messages) > PREFIX_LIMIT:
            raise TemplateError(
                f"the chat template does not write these {len(messages)} messages verbatim and "
                f"in order, and locating the answers of such a template renders every prefix: "
                f"it is limited to {PREFIX_LIMIT} messages"
            )
        spans = spans_by_prefixes(renderer(tokenizer), messages, full)
    if supervise_from <= 0:
        return spans
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [s for i, s in zip(answers, spans, strict=True) if i >= supervise_from]
