"""The DPO demo's pairs: regenerated bit for bit, each a near miss of one field, and their
messages disjoint from the SFT demo's train and held-out files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from leantune.demo import support_desk as sd
from leantune.demo import support_pairs as sp
from leantune.demo.preference import PAIR_MESSAGES, PAIR_SOURCES, write_pairs, wrong_fields


def _user(pair: dict[str, Any]) -> str:
    return next(m["content"] for m in pair["prompt"] if m["role"] == "user")


def test_committed_files_match_regeneration(tmp_path: Path) -> None:
    sp.main(["--out-dir", str(tmp_path)])
    for name in ("support_pairs_train.jsonl", "support_pairs_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (sp.DATA / name).read_bytes(), name


def test_each_rejected_answer_is_wrong_in_exactly_one_field() -> None:
    fields = []
    for name in ("support_pairs_train.jsonl", "support_pairs_eval.jsonl"):
        for pair in sp.read_jsonl(sp.DATA / name):
            assert [m["role"] for m in pair["prompt"]] == ["system", "user"]
            chosen = json.loads(pair["chosen"][0]["content"])
            rejected = json.loads(pair["rejected"][0]["content"])
            wrong = [k for k in sd.ANSWER_KEYS if chosen[k] != rejected[k]]
            assert len(wrong) == 1 and wrong[0] in ("priority", "intent"), pair
            assert rejected["priority"] in sd.PRIORITIES and rejected["intent"] in sd.INTENTS
            # Same formatting: the texts differ in the wrong value only.
            assert pair["rejected"][0]["content"] == json.dumps(rejected, ensure_ascii=False)
            fields.append(wrong[0])
    # Both kinds of near miss, priority the commoner (P_WRONG_PRIORITY = 0.6 of 800 pairs).
    assert 0.5 < fields.count("priority") / len(fields) < 0.7


def test_pairs_train_messages_are_new_and_held_out_pairs_are_the_eval_file() -> None:
    sft_train = {sd.user_message(r) for r in sp.read_jsonl(sp.DATA / "support_train.jsonl")}
    held_out = [sd.user_message(r) for r in sp.read_jsonl(sp.DATA / "support_eval.jsonl")]
    pairs_train = [_user(p) for p in sp.read_jsonl(sp.DATA / "support_pairs_train.jsonl")]
    pairs_eval = [_user(p) for p in sp.read_jsonl(sp.DATA / "support_pairs_eval.jsonl")]
    assert len(set(pairs_train)) == len(pairs_train) == 600
    assert not set(pairs_train) & (sft_train | set(held_out))
    assert pairs_eval == held_out


def test_near_miss_is_seeded() -> None:
    answer = sp.read_jsonl(sp.DATA / "support_eval.jsonl")[0]["messages"][2]["content"]
    draws = [sp.near_miss(answer, random.Random(s)) for s in range(20)]
    assert draws == [sp.near_miss(answer, random.Random(s)) for s in range(20)]
    assert len(set(draws)) > 1 and answer not in draws


def test_wrong_fields_names_each_wrong_value_or_the_format() -> None:
    ticket = dict.fromkeys(("order_id", "email", "product"), None)
    ticket = {"intent": "refund", **ticket, "priority": "low"}
    ref = json.dumps(ticket)
    assert wrong_fields(ref, ref) == []
    assert wrong_fields(ref.replace('"low"', '"normal"'), ref) == ["priority"]
    both = ref.replace('"low"', '"high"').replace("refund", "cancel_order")
    assert wrong_fields(both, ref) == ["intent", "priority"]
    assert wrong_fields('{"intent": "refund"}', ref) == ["format"]
    assert wrong_fields("not json", ref) == ["format"]
    assert wrong_fields("[1]", ref) == ["format"]


def test_on_policy_pairs_reject_wrong_answers_as_written_and_overcorrect_right_ones() -> None:
    held_out = sp.read_jsonl(sp.DATA / "support_eval.jsonl")
    low_one = next(r for r in held_out if '"priority": "low"' in r["messages"][-1]["content"])
    records = [held_out[0], low_one, held_out[2], held_out[3]]
    answers = [r["messages"][-1]["content"] for r in records]
    low = json.loads(answers[1]) | {"priority": "normal"}
    predictions = [
        answers[0],  # right: its overcorrection is rejected
        json.dumps(low),  # the SFT model's usual miss, kept as it wrote it
        " " + json.dumps(json.loads(answers[2]), indent=1) + "\n",  # right as JSON
        "not a ticket ",
    ]
    pairs = sp.on_policy_pairs(records, predictions)
    rejected = [p["rejected"][0]["content"] for p in pairs]
    assert rejected[1:4:2] == [json.dumps(low), "not a ticket"]
    for k in (0, 2):
        assert rejected[k] == sp.overcorrection(answers[k]) != answers[k]
    for pair, record in zip(pairs, records, strict=True):
        assert pair["prompt"] == record["messages"][:2]
        assert pair["chosen"] == record["messages"][2:]
        assert pair["rejected"][0]["role"] == "assistant"


def test_overcorrection_changes_one_value_the_way_unlearning_the_sft_misses_goes() -> None:
    base = {"intent": "refund", "order_id": None, "email": None}
    cases = [
        ({"product": "webcam", "priority": "low"}, {"product": None, "priority": "low"}),
        ({"product": None, "priority": "normal"}, {"product": None, "priority": "low"}),
        ({"product": None, "priority": "high"}, {"product": None, "priority": "normal"}),
        ({"product": None, "priority": "low"}, {"product": None, "priority": "normal"}),
    ]
    for given, expected in cases:
        assert sp.overcorrection(json.dumps(base | given)) == json.dumps(base | expected)


def test_priority_contrast_pairs_reject_each_other_priority_once() -> None:
    records = sp.read_jsonl(sp.DATA / "support_eval.jsonl")[:30]
    pairs = sp.priority_contrast_pairs(records)
    assert len(pairs) == 2 * len(records)
    rejected_values = []
    for k, pair in enumerate(pairs):
        record = records[k // 2]
        assert pair["prompt"] == record["messages"][:2]
        assert pair["chosen"] == record["messages"][2:]
        chosen = json.loads(pair["chosen"][0]["content"])
        rejected = json.loads(pair["rejected"][0]["content"])
        assert wrong_fields(pair["rejected"][0]["content"], pair["chosen"][0]["content"]) == [
            "priority"
        ]
        assert pair["rejected"][0]["content"] == json.dumps(rejected, ensure_ascii=False)
        rejected_values.append((k // 2, rejected["priority"]))
        assert rejected["priority"] != chosen["priority"]
    # Both other priorities of each message, each once.
    assert len(set(rejected_values)) == len(rejected_values)


def test_balanced_pairs_push_back_on_each_mistake_from_a_right_answer() -> None:
    held_out = sp.read_jsonl(sp.DATA / "support_eval.jsonl")

    def answer(r: dict[str, Any]) -> dict[str, Any]:
        return json.loads(r["messages"][-1]["content"])

    low = next(r for r in held_out if answer(r)["priority"] == "low")
    no_product = next(r for r in held_out if answer(r)["product"] is None)
    normals = [r for r in held_out if answer(r)["priority"] == "normal" and answer(r)["product"]]
    records = [low, no_product, *normals[:3]]
    predictions = [
        json.dumps(answer(low) | {"priority": "normal"}),  # a low message answered normal
        json.dumps(answer(no_product) | {"product": "device"}),  # an invented product
        *(json.dumps(answer(r)) for r in normals[:3]),  # right
    ]
    pairs = sp.balanced_on_policy_pairs(records, predictions)
    rejected = [p["rejected"][0]["content"] for p in pairs]
    # The two mistakes as written, then one counter-pair each, from the first right answers:
    # a normal message with `low` rejected, then a named product with `null` rejected.
    assert rejected[:2] == predictions[:2]
    assert rejected[2] == json.dumps(answer(normals[0]) | {"priority": "low"})
    assert rejected[3] == json.dumps(answer(normals[1]) | {"product": None})
    assert [p["chosen"] for p in pairs] == [r["messages"][2:] for r in records[:4]]


def test_the_demo_writes_contrast_pairs_shuffled_without_loading_a_model(tmp_path: Path) -> None:
    source = PAIR_SOURCES["contrast"]
    assert not source.needs_answers
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    # No SFT run at that path: the contrast pairs need no answers from it.
    assert [write_pairs(tmp_path / "absent", source, 7, 50, f) for f in files] == [14, 14]
    assert files[0].read_bytes() == files[1].read_bytes()  # the shuffle is seeded
    pairs = sp.read_jsonl(files[0])
    records = [{"messages": [*p["prompt"], *p["chosen"]]} for p in sp.read_jsonl(PAIR_MESSAGES)]
    expected = sp.priority_contrast_pairs(records[:7])
    assert pairs != expected
    assert sorted(map(json.dumps, pairs)) == sorted(map(json.dumps, expected))
