"""Preference pairs for the DPO demo, from the support-desk task (`demo.support_desk`).

A pair's prompt is a conversation's system and user messages; its chosen answer is the correct
JSON ticket; its rejected answer is a near miss: the same ticket with one field wrong, the
priority or the intent (the mistakes a support bot makes), so the answers differ in one value.

- ``support_pairs_train.jsonl``: pairs on messages of their own stream, none of them in the SFT
  demo's train or eval files: the DPO stage learns from messages it has not seen.
- ``support_pairs_eval.jsonl``: one pair per message of ``support_eval.jsonl`` (held out from
  both training sets), for `leantune eval` (preference accuracy and margin).

Run ``python -m leantune.demo.support_pairs`` to regenerate the committed files (it reads the
committed support-desk files, so regenerate those first if they change). Deterministic.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leantune.demo.support_desk import INTENTS, PRIORITIES, generate, user_message, write_jsonl
from leantune.eval.exact_match import answers_match

DATA = Path(__file__).parent / "data"
# Priority errors are the demo model's commonest (a "not urgent" message read as urgent or
# normal), so most near misses are in the priority; the rest in the intent.
P_WRONG_PRIORITY = 0.6


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` (a JSON ticket) with its priority or its intent replaced by another valid one."""
    ticket = json.loads(answer)
    field, choices = (
        ("priority", PRIORITIES) if rng.random() < P_WRONG_PRIORITY else ("intent", INTENTS)
    )
    ticket[field] = rng.choice([c for c in choices if c != ticket[field]])
    # The demo's own formatting (json.dumps' defaults, keys kept in order): the two answers'
    # texts differ in that one value only.
    return json.dumps(ticket, ensure_ascii=False)


def pair_of(record: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A TRL conversational pair from one support-desk conversation (`make_example`'s form)."""
    *prompt, answer = record["messages"]
    rejected = {"role": "assistant", "content": near_miss(answer["content"], rng)}
    return {"prompt": prompt, "chosen": [answer], "rejected": [rejected]}


def make_pairs(records: Sequence[dict[str, Any]], seed: int, split: str) -> list[dict[str, Any]]:
    """One pair per record, the near misses drawn from a stream named by `seed` and `split`."""
    # A string seed is hashed with SHA-512: the same stream on every run and platform.
    rng = random.Random(f"support_pairs/{split}/{seed}")
    return [pair_of(r, rng) for r in records]


def overcorrection(answer: str) -> str:
    """`answer` with the mistake that unlearning the SFT model's usual ones leads to: a product
    it names dropped (null), else a normal priority read as low, else the priority read as
    normal. The two answers' texts differ in that one value only."""
    ticket = json.loads(answer)
    if ticket["product"] is not None:
        ticket["product"] = None
    else:
        ticket["priority"] = "low" if ticket["priority"] == "normal" else "normal"
    return json.dumps(ticket, ensure_ascii=False)


def on_policy_pairs(
    records: Sequence[dict[str, Any]], predictions: Sequence[str]
) -> list[dict[str, Any]]:
    """Pairs from a model's own answers (`predictions`: its greedy answer to each record).

    A wrong answer is rejected, as the model wrote it, against the correct ticket: the mistakes
    the model makes (on the demo's SFT model: a low-priority message answered ``normal``, a
    product named where the message has none), not drawn ones it may never make (on-policy
    pairs, as in TRL's online DPO, generated once). Those pairs alone all push one way
    (``null`` and ``low`` up everywhere: measured in docs/guides/preference.md), so a right
    answer gives a pair too, its `overcorrection` rejected.
    """
    pairs = []
    for record, prediction in zip(records, predictions, strict=True):
        *prompt, answer = record["messages"]
        # Scored as the held-out set is: a ticket equal as JSON is no mistake.
        if prediction.strip() and not answers_match(prediction, answer["content"]):
            rejected = prediction.strip()
        else:
            rejected = overcorrection(answer["content"])
        reject = {"role": "assistant", "content": rejected}
        pairs.append({"prompt": prompt, "chosen": [answer], "rejected": [reject]})
    return pairs


def priority_contrast_pairs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two pairs per support-desk conversation: its correct ticket against the same ticket with
    each other priority. Every priority is rejected where another is right as often as the
    data holds it, so the pairs agree on the cue in the message ("no rush", "urgent") and on no
    value by itself."""
    pairs = []
    for record in records:
        *prompt, answer = record["messages"]
        ticket = json.loads(answer["content"])
        for priority in PRIORITIES:
            if priority != ticket["priority"]:
                wrong = json.dumps(ticket | {"priority": priority}, ensure_ascii=False)
                pairs.append(_pair(prompt, answer, wrong))
    return pairs


def _value_class(field: str, value: Any) -> Any:
    """What a counter-pair matches on: a product's presence (named or null), else the value."""
    return (value is None) if field == "product" else value


def balanced_on_policy_pairs(
    records: Sequence[dict[str, Any]], predictions: Sequence[str]
) -> list[dict[str, Any]]:
    """Pairs from a model's own answers, its mistakes balanced by counter-pairs.

    Each wrong answer is rejected as the model wrote it against the correct ticket (as in
    `on_policy_pairs`). Each wrong value then gets a counter-pair from a message the model
    answered right whose correct value is of the kind the model wrote (for a ``low`` message
    answered ``normal``: a ``normal`` message; for an invented product: a message that names
    one), its rejected answer that ticket with the first message's correct value (``low``;
    ``null``). Every direction the mistakes push in is pushed back on as often, so what the
    pairs agree on is the cue in the message, not the value (the demo's measured failure with
    one-way pairs: docs/guides/preference.md). Right answers beyond those needed give no pair;
    a mistake with no such message left keeps its pair alone.
    """
    mistakes: list[dict[str, Any]] = []
    wanted: list[tuple[str, Any, Any]] = []  # (field, correct value, written value's class)
    right: list[tuple[list[dict[str, str]], dict[str, str]]] = []
    for record, prediction in zip(records, predictions, strict=True):
        *prompt, answer = record["messages"]
        written = prediction.strip()
        if written and answers_match(written, answer["content"]):
            right.append((prompt, answer))
            continue
        mistakes.append(_pair(prompt, answer, written or overcorrection(answer["content"])))
        try:
            ticket = json.loads(written)
        except ValueError:
            continue  # not a ticket: no value to push back on
        expected = json.loads(answer["content"])
        if not isinstance(ticket, dict) or ticket.keys() != expected.keys():
            continue
        for field, value in expected.items():
            if ticket[field] != value:
                wanted.append((field, value, _value_class(field, ticket[field])))
    counters = []
    for prompt, answer in right:
        ticket = json.loads(answer["content"])
        for k, (field, value, kind) in enumerate(wanted):
            if _value_class(field, ticket[field]) == kind and ticket[field] != value:
                rejected = json.dumps(ticket | {field: value}, ensure_ascii=False)
                counters.append(_pair(prompt, answer, rejected))
                del wanted[k]
                break
    return mistakes + counters


def _pair(prompt: list[dict[str, str]], answer: dict[str, str], rejected: str) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "chosen": [answer],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON object of each line of `path`."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def main(argv: Sequence[str] | None = None) -> None:
    """Write ``support_pairs_train.jsonl`` and ``support_pairs_eval.jsonl``.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when None.
    """
    parser = argparse.ArgumentParser(description="Write the DPO demo's preference pairs.")
    parser.add_argument("--data-dir", type=Path, default=DATA, help="support-desk files' folder")
    parser.add_argument("--out-dir", type=Path, default=DATA)
    parser.add_argument("--train", type=int, default=600, help="number of train pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    sft_train = read_jsonl(args.data_dir / "support_train.jsonl")
    held_out = read_jsonl(args.data_dir / "support_eval.jsonl")
    # Neither the SFT stage's messages nor the held-out ones: the pairs are new to the model,
    # and the held-out exact match measures generalisation, not recall.
    seen = {user_message(r) for r in (*sft_train, *held_out)}
    records = generate(args.train, args.seed, split="pairs", exclude=seen)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(make_pairs(records, args.seed, "train"), args.out_dir / "support_pairs_train.jsonl")
    write_jsonl(make_pairs(held_out, args.seed, "eval"), args.out_dir / "support_pairs_eval.jsonl")


if __name__ == "__main__":
    main()
