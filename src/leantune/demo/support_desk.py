"""Synthetic support-desk dataset for the demo: customer messages -> strict JSON answers.

Every answer field is fully determined by a clear cue in the message, so a tiny chat model can
learn the task from a few hundred examples:

- ``intent``: one of ``INTENTS``; each intent has its own wording (only refund messages say
  "refund", only cancel_order messages say "cancel", only change_address messages say "address").
- ``order_id``: copied verbatim (letter, dash, five digits, e.g. ``A-48213``) or null.
- ``email``: copied verbatim or null.
- ``product``: one of ``PRODUCTS``, copied verbatim, or null.
- ``priority``: ``low`` if the message has a ``LOW_CUES`` phrase, else ``high`` if it has a
  ``HIGH_CUES`` phrase, else ``normal``.

Run ``python -m leantune.demo.support_desk`` to regenerate the committed JSONL files.
Standard library only; everything is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leantune.core.writes import write_file

# Short on purpose: it is repeated in every example, and on CPU every token of it costs time.
SYSTEM_PROMPT = "Reply with a JSON support ticket for the message."

INTENTS: tuple[str, ...] = (
    "refund",
    "order_status",
    "cancel_order",
    "change_address",
    "technical_issue",
)
ANSWER_KEYS: tuple[str, ...] = ("intent", "order_id", "email", "product", "priority")
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")

# Lower-case phrases; a message's priority is decided by which of these it contains.
HIGH_CUES: tuple[str, ...] = ("urgent", "asap", "as soon as possible", "immediately")
# Checked before HIGH_CUES: "not urgent" contains "urgent".
LOW_CUES: tuple[str, ...] = ("no rush", "whenever you can", "not urgent")

# No name is a substring of another, so each one is found verbatim without ambiguity.
PRODUCTS: tuple[str, ...] = (
    "wireless earbuds",
    "standing desk",
    "smart watch",
    "bluetooth speaker",
    "coffee maker",
    "air purifier",
    "robot vacuum",
    "electric kettle",
    "gaming mouse",
    "mechanical keyboard",
    "desk lamp",
    "fitness tracker",
    "webcam",
    "portable charger",
    "over-ear headphones",
    "electric toothbrush",
    "smart thermostat",
    "hair dryer",
    "blender",
    "e-reader",
    "security camera",
)

# How often a message carries each field: every field is absent often enough that the model
# learns null as well as copying.
P_ORDER_ID = 0.8
P_EMAIL = 0.65
P_PRODUCT = 0.75
P_HIGH = 0.3
P_LOW = 0.2

_FIRST_NAMES = (
    "Maria", "James", "Aisha", "Tom", "Elena", "David", "Priya", "Lucas", "Sofia", "Omar",
    "Hannah", "Kenji", "Laura", "Mateo", "Grace", "Noah", "Fatima", "Ben", "Chloe", "Ivan",
    "Zoe", "Samuel", "Mei", "Daniel",
)  # fmt: skip
_LAST_NAMES = (
    "Kowalski", "Smith", "Okafor", "Nguyen", "Rossi", "Garcia", "Patel", "Muller", "Brown",
    "Haddad", "Tanaka", "Silva", "Johnson", "Novak", "Lee", "Fischer", "Moreau", "Khan",
)  # fmt: skip
_DOMAINS = ("example.com", "example.org", "example.net", "mail.example.com")

_GREETINGS = (
    "Hi,", "Hello,", "Hi there,", "Good morning,", "Dear support team,", "Hey,",
    "Hello support,", "Good afternoon,", "",
)  # fmt: skip
_SIGN_OFFS = ("Thanks, {first}", "Best regards, {first} {last}", "Cheers, {first}",
              "Thank you, {first} {last}", "Kind regards, {first}", "- {first}")  # fmt: skip
_ANON_SIGN_OFFS = ("Thanks.", "Thank you!", "Thanks in advance.", "")

_HIGH_SENTENCES = (
    "This is urgent.",
    "It's urgent, please help.",
    "Please handle this ASAP.",
    "I need this sorted ASAP.",
    "Please get back to me as soon as possible.",
    "I need an answer as soon as possible.",
    "Please look into this immediately.",
    "I need this resolved immediately.",
)
_LOW_SENTENCES = (
    "No rush on this.",
    "There's no rush at all.",
    "Whenever you can is fine.",
    "Please reply whenever you can.",
    "It's not urgent.",
    "This is not urgent, just letting you know.",
)
_NEUTRAL_SENTENCES = (
    "Let me know if you need anything else from me.",
    "I appreciate your help.",
    "Thanks for looking into it.",
    "I have been a customer for years.",
)

_EMAIL_SENTENCES = (
    "My email is {email}.",
    "You can reach me at {email}.",
    "Please reply to {email} if you need more details.",
    "Account email: {email}.",
    "Contact me at {email}, please.",
    "The order is under {email}.",
)
_ORDER_SENTENCES = (
    "My order number is {order_id}.",
    "Order number: {order_id}.",
    "The order ID is {order_id}.",
    "It was order {order_id}.",
    "For reference, the order is {order_id}.",
)

# Body templates per intent; {item} is a noun phrase for the product/order, {Item} the same
# phrase capitalised, {address} a street address (change_address only).
_BODIES: dict[str, tuple[str, ...]] = {
    "refund": (
        "I would like a refund for {item}.",
        "Could I get my money back for {item}? It was not what I expected, so I want a refund.",
        "Please refund {item}. I already sent it back.",
        "I returned {item} two weeks ago and still have not received my refund.",
        "{Item} arrived damaged, so I want a full refund.",
        "I'm requesting a refund for {item} because it is the wrong size.",
        "How do I get a refund for {item}? I'm not happy with it.",
        "I was charged twice for {item}. Please refund the extra payment.",
    ),
    "order_status": (
        "Where is {item}? It still hasn't arrived.",
        "Can you tell me the status of {item}?",
        "I'm still waiting for {item} to be delivered. Can you check where it is?",
        "The tracking for {item} hasn't updated in five days. What is the status?",
        "When will {item} arrive? I haven't had any shipping updates.",
        "Has {item} shipped yet? I'd like to know when to expect it.",
        "{Item} was supposed to arrive on Monday, but nothing came. Where is it?",
        "Could you check on the delivery status of {item}?",
    ),
    "cancel_order": (
        "Please cancel {item}. I ordered it by mistake.",
        "I'd like to cancel {item} before it ships.",
        "I changed my mind, can you cancel {item}?",
        "I need to cancel {item} because I no longer need it.",
        "Is it still possible to cancel {item}? I placed it by accident.",
        "Please stop {item} from shipping and cancel it.",
        "I want to cancel {item}. I found what I needed somewhere else.",
    ),
    "change_address": (
        "I need to change the delivery address for {item}. The new address is {address}.",
        "I moved last week. Please update the address for {item} to {address}.",
        "Can you update the shipping address on {item}? Please send it to {address}.",
        "I entered the wrong address for {item}. The correct address is {address}.",
        "Please change the address on {item} to my work address: {address}.",
        "Could you send {item} to a new address, {address}? I won't be home at the old one.",
        "The address on {item} is out of date. Please use {address} instead.",
    ),
    "technical_issue": (
        "{Item} won't turn on anymore.",
        "{Item} keeps switching off by itself after a few minutes.",
        "I can't get {item} to work. I've tried restarting it several times.",
        "{Item} stopped working after two days.",
        "{Item} makes a strange noise and then shuts off.",
        "{Item} shows an error light and won't start. How do I fix this?",
        "{Item} keeps restarting by itself and the light blinks red.",
        "Something is wrong with {item}: it freezes every time I use it.",
    ),
}

# Optional extra sentence per intent; never names a product, an order ID or a priority cue.
_CONTEXTS: dict[str, tuple[str, ...]] = {
    "refund": (
        "I paid with my credit card.",
        "The box was also torn open.",
        "I kept the receipt and the original packaging.",
        "This is the first time I've had a problem with your shop.",
    ),
    "order_status": (
        "I ordered it about two weeks ago.",
        "It's a birthday gift for my sister.",
        "The website just says it is being processed.",
        "I checked with my neighbours and they have not seen a parcel.",
    ),
    "cancel_order": (
        "I haven't received a shipping confirmation yet.",
        "It was meant to be a gift, but plans changed.",
        "I ordered it late at night and regret it now.",
        "I hope it hasn't left the warehouse yet.",
    ),
    "change_address": (
        "I just moved to a new apartment.",
        "Sorry for the trouble.",
        "Nobody will be home at the old place next week.",
        "I only noticed the mistake after paying.",
    ),
    "technical_issue": (
        "I've had it for less than a month.",
        "I followed the manual step by step.",
        "I already tried unplugging it and plugging it back in.",
        "It worked fine when it first arrived.",
    ),
}

_STREETS = ("Oak", "Maple", "Cedar", "Hillside", "Lakeview", "Elm", "Station", "Church", "Mill")
_STREET_KINDS = ("Street", "Avenue", "Road", "Lane", "Drive")
_CITIES = ("Springfield", "Riverton", "Lakewood", "Fairview", "Brookfield", "Ashford", "Milton")


def _order_id(rng: random.Random) -> str:
    return f"{rng.choice('ABCDEFGHJKLMNPRSTW')}-{rng.randrange(100000):05d}"


def _email(rng: random.Random, first: str, last: str) -> str:
    f, lst = first.lower(), last.lower()
    local = rng.choice(
        (f"{f}.{lst}", f"{f}.{lst[0]}", f"{f[0]}{lst}", f"{f}{rng.randint(1, 99)}", f"{f}_{lst}")
    )
    return f"{local}@{rng.choice(_DOMAINS)}"


def _address(rng: random.Random) -> str:
    street = f"{rng.choice(_STREETS)} {rng.choice(_STREET_KINDS)}"
    return f"{rng.randint(2, 980)} {street}, {rng.choice(_CITIES)}"


def _item_phrase(
    rng: random.Random, intent: str, product: str | None, embedded_id: str | None
) -> str:
    """Noun phrase for what the message is about; names the product and/or order if given."""
    options: tuple[str, ...]
    if product and embedded_id:
        options = (
            f"the {product} from order {embedded_id}",
            f"my {product} (order {embedded_id})",
            f"the {product} I bought in order {embedded_id}",
        )
    elif product:
        options = (f"the {product}", f"my {product}", f"the {product} I ordered")
    elif embedded_id:
        # A broken device, not an order, is what a technical issue is about.
        if intent == "technical_issue":
            options = (f"the device from order {embedded_id}",)
        else:
            options = (f"order {embedded_id}", f"my order {embedded_id}")
    elif intent == "technical_issue":
        options = ("the device I bought from you", "my new device")
    else:
        options = ("my recent order", "my last order", "the order I placed yesterday")
    return rng.choice(options)


def _priority_sentence(rng: random.Random, priority: str) -> str | None:
    if priority == "high":
        return rng.choice(_HIGH_SENTENCES)
    if priority == "low":
        return rng.choice(_LOW_SENTENCES)
    return None


def make_example(rng: random.Random, intent: str | None = None) -> dict[str, Any]:
    """Draw one support-desk conversation.

    Args:
        rng: Source of randomness; the record is a pure function of its state and ``intent``.
        intent: Intent to generate; drawn uniformly from ``INTENTS`` when None.

    Returns:
        ``{"messages": [system, user, assistant]}`` where the assistant content is the answer as
        compact JSON with keys in ``ANSWER_KEYS`` order.
    """
    intent = intent if intent is not None else rng.choice(INTENTS)
    first, last = rng.choice(_FIRST_NAMES), rng.choice(_LAST_NAMES)
    order_id = _order_id(rng) if rng.random() < P_ORDER_ID else None
    email = _email(rng, first, last) if rng.random() < P_EMAIL else None
    product = rng.choice(PRODUCTS) if rng.random() < P_PRODUCT else None
    roll = rng.random()
    priority = "high" if roll < P_HIGH else "low" if roll < P_HIGH + P_LOW else "normal"

    # The order ID inside the item phrase or in a sentence of its own: the model must find it
    # wherever it is, not at one place.
    embedded_id = order_id if order_id and rng.random() < 0.6 else None
    item = _item_phrase(rng, intent, product, embedded_id)
    body = rng.choice(_BODIES[intent]).format(
        item=item, Item=item[0].upper() + item[1:], address=_address(rng)
    )
    sentences = [body, rng.choice(_CONTEXTS[intent])]
    if order_id and not embedded_id:
        sentences.append(rng.choice(_ORDER_SENTENCES).format(order_id=order_id))
    cue = _priority_sentence(rng, priority)
    if cue:
        # First or last: the priority is read from the cue's words, not from its position.
        sentences.insert(rng.choice((0, len(sentences))), cue)
    # Pad short messages to a realistic length with a sentence that carries no field.
    if rng.random() < 0.3 or sum(len(x.split()) for x in sentences) < 20:
        sentences.append(rng.choice(_NEUTRAL_SENTENCES))
    if email:
        sentences.insert(
            rng.choice((1, len(sentences))), rng.choice(_EMAIL_SENTENCES).format(email=email)
        )

    signed = rng.random() < 0.7
    sign_off = (rng.choice(_SIGN_OFFS) if signed else rng.choice(_ANON_SIGN_OFFS)).format(
        first=first, last=last
    )
    # Some messages in paragraphs, as e-mails are: no field may depend on one layout.
    sep = "\n\n" if rng.random() < 0.25 else " "
    parts = [rng.choice(_GREETINGS), " ".join(sentences), sign_off]
    message = sep.join(p for p in parts if p)

    answer = {
        "intent": intent,
        "order_id": order_id,
        "email": email,
        "product": product,
        "priority": priority,
    }
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": message},
            # Keys in ANSWER_KEYS order (a dict keeps insertion order): one canonical text per
            # answer, so that exact match can compare strings.
            {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)},
        ]
    }


def user_message(record: dict[str, Any]) -> str:
    """Return the user turn of a record made by ``make_example``."""
    return next(m["content"] for m in record["messages"] if m["role"] == "user")


def generate(
    n: int, seed: int, *, split: str = "train", exclude: set[str] | None = None
) -> list[dict[str, Any]]:
    """Generate ``n`` records with distinct user messages, intents balanced in blocks.

    Args:
        n: Number of records.
        seed: Seed; with ``split`` it selects an independent, reproducible random stream.
        split: Stream name, so that train and eval draw different streams for the same seed.
        exclude: User messages that must not be produced (e.g. the train set's, for eval).

    Returns:
        The records, in generation order.
    """
    # A string seed is hashed with SHA-512: the same stream on every run and platform.
    rng = random.Random(f"support_desk/{split}/{seed}")
    seen = set(exclude) if exclude else set()
    records: list[dict[str, Any]] = []
    while len(records) < n:
        # Intents in shuffled blocks: any prefix of the data (--limit, a small eval) is balanced.
        block = list(INTENTS)
        rng.shuffle(block)
        for intent in block[: n - len(records)]:
            # Redraw until new; the space of messages is far larger than any n asked for.
            while True:
                record = make_example(rng, intent)
                message = user_message(record)
                if message not in seen:
                    break
            seen.add(message)
            records.append(record)
    return records


def write_jsonl(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Write one JSON object per line (UTF-8, non-ASCII kept as is)."""
    write_file(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def main(argv: Sequence[str] | None = None) -> None:
    """Write ``support_train.jsonl`` and ``support_eval.jsonl``.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when None.
    """
    parser = argparse.ArgumentParser(description="Write the demo support-desk JSONL files.")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--train", type=int, default=1200, help="number of train examples")
    parser.add_argument("--eval", type=int, default=200, help="number of eval examples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    train = generate(args.train, args.seed, split="train")
    train_messages = {user_message(r) for r in train}
    # No eval message was seen in training: the score measures generalisation, not recall.
    eval_ = generate(args.eval, args.seed, split="eval", exclude=train_messages)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, args.out_dir / "support_train.jsonl")
    write_jsonl(eval_, args.out_dir / "support_eval.jsonl")


if __name__ == "__main__":
    main()
