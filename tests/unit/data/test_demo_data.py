"""The demo support-desk dataset: deterministic, well-formed, and every answer follows its cues."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from leantune.demo import support_desk as sd

DATA_DIR = Path(sd.__file__).parent / "data"
ORDER_ID_RE = re.compile(r"\b[A-Z]-\d{5}\b")


def _load(name: str) -> list[dict[str, Any]]:
    with (DATA_DIR / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def train() -> list[dict[str, Any]]:
    return _load("support_train.jsonl")


@pytest.fixture(scope="module")
def eval_() -> list[dict[str, Any]]:
    return _load("support_eval.jsonl")


@pytest.fixture(scope="module")
def records(train: list[dict[str, Any]], eval_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # The committed data plus a fresh stream, so properties are checked beyond one seed.
    return train + eval_ + sd.generate(300, seed=7)


def _answer(record: dict[str, Any]) -> dict[str, Any]:
    return json.loads(record["messages"][2]["content"])


def _expected_priority(message: str) -> str:
    text = message.lower()
    # Low cues first: "not urgent" contains the high cue "urgent".
    if any(cue in text for cue in sd.LOW_CUES):
        return "low"
    if any(cue in text for cue in sd.HIGH_CUES):
        return "high"
    return "normal"


def test_generation_is_deterministic_per_seed() -> None:
    assert sd.generate(40, seed=3) == sd.generate(40, seed=3)
    assert sd.generate(40, seed=3) != sd.generate(40, seed=4)
    assert sd.generate(40, seed=3, split="eval") != sd.generate(40, seed=3)


def test_make_example_shape() -> None:
    record = sd.make_example(random.Random(0), "refund")
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system", "user", "assistant"]
    assert record["messages"][0]["content"] == sd.SYSTEM_PROMPT
    assert _answer(record)["intent"] == "refund"


def test_answers_are_compact_json_with_keys_in_order(records: list[dict[str, Any]]) -> None:
    for record in records:
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
        assert record["messages"][0]["content"] == sd.SYSTEM_PROMPT
        content = record["messages"][2]["content"]
        answer = json.loads(content)
        assert list(answer) == list(sd.ANSWER_KEYS)
        assert content == json.dumps(answer, ensure_ascii=False)
        assert answer["intent"] in sd.INTENTS
        assert answer["priority"] in sd.PRIORITIES


def test_copied_fields_appear_verbatim(records: list[dict[str, Any]]) -> None:
    for record in records:
        message, answer = sd.user_message(record), _answer(record)
        ids = ORDER_ID_RE.findall(message)
        assert ids == ([answer["order_id"]] if answer["order_id"] else []), message
        if answer["email"] is None:
            assert "@" not in message, message
        else:
            assert answer["email"] in message, message
        named = [p for p in sd.PRODUCTS if p in message]
        assert named == ([answer["product"]] if answer["product"] else []), message


def test_priority_follows_cue_rule(records: list[dict[str, Any]]) -> None:
    for record in records:
        message = sd.user_message(record)
        assert _answer(record)["priority"] == _expected_priority(message), message


def test_intent_keywords_are_unambiguous(records: list[dict[str, Any]]) -> None:
    keyword_intent = {"refund": "refund", "cancel": "cancel_order", "address": "change_address"}
    for record in records:
        text, intent = sd.user_message(record).lower(), _answer(record)["intent"]
        for keyword, owner in keyword_intent.items():
            assert (keyword in text) == (intent == owner), (keyword, text)


def test_realistic_mix(records: list[dict[str, Any]]) -> None:
    answers = [_answer(r) for r in records]
    nullable = [a[k] for a in answers for k in ("order_id", "email", "product")]
    null_share = sum(v is None for v in nullable) / len(nullable)
    assert 0.15 < null_share < 0.4
    assert {a["priority"] for a in answers} == set(sd.PRIORITIES)
    words = [len(sd.user_message(r).split()) for r in records]
    assert min(words) >= 18 and max(words) <= 80


def test_committed_files_match_regeneration(tmp_path: Path) -> None:
    sd.main(["--out-dir", str(tmp_path)])
    for name in ("support_train.jsonl", "support_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


def test_splits_are_disjoint_and_cover_all_intents(
    train: list[dict[str, Any]], eval_: list[dict[str, Any]]
) -> None:
    assert len(train) == 1200 and len(eval_) == 200
    train_messages = {sd.user_message(r) for r in train}
    eval_messages = {sd.user_message(r) for r in eval_}
    assert len(train_messages) == len(train) and len(eval_messages) == len(eval_)
    assert not train_messages & eval_messages
    assert {_answer(r)["intent"] for r in eval_} == set(sd.INTENTS)
