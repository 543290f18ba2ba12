"""Preference pairs for `leantune bench preference`, from the demo's support-desk conversations.

Each pair's prompt is a conversation's system and user messages, its chosen answer the correct
JSON ticket, its rejected answer a near miss: the same ticket with a wrong priority or a wrong
intent (the mistakes a support bot makes), so that the pair differs in one field's value only.
The training pairs come from the demo's training file, the held-out ones from its eval file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from leantune.core.writes import write_file
from leantune.demo.support_desk import INTENTS, PRIORITIES

DEMO_DATA = Path(__file__).resolve().parent.parent / "demo" / "data"
TRAIN_SOURCE = DEMO_DATA / "support_train.jsonl"
HELDOUT_SOURCE = DEMO_DATA / "support_eval.jsonl"


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` (a JSON ticket) with its priority or its intent replaced by another valid one."""
    ticket = json.loads(answer)
    field, choices = rng.choice((("priority", PRIORITIES), ("intent", INTENTS)))
    ticket[field] = rng.choice([c for c in choices if c != ticket[field]])
    # The demo's own formatting (json.dumps' defaults): the answers differ in one value only.
    return json.dumps(ticket)


def pair_of(record: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A TRL conversational pair from one support-desk conversation."""
    *prompt, answer = record["messages"]
    rejected = {"role": "assistant", "content": near_miss(answer["content"], rng)}
    return {"prompt": prompt, "chosen": [answer], "rejected": [rejected]}


def write_pairs(source: Path, out: Path, count: int, seed: int) -> Path:
    """The first `count` conversations of `source` as pairs in `out` (JSONL); seeded."""
    rng = random.Random(seed)
    lines = source.read_text().splitlines()[:count]
    if len(lines) < count:
        raise ValueError(f"{source} has {len(lines)} conversations; asked for {count}")
    write_file(out, "".join(json.dumps(pair_of(json.loads(x), rng)) + "\n" for x in lines))
    return out
