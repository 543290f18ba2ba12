"""Where the assistant turns of a rendered conversation are, from one render of it.

A template that marks the assistant's text with `{% generation %}` says itself where that text
is (transformers' assistant-mask renderer); any other template's render is walked once, in
order. What a template writes around an answer (its header and end of turn) is learned once per
template from renders of sentinel conversations (`TemplateFacts`).

A span covers what the model writes after the generation prompt: the answer's text and the end
of turn; nothing else the template writes (headers, default system prompts, date lines, the
empty think block Qwen3 writes before a final answer).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from transformers.utils.chat_template_utils import render_jinja_template

from leantune.data.errors import DataError
from leantune.data.record_checks import UNWEIGHTED, Message
from leantune.errors import UserError

log = logging.getLogger(__name__)

SYSTEM_POLICIES = ("auto", "keep", "fold", "drop")
"""data.system_message: what happens to system messages before the template renders them."""

# Sentinel contents: no template alters them (no spaces to trim, no markup) or writes them.
_A, _B, _S = "Lt7probeAq", "Lt7probeBq", "Lt7probeSq"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")

Span = tuple[int, int]
Render = Callable[..., str]
"""`render(messages, add_generation_prompt, tools=None)`."""


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

    def render(messages: list[Message], gen: bool, tools: list[Any] | None = None) -> str:
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen
            )
        except Exception as e:  # the template is code: raise_exception(), jinja and type errors
            raise TemplateError(f"the chat template refused the conversation: {e}") from e
        if not isinstance(text, str):
            raise TemplateError("the chat template did not render to a string")
        for tool in tools or ():
            if tool["function"]["name"] not in text:
                raise TemplateError(
                    "field 'tools': the chat template does not write tool descriptions (the "
                    "model's template has no tool support)"
                )
        return text

    return render


SystemHandling = Literal["kept", "dropped", "refused"]


@dataclass(frozen=True)
class TemplateFacts:
    """What a chat template writes around the messages, learned from sentinel renders."""

    headers: tuple[str, ...]
    """The generation prompts it writes before an answer (after a user or an assistant
    message); empty for a template without one (Mistral's)."""
    end_of_turn: str
    """What it writes right after an answer's text, up to the next message."""
    system: SystemHandling
    """Whether a system message's text appears in the render, or the template drops or
    refuses it."""
    generation_tags: bool
    """It marks the assistant's text with {% generation %}."""


def _msg(role: str, content: str) -> Message:
    return {"role": role, "content": content}


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _token_floor(tokenizer: Any, text: str, n: int) -> int:
    """The last token boundary of `text` at or before character `n`."""
    # Headers and ends of turn are cut here so a span never starts or ends inside a token:
    # the character prefix two renders share can stop mid-token.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return max([0, *(end for _, end in enc["offset_mapping"] if end <= n)])


def _attempt(render: Render, messages: list[Message], gen: bool) -> str | None:
    try:
        return render(messages, gen)
    except TemplateError:
        return None


def probe_facts(tokenizer: Any) -> TemplateFacts:
    """Learn a template's headers, end of turn and system handling from sentinel renders."""
    render = renderer(tokenizer)
    headers: list[str] = []
    # A generation prompt can follow a user or an assistant message: both are probed, and a
    # conversation the template refuses is skipped.
    for conv in ([_msg("user", _A)], [_msg("user", _A), _msg("assistant", _B)]):
        plain, gen = _attempt(render, conv, False), _attempt(render, conv, True)
        if plain is None or gen is None:
            continue
        # Phi-3 ends an unprompted conversation with EOS: the prompt starts where they differ.
        cut = _token_floor(tokenizer, gen, _common_prefix(plain, gen))
        if gen[cut:] and gen[cut:] not in headers:
            headers.append(gen[cut:])
    # The end of turn is what follows the answer both when it is the last message and when
    # another follows: their common prefix, so the next turn's header is not included.
    end_of_turn = ""
    last = _attempt(render, [_msg("user", _A), _msg("assistant", _B)], False)
    more = _attempt(render, [_msg("user", _A), _msg("assistant", _B), _msg("user", _S)], False)
    if last is not None and more is not None and _B in last and _B in more:
        after, after_more = last[last.index(_B) + len(_B) :], more[more.index(_B) + len(_B) :]
        end_of_turn = after[: _token_floor(tokenizer, after, _common_prefix(after, after_more))]
    with_system = _attempt(
        render, [_msg("system", _S), _msg("user", _A), _msg("assistant", _B)], False
    )
    system: SystemHandling = (
        "refused" if with_system is None else "kept" if _S in with_system else "dropped"
    )
    tagged = bool(_GENERATION_TAG.search(str(tokenizer.chat_template)))
    return TemplateFacts(tuple(headers), end_of_turn, system, tagged)


_FACTS: dict[tuple[str, str], TemplateFacts] = {}


def template_facts(tokenizer: Any) -> TemplateFacts:
    """The facts of the tokenizer's chat template, probed once per (template, special tokens)."""
    # The special tokens are part of the key: templates render bos_token/eos_token, so one
    # template text gives different facts with another tokenizer's tokens.
    key = (repr(tokenizer.chat_template), repr(sorted(tokenizer.special_tokens_map.items())))
    facts = _FACTS.get(key)
    if facts is None:
        facts = _FACTS[key] = probe_facts(tokenizer)
    return facts


# --- system messages --------------------------------------------------------------------------

# (model, handling) pairs already warned about: the warning would otherwise repeat per record.
_SAID: set[tuple[str, str]] = set()


def resolve_system_policy(facts: TemplateFacts, policy: str, name: str = "") -> str:
    """data.system_message as it applies to this template: `auto` keeps system messages where
    the template writes them and folds them into the next user turn where it refuses or drops
    them (as Gemma's and Mistral's own documentation does), said once in the log."""
    if policy != "auto":
        return policy
    if facts.system == "kept":
        return "keep"
    said = (name, facts.system)
    if said not in _SAID:
        _SAID.add(said)
        log.warning(
            "the chat template of %s %s a system message: each one is folded into the next user "
            "turn (data.system_message=fold; keep or drop to choose otherwise)",
            name or "this model",
            "refuses" if facts.system == "refused" else "leaves out",
        )
    return "fold"


def apply_system_policy(
    messages: list[Message], policy: str, supervise_from: int = 0
) -> tuple[list[Message], int]:
    """`messages` with their system messages kept, folded into the next user message (its text
    first, then a blank line) or dropped; and `supervise_from` moved with the messages.

    Raises:
        TemplateError: fold, and a system message that no user message follows.
    """
    if policy == "keep" or not any(m["role"] == "system" for m in messages):
        return messages, supervise_from
    out: list[Message] = []
    pending: list[str] = []
    shift = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "system":
            if pending and msg["role"] == "user":
                msg = {**msg, "content": "\n\n".join([*pending, msg["content"]])}
                pending = []
            out.append(msg)
            continue
        # An empty system message folds to nothing, not to a stray blank line.
        if policy == "fold" and msg["content"].strip():
            pending.append(msg["content"])
        # Removed messages before supervise_from shift it so it still names the same message.
        if i < supervise_from:
            shift += 1
    if pending:
        raise TemplateError(
            "a system message with no user message after it cannot be folded into one "
            "(data.system_message=fold)"
        )
    return out, max(supervise_from - shift, 0)


def for_template(
    tokenizer: Any, messages: list[Message], policy: str = "auto", supervise_from: int = 0
) -> tuple[list[Message], int]:
    """The messages as the tokenizer's template is given them under data.system_message=`policy`
    (see `apply_system_policy`), and `supervise_from` moved with them."""
    if not any(m["role"] == "system" for m in messages):
        return messages, supervise_from
    name = str(getattr(tokenizer, "name_or_path", ""))
    resolved = resolve_system_policy(template_facts(tokenizer), policy, name)
    return apply_system_policy(messages, resolved, supervise_from)


class ConversationRefused(UserError):
    """The chat template refuses a conversation given to `generate` or `export` (a data record
    it refuses is dropped and counted instead, as the data path does with every bad record)."""


def render_conversation(
    tokenizer: Any,
    messages: list[Message],
    *,
    add_generation_prompt: bool = False,
    policy: str = "auto",
    template: str | None = None,
    where: str = "",
) -> str:
    """`messages` rendered with the tokenizer's chat template under data.system_message=`policy`.

    Args:
        template: how to name the template (--chat-template's value); default: the model's.
        where: what the conversation is, to start the message with (`--data FILE:LINE: `).

    Raises:
        NoChatTemplateError: the tokenizer has none.
        ConversationRefused: the template refuses it: names the template, the first message
            (number and role) it refuses and the template's own words.
    """
    render = renderer(tokenizer)
    try:
        conversation, _ = for_template(tokenizer, messages, policy)
        return render(conversation, add_generation_prompt)
    except TemplateError as e:
        name = template or f"of {getattr(tokenizer, 'name_or_path', '') or 'this model'}"
        # The Jinja error (the template's raise_exception text) is the useful part, not the
        # TemplateError wrapping it; whitespace is collapsed to keep it on one line.
        cause = e.__cause__ or e
        raise ConversationRefused(
            f"{where}the chat template {name} refuses {_refused_at(render, messages)}the "
            f"conversation: {' '.join(str(cause).split())}{_system_hint(render, messages)}"
        ) from None


def _refused_at(render: Render, messages: list[Message]) -> str:
    """`message N (role) of ` for the first message whose conversation so far the template
    refuses; "" when each part renders and only the whole does not."""
    for i, msg in enumerate(messages):
        if _attempt(render, messages[: i + 1], False) is None:
            return f"message {i + 1} ({msg.get('role')}) of "
    return ""


def _system_hint(render: Render, messages: list[Message]) -> str:
    """The way out when the template takes no system turn (Gemma's)."""
    if not any(m.get("role") == "system" for m in messages):
        return ""
    if _attempt(render, [_msg("system", _S), _msg("user", _A)], False) is not None:
        return ""
    return (
        "; the template takes no system turn: fold it into the next user turn with "
        "data.system_message=fold (the default, auto, does so), or leave it out"
    )


# --- locating the answers ---------------------------------------------------------------------


def _own_text(msg: Message) -> str:
    """The part of a message's text every template writes verbatim (trimmed): for an answer
    that holds its reasoning in `<think>...</think>`, what follows it."""
    content: str = msg["content"]
    # Templates such as Qwen3's drop or rewrite earlier turns' reasoning, so only the text
    # after </think> is certain to appear verbatim.
    if msg["role"] == "assistant" and "</think>" in content:
        content = content.split("</think>")[-1]
    return content.strip()


def _writes_markup(msg: Message) -> bool:
    """The model writes more than the answer's text in this turn: reasoning or tool calls."""
    return bool(msg.get("reasoning_content") or msg.get("tool_calls")) or "</think>" in str(
        msg["content"]
    )


def _after_header(facts: TemplateFacts, full: str, cursor: int) -> int:
    """Where the nearest answer header after `cursor` ends; `cursor` when there is none."""
    found = [(at, len(h)) for h in facts.headers if (at := full.find(h, cursor)) >= 0]
    if not found:
        return cursor
    at, n = min(found)  # the nearest header; on a tie at one place, the shorter one
    return at + n


def _answer_span(facts: TemplateFacts, msg: Message, i: int, full: str, cursor: int) -> Span:
    head = _after_header(facts, full, cursor)
    text = _own_text(msg)
    at = full.find(text, head) if text else head
    if at < 0:
        raise TemplateError(
            f"messages[{i}] (assistant): the chat template does not write its text as given, so "
            "its tokens cannot be located"
        )
    end = at + len(text)
    # The end of turn is part of the span, so the model also learns to stop.
    close = full.find(facts.end_of_turn, end) if facts.end_of_turn else end
    # Text between the answer and its end of turn means the template changed the answer; tool
    # calls are the exception, as templates write them after the text.
    between = full[end:close] if close >= 0 else ""
    if close < 0 or (between.strip() and not msg.get("tool_calls")):
        raise TemplateError(
            f"messages[{i}] (assistant): the chat template does not close it with "
            f"{facts.end_of_turn!r} right after its text"
        )
    for call in msg.get("tool_calls") or ():
        if call["function"]["name"] not in full[head:close]:
            raise TemplateError(
                f"messages[{i}].tool_calls: the chat template does not write tool calls (the "
                "model's template has no tool support)"
            )
    return _answer_start(facts, msg, full, head, at), close + len(facts.end_of_turn)


def _answer_start(facts: TemplateFacts, msg: Message, full: str, head: int, at: int) -> int:
    """Where the model's part of an answer starts: at or after the generation prompt (`head`)."""
    gap = full[head:at]
    # An answer with reasoning or tool calls (the model writes all of its markup after the
    # header), or one only whitespace separates from the header: learned from the header's end.
    if _writes_markup(msg) or not gap.strip():
        return head
    # A plain answer skips the markup the template writes itself (Qwen3's empty think block).
    # Without a generation prompt (Mistral ends the prompt at "[/INST]") the span keeps the
    # space before the answer, which the model has to write at inference.
    return at if facts.headers else at - (len(gap) - len(gap.rstrip()))


def spans_by_walk(facts: TemplateFacts, messages: list[Message], full: str) -> list[Span]:
    """The assistant spans of `full`, finding each message's text after the previous one's.

    Linear in the conversation's length; tolerates templates that trim text, drop earlier
    reasoning (Qwen3), move the system message (Mistral), add a default system prompt or date
    lines (Qwen2.5, SmolLM2, Llama 3.1) or end with an extra token (Phi-3).

    Raises:
        TemplateError: a user, tool or assistant message's text is not in the render, or an
            answer is not closed by the template's end of turn.
    """
    cursor = 0
    spans: list[Span] = []
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "assistant":
            span = _answer_span(facts, msg, i, full, cursor)
            spans.append(span)
            cursor = span[1]
        elif role != "system":  # templates move system text (Mistral: into the last user turn)
            text = _own_text(msg)
            at = full.find(text, cursor)
            if at < 0:
                raise TemplateError(
                    f"messages[{i}] ({role}): the chat template does not write it as given"
                    + (" (tool results are not supported by it)" if role == "tool" else "")
                )
            cursor = at + len(text)
    return spans


def spans_by_tags(tokenizer: Any, messages: list[Message], full: str) -> list[Span]:
    """The assistant spans a {% generation %} template marks, one per answer.

    Raises:
        TemplateError: the marked render differs from `full`, or marks another number of spans
            than there are answers.
    """
    # With return_assistant_tokens_mask it returns (renders, generation spans), not a str.
    result: Any = render_jinja_template(
        [messages],
        chat_template=tokenizer.chat_template,
        return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map,
    )
    rendered, indices = result
    # Only trusted when the tagged render is the very text tokenized (same template, same
    # special tokens) and marks one span per answer; anything else is refused, not guessed.
    spans = [(int(s), int(e)) for s, e in indices[0]]
    answers = sum(m["role"] == "assistant" for m in messages)
    if rendered[0] != full or len(spans) != answers:
        raise TemplateError(
            f"the chat template's {{% generation %}} blocks mark {len(spans)} spans for "
            f"{answers} assistant messages"
        )
    return spans


def answer_spans(
    tokenizer: Any, messages: list[Message], full: str, supervise_from: int = 0
) -> list[Span]:
    """The character spans of the learned assistant turns in `full`, the rendered `messages`.

    Learned: from message `supervise_from` on (the ones before it are context), and not those
    of `weight` 0 (`record_checks.UNWEIGHTED`).

    Raises:
        TemplateError: the answers cannot be located (see the module docstring).
    """
    facts = template_facts(tokenizer)
    if facts.generation_tags:
        spans = spans_by_tags(tokenizer, messages, full)
    else:
        spans = spans_by_walk(facts, messages, full)
    # Every answer is located and only then filtered: the walk's cursor moves past each one,
    # so the kept spans are where they would be without weights.
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [
        s
        for i, s in zip(answers, spans, strict=True)
        if i >= supervise_from and messages[i].get("weight") != UNWEIGHTED
    ]
