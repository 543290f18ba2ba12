"""A variable-length chat corpus for throughput benchmarks: 1-4 turns, a realistic spread.

Conversations are built from templated English sentences with a seeded RNG, sized by the
tokenizer to a target drawn log-uniformly between `min_tokens` and `max_tokens`.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

TOPICS = ("a billing error", "a late delivery", "a broken charger", "a password reset",
          "an upgrade", "a refund", "a missing invoice", "a slow laptop", "a data export",
          "an account merge", "a shipping address", "a warranty claim")  # fmt: skip
OPENERS = ("Could you help me with", "I have a question about", "Please explain",
           "What should I do about", "Can you walk me through")  # fmt: skip
VERBS = ("check", "confirm", "update", "review", "reset", "compare", "schedule", "record")
NOUNS = ("the order", "your account", "the invoice", "the settings", "the device", "the log",
         "the request", "the backup", "the ticket", "the payment")  # fmt: skip
TAILS = ("before the end of the day", "in the next step", "so nothing is lost",
         "as the policy says", "once the team replies", "to be safe")  # fmt: skip


def _sentence(rng: random.Random) -> str:
    return (
        f"First we {rng.choice(VERBS)} {rng.choice(NOUNS)}, then we {rng.choice(VERBS)} "
        f"{rng.choice(NOUNS)} {rng.choice(TAILS)}."
    )


def _answer(rng: random.Random, tokenizer: PreTrainedTokenizerBase, tokens: int) -> str:
    parts: list[str] = []
    # Sized by this tokenizer, so that the target is in the model's own tokens.
    while len(tokenizer(" ".join(parts))["input_ids"]) < tokens:
        parts.append(_sentence(rng))
    return " ".join(parts)


def conversation(
    rng: random.Random, tokenizer: PreTrainedTokenizerBase, min_tokens: int, max_tokens: int
) -> dict[str, Any]:
    """One chat record: 1-4 user/assistant turns whose answers add up to about a target
    length drawn log-uniformly from [min_tokens, max_tokens]."""
    # Log-uniform, so that short and long examples are both common, as in real SFT data,
    # where padding each batch to its longest example wastes most of the compute.
    target = math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))
    turns = rng.randint(1, 4)
    messages: list[dict[str, str]] = []
    for _ in range(turns):
        question = f"{rng.choice(OPENERS)} {rng.choice(TOPICS)}?"
        messages.append({"role": "user", "content": question})
        answer_tokens = max(4, int(target / turns) - 12)  # ~12 tokens of question and markup
        messages.append({"role": "assistant", "content": _answer(rng, tokenizer, answer_tokens)})
    return {"messages": messages}


def write_corpus(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    seed: int,
    min_tokens: int = 40,
    max_tokens: int = 1200,
) -> Path:
    """Write `count` conversations as chat JSONL."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            record = conversation(rng, tokenizer, min_tokens, max_tokens)
            f.write(json.dumps(record) + "\n")
    return path
