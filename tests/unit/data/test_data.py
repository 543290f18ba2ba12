"""Data formats, bad-line reporting, answer-only labels, packing parity, batch schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import prepare_rows, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.data.dataset import DataError
from leantune.data.formats import read_jsonl
from leantune.data.loader import BatchSchedule, collate
from leantune.data.packing import pack_examples, packing_efficiency, single_rows
from leantune.data.tokenize import IGNORE_INDEX, encode_chat, encode_text
from leantune.models.loss import count_supervised, supervised_logits, token_loss_sum

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hello world"},
    ]
}


def test_chat_labels_cover_only_the_answer_and_end_of_turn(tokenizer) -> None:
    ex = encode_chat(tokenizer, list(CHAT["messages"]))
    assert len(ex.input_ids) == len(ex.labels)
    targets = [t for t in ex.labels if t != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "hello world<|im_end|>\n"
    # labels are shifted: the label at i is the token at i + 1
    for i, t in enumerate(ex.labels[:-1]):
        if t != IGNORE_INDEX:
            assert t == ex.input_ids[i + 1]
    assert ex.labels[-1] == IGNORE_INDEX


def test_multi_turn_supervises_every_assistant_turn(tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "two"},
    ]
    ex = encode_chat(tokenizer, msgs)
    text = tokenizer.decode([t for t in ex.labels if t != IGNORE_INDEX])
    assert text == "one<|im_end|>\ntwo<|im_end|>\n"


def test_text_format_supervises_everything_and_ends_with_eos(tokenizer) -> None:
    ex = encode_text(tokenizer, "hello world")
    assert ex.input_ids[-1] == tokenizer.eos_token_id
    assert ex.num_supervised == len(ex.input_ids) - 1


def test_alpaca_becomes_chat(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Translate", "input": "cat", "output": "chat"},
            {"instruction": "Say hi", "output": "hi"},
        ],
    )
    records, bad = read_jsonl(path, "alpaca", system_prompt="Sys")
    assert not bad
    assert records[0].messages == (
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Translate\n\ncat"},
        {"role": "assistant", "content": "chat"},
    )
    assert records[1].messages is not None and records[1].messages[1]["content"] == "Say hi"


def test_every_bad_line_class_is_reported_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    lines = [
        good.encode(),
        b"{not json",
        b'["a list"]',
        b'{"text": "wrong field"}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        b'{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "a"}]}',
        b'{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}',
        b"",
        good.encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    records, bad = read_jsonl(path, "chat")
    assert [r.line for r in records] == [1, 10]
    reasons = {b.line: b.reason for b in bad}
    assert set(reasons) == {2, 3, 4, 5, 6, 7, 8}
    assert reasons[2].startswith("invalid JSON")
    assert reasons[3] == "expected a JSON object, got list"
    assert reasons[4] == "missing field 'messages'"
    assert "empty assistant answer" in reasons[5]
    assert reasons[6].startswith("not valid UTF-8")
    assert "messages[0].role must be one of" in reasons[7]
    assert "last message must be from the assistant" in reasons[8]
    assert all(b.file == str(path) for b in bad)
    assert str(bad[0]) == f"{path}:2: {reasons[2]}"


def test_over_long_lines_are_bad_and_too_many_bad_lines_refuse(tmp_path: Path, tokenizer) -> None:
    rows = [{"text": "short"}] * 3 + [{"text": "long " * 200}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError) as err:
        prepare_rows(path, "text", tokenizer, max_seq_len=64, pack=False, max_bad_fraction=0.1)
    assert f"{path}:4: too long" in str(err.value)
    assert "data.max_bad_fraction=0.1" in str(err.value)
    data = prepare_rows(path, "text", tokenizer, max_seq_len=64, pack=False, max_bad_fraction=0.5)
    assert len(data.examples) == 3 and [b.line for b in data.bad] == [4]


def test_refuses_to_train_on_nothing(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(DataError, match="no records"):
        prepare_rows(path, "text", tokenizer, 64, pack=False)


def _examples(tokenizer) -> list:
    texts = ["hello world", "the quick brown fox jumps", "order A-1234 has not arrived", "hi"]
    out = [encode_text(tokenizer, t) for t in texts]
    out.append(encode_chat(tokenizer, list(CHAT["messages"])))
    return out


def test_packing_keeps_every_token_and_restarts_positions(tokenizer) -> None:
    examples = _examples(tokenizer)
    rows = pack_examples(examples, seq_len=40)
    assert sorted(t for r in rows for t in r.input_ids) == sorted(
        t for e in examples for t in e.input_ids
    )
    assert all(len(r.input_ids) <= 40 for r in rows)
    assert len(rows) < len(examples)
    for r in rows:
        starts = [i for i, p in enumerate(r.position_ids) if p == 0]
        assert starts[0] == 0 and len(starts) >= 1
    assert 0 < packing_efficiency(rows, 40) <= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_loss_equals_unpacked_loss(
    arch: str, tokenizer, tiny_llama_dir, tiny_qwen2_dir
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    examples = _examples(tokenizer)
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        unpacked = sum(
            float(token_loss_sum(model, collate([r], pad))) for r in single_rows(examples)
        )
        packed_rows = pack_examples(examples, seq_len=64)
        assert any(r.position_ids.count(0) > 1 for r in packed_rows)
        packed = float(token_loss_sum(model, collate(packed_rows, pad)))
        # Guard against the trap: without restarting positions the loss differs.
        row = packed_rows[0]
        naive = collate([row], pad)
        naive["position_ids"] = torch.arange(len(row.input_ids))[None]
        leaked = float(token_loss_sum(model, naive))
        alone = sum(
            float(token_loss_sum(model, collate([r], pad)))
            for r in single_rows([e for e in examples if _in_row(e, row)])
        )
    assert packed == pytest.approx(unpacked, rel=1e-5)
    assert abs(leaked - alone) > 1e-3


def _in_row(example, row) -> bool:
    ids = row.input_ids
    n = len(example.input_ids)
    return any(ids[i : i + n] == example.input_ids for i in range(len(ids) - n + 1))


def test_supervised_logits_match_full_forward(tokenizer, tiny_qwen2_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    batch = collate(single_rows(_examples(tokenizer)), tokenizer.pad_token_id)
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        picked = supervised_logits(model, batch)
    mask = batch["labels"] != IGNORE_INDEX
    assert picked.shape == (count_supervised(batch["labels"]), full.shape[-1])
    torch.testing.assert_close(picked, full[mask], rtol=1e-5, atol=1e-5)


def test_batch_schedule_is_deterministic_and_covers_each_epoch() -> None:
    s1 = BatchSchedule(10, 3, seed=7)
    s2 = BatchSchedule(10, 3, seed=7)
    epoch0 = [s1.indices(k) for k in range(4)]
    assert sorted(i for b in epoch0 for i in b) == list(range(10))
    assert [len(b) for b in epoch0] == [3, 3, 3, 1]
    # random access equals sequential access, in any order
    assert [s2.indices(k) for k in (5, 1, 0, 7)] == [s1.indices(k) for k in (5, 1, 0, 7)]
    assert s1.indices(4) != s1.indices(0) or s1.indices(5) != s1.indices(1)
