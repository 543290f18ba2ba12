"""Exact-match evaluation: JSON answers compare as values, text answers modulo whitespace."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import replace

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantune.eval.generation import GREEDY, generate_texts, render_prompt
from leantune.eval.progress import ProgressCallback

# Models often wrap a JSON answer in a ```json fence; the fence is no part of the value.
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)
# A sentinel, not None: "null" parses to None, a valid JSON answer.
_NOT_JSON = object()


def _parse_json(text: str) -> object:
    """Parse `text` as JSON, or return `_NOT_JSON`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, or nesting too deep to parse
        return _NOT_JSON


def _strip_fence(text: str) -> str:
    text = text.strip()
    fenced = _FENCE.match(text)
    return fenced.group(1).strip() if fenced else text


def _json_equal(a: object, b: object) -> bool:
    # Python's == says True == 1 and {"x": true} == {"x": 1}; JSON booleans and numbers differ.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def answers_match(prediction: str, reference: str) -> bool:
    """Whether a predicted answer equals the reference answer.

    A reference that parses as JSON is compared as a value: the prediction (surrounding whitespace
    and a ```json fence allowed) must parse to an equal value, so key order and formatting do not
    matter, while `true` and `1` differ. Any other reference is compared as text after stripping
    both ends and collapsing internal whitespace runs to one space.

    Args:
        prediction: The model's answer.
        reference: The expected answer.

    Returns:
        True when they match.
    """
    expected = _parse_json(reference)
    if expected is not _NOT_JSON:
        predicted = _parse_json(_strip_fence(prediction))
        return predicted is not _NOT_JSON and _json_equal(predicted, expected)
    return " ".join(prediction.split()) == " ".join(reference.split())


def exact_match_score(predictions: list[str], references: list[str]) -> float:
    """Fraction of predictions that match their reference (see `answers_match`).

    Args:
        predictions: Model answers.
        references: Expected answers, one per prediction.

    Returns:
        A score in [0, 1]; 0.0 for empty lists.

    Raises:
        ValueError: If the lists differ in length.
    """
    # zip(strict=True) below would raise too, but without saying which list is short.
    if len(predictions) != len(references):
        raise ValueError(
            f"{len(predictions)} predictions but {len(references)} references; "
            "pass one prediction per reference"
        )
    if not references:
        return 0.0
    hits = sum(answers_match(p, r) for p, r in zip(predictions, references, strict=True))
    return hits / len(references)


# The margin over the longest reference: a correct answer may take more tokens than its reference
# (a ```json fence is about 5, other whitespace and key formatting more, and pretty-printed JSON
# grows with the answer's length: a newline and indent per item). +16 covers the fixed part,
# +25% the part that grows; an answer longer than that is almost never a match.
ANSWER_MARGIN_TOKENS = 16
ANSWER_MARGIN_FRACTION = 0.25


def longest_answer_tokens(tokenizer: PreTrainedTokenizerBase, references: list[str]) -> int:
    """The token length of the longest reference answer (0 without references)."""
    lengths = tokenizer(references, add_special_tokens=False)["input_ids"] if references else []
    return max((len(ids) for ids in lengths), default=0)


def answer_token_cap(longest: int) -> int:
    """Most new tokens an exact-match answer needs when the longest reference has `longest`
    tokens: `longest` plus max(ANSWER_MARGIN_TOKENS, ANSWER_MARGIN_FRACTION of it)."""
    return longest + max(ANSWER_MARGIN_TOKENS, math.ceil(longest * ANSWER_MARGIN_FRACTION))


def reference_answer_cap(
    tokenizer: PreTrainedTokenizerBase, references: list[str], setting: str
) -> tuple[int, str]:
    """The `answer_token_cap` of the longest of `references`, and the line that says it
    (`setting`: what sets another cap)."""
    longest = longest_answer_tokens(tokenizer, references)
    cap = answer_token_cap(longest)
    return cap, (
        f"exact match: answers capped at {cap} new tokens (longest reference {longest} + "
        f"{cap - longest}); {setting} sets another cap"
    )


def evaluate_exact_match(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict[str, str]]],
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    on_progress: ProgressCallback | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[float, list[str]]:
    """Greedy-decode the last assistant turn of each conversation and score it by exact match.

    Args:
        model: A causal LM, plain or wrapped in a peft `PeftModel`.
        tokenizer: Its tokenizer, with a chat template.
        conversations: Chat message lists, each ending with the reference assistant message; the
            messages before it form the prompt.
        batch_size: Prompts per `generate` call.
        max_new_tokens: Most tokens generated per answer; None: the `answer_token_cap` of the
            longest reference (a model that never stops costs that many tokens, not hundreds).
        on_progress: Called as generation goes (see `generate_texts`).
        log: Told the cap when it comes from the references.

    Returns:
        The exact-match score in [0, 1] and the predictions, in the order of `conversations`.

    Raises:
        ValueError: If a conversation does not end with an assistant message.
    """
    prompts: list[str] = []
    references: list[str] = []
    for index, messages in enumerate(conversations):
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(
                f"conversation {index} must end with the reference assistant message, "
                f"but its last role is {messages[-1].get('role') if messages else None!r}"
            )
        prompts.append(render_prompt(tokenizer, messages[:-1]))
        references.append(messages[-1]["content"])
    if max_new_tokens is None:
        setting = "max_new_tokens (--max-new-tokens)"
        max_new_tokens, line = reference_answer_cap(tokenizer, references, setting)
        if log is not None:
            log(line)
    settings = replace(GREEDY, max_new_tokens=max_new_tokens)
    predictions = generate_texts(
        model, tokenizer, prompts, settings, batch_size=batch_size, on_progress=on_progress
    )
    return exact_match_score(predictions, references), predictions
