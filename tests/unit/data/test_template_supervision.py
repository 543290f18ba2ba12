"""Supervision is exactly the assistant turns and their end-of-turn text, with every family's real
chat template (tests/chat_templates.py), whatever the template does around them.

The answers are located by one walk over one render, not by rendering every prefix of a
conversation, which Qwen3 (it rewrites earlier turns), Phi-3 (EOS after an unprompted
conversation), Mistral v0.3 and Mixtral with a system message, and Gemma 2 with one defeat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import chat_templates as ct
import pytest
from model_zoo import FAMILIES, family_tokenizer, plant_chats
from support import write_jsonl
from transformers import PreTrainedTokenizerFast

from leantune.data.chat_spans import TemplateError, apply_system_policy, template_facts
from leantune.data.dataset import load_prepared
from leantune.data.formats import BadRecordError, parse_chat, parse_record
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.records import Dropped, PrepareSettings, encode_batch
from leantune.data.tokenize import IGNORE_INDEX, encode_chat, encode_record
from leantune.eval.generation import stop_token_ids

_TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {}

# Mistral's templates have no generation prompt: the prompt ends at "[/INST]", and the model
# writes " " + answer, so the space is supervised (whether it is a token of its own or, as in
# a real Mistral tokenizer's "▁Water", the start of the answer's first piece).
SPACE_BEFORE_ANSWER = ("mistral", "mixtral")


def tok(name: str) -> PreTrainedTokenizerFast:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = family_tokenizer(FAMILIES[name])
    return _TOKENIZERS[name]


def supervised(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    ex = encode_chat(tokenizer, messages, **kw)
    [(ids, labels)] = encode_batch(tokenizer, [{"messages": messages}], None, **kw)  # type: ignore[misc]
    assert labels.tolist() == ex.labels and ids.tolist() == ex.input_ids  # both paths agree
    return tokenizer.decode([t for t in ex.labels if t != IGNORE_INDEX])


def answers(name: str, messages: list[dict[str, Any]]) -> str:
    end = FAMILIES[name].end_of_turn
    lead = " " if name in SPACE_BEFORE_ANSWER else ""
    texts = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    return "".join(lead + a + end for a in texts)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_turn_of_every_record_is_supervised_exactly(name: str) -> None:
    """40 plant-care chats of 1-3 turns, 10 with a system message: the supervised text is the
    answers and their end of turn, nothing the template adds (headers, default system
    prompts, date lines, Qwen3's empty think block, Phi-3's final EOS)."""
    t = tok(name)
    for row in plant_chats(40):
        assert supervised(t, row["messages"]) == answers(name, row["messages"]), row


def test_the_end_of_turn_is_what_each_template_closes_an_answer_with() -> None:
    for name, fam in FAMILIES.items():
        assert template_facts(tok(name)).end_of_turn == fam.end_of_turn, name


@pytest.mark.parametrize(
    ("name", "handling"),
    [
        ("gemma2", "refused"),
        ("mistral", "dropped"),
        ("gemma3", "kept"),
        ("mixtral", "kept"),
        ("llama3", "kept"),
        ("phi3", "kept"),
    ],
)
def test_what_each_template_does_with_a_system_message(name: str, handling: str) -> None:
    assert template_facts(tok(name)).system == handling


SYSTEM_CHAT = [
    {"role": "system", "content": "You are a careful gardener."},
    {"role": "user", "content": "How often should I water the fern?"},
    {"role": "assistant", "content": "Twice a week."},
]


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_a_system_message_the_template_cannot_write_is_folded_and_said_once(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = tok(name)
    with caplog.at_level("WARNING", logger="leantune.data.chat_spans"):
        ex = encode_chat(t, SYSTEM_CHAT)
        encode_chat(t, SYSTEM_CHAT)
    text = t.decode(ex.input_ids)
    assert "You are a careful gardener.\n\nHow often should I water the fern?" in text
    said = [r for r in caplog.records if "folded into the next user turn" in r.getMessage()]
    assert len(said) <= 1  # once per process and template (an earlier test may have said it)
    assert t.decode([x for x in ex.labels if x != IGNORE_INDEX]) == answers(name, SYSTEM_CHAT)


def test_system_message_keep_and_drop_are_explicit() -> None:
    with pytest.raises(TemplateError, match="System role not supported"):
        encode_chat(tok("gemma2"), SYSTEM_CHAT, system_message="keep")
    dropped = tok("gemma2").decode(
        encode_chat(tok("gemma2"), SYSTEM_CHAT, system_message="drop").input_ids
    )
    assert "gardener" not in dropped and "water the fern" in dropped
    kept = tok("llama3").decode(
        encode_chat(tok("llama3"), SYSTEM_CHAT, system_message="keep").input_ids
    )
    assert "You are a careful gardener.<|eot_id|>" in kept


def test_folding_moves_supervise_from_with_the_messages() -> None:
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    out, start = apply_system_policy(msgs, "fold", supervise_from=4)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert out[0]["content"] == "S\n\nu1" and out[start]["content"] == "a2"
    with pytest.raises(TemplateError, match="no user message after it"):
        apply_system_policy([*msgs[1:3], {"role": "system", "content": "late"}], "fold")


# --- reasoning ------------------------------------------------------------------------------


def test_qwen3_reasoning_is_supervised_where_the_template_writes_it() -> None:
    """Qwen3 writes the reasoning of turns after the last user message only; earlier turns'
    reasoning is dropped by the template (so not trained), and a final answer without
    reasoning gets an empty think block that is the template's, not the record's."""
    t = tok("qwen3")
    msgs = [
        {"role": "user", "content": "My fern is yellow."},
        {"role": "assistant", "content": "Too much water.", "reasoning_content": "Yellow: wet."},
        {"role": "user", "content": "And the cactus?"},
        {"role": "assistant", "content": "Water it monthly.", "reasoning_content": "Dry plant."},
    ]
    want = (
        "Too much water.<|im_end|>\n<think>\nDry plant.\n</think>\n\nWater it monthly.<|im_end|>\n"
    )
    assert supervised(t, msgs) == want
    inline = [
        *msgs[:3],
        {"role": "assistant", "content": "<think>\nDry plant.\n</think>\n\nWater it monthly."},
    ]
    assert supervised(t, inline) == want
    plain = [*msgs[:3], {"role": "assistant", "content": "Water it monthly."}]
    rendered = t.decode(encode_chat(t, plain).input_ids)
    assert "<think>\n\n</think>\n\nWater it monthly." in rendered  # written, not supervised
    assert supervised(t, plain) == "Too much water.<|im_end|>\nWater it monthly.<|im_end|>\n"


# --- tools and content parts ----------------------------------------------------------------

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": "Water the basil today?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Yes, it is sunny: water it."},
]


@pytest.mark.parametrize(
    ("name", "call"),
    [
        (
            "qwen2.5",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        (
            "qwen3",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ],
)
def test_tool_calls_train_with_templates_that_write_them(name: str, call: str) -> None:
    messages = parse_chat({"messages": TOOL_CHAT}, None)
    end = FAMILIES[name].end_of_turn
    want = call + end + "Yes, it is sunny: water it." + end
    assert supervised(tok(name), messages) == want


@pytest.mark.parametrize("name", ["phi3", "gemma2", "mistral", "olmo2"])
def test_tool_calls_get_a_reason_per_line_with_templates_without_tools(
    name: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": TOOL_CHAT}, *plant_chats(3, 0)])
    out = tmp_path / "out"
    report = prepare_dataset([str(path)], PrepareSettings("chat", 512), tok(name), out)
    assert report["dropped"] == {"template_error": 1}
    [row] = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert row["line"] == 1 and "chat template" in row["reason"]


def test_content_as_text_parts_is_joined() -> None:
    parts = [{"type": "text", "text": "How often "}, {"type": "text", "text": "for a fern?"}]
    msgs = parse_chat(
        {
            "messages": [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": "Weekly."},
            ]
        },
        None,
    )
    assert msgs[0]["content"] == "How often for a fern?"
    with pytest.raises(BadRecordError, match=r"messages\[0\].content\[0\] must be a text part"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, None)


def test_a_bad_tool_call_names_its_field() -> None:
    bad = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{}]}]
    }
    with pytest.raises(BadRecordError, match=r"messages\[1\].tool_calls\[0\] must be"):
        parse_chat(bad, None)


# --- {% generation %} templates ---------------------------------------------------------------


def test_a_generation_tagged_template_marks_the_answers_itself(tokenizer) -> None:
    t = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    t.chat_template = ct.CHATML_GENERATION
    assert template_facts(t).generation_tags
    msgs = [
        {"role": "user", "content": "q one"},
        {"role": "assistant", "content": "a one"},
        {"role": "user", "content": "q two"},
        {"role": "assistant", "content": "a two"},
    ]
    assert supervised(t, msgs) == "a one<|im_end|>a two<|im_end|>"  # the blocks, not the "\n"
    tail = encode_chat(t, msgs, supervise_from=3)
    assert t.decode([x for x in tail.labels if x != IGNORE_INDEX]) == "a two<|im_end|>"


def test_a_template_that_rewrites_an_answer_is_a_reason_not_a_guess(tokenizer) -> None:
    t = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    t.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper"
        " + '<|im_end|>\n' }}{% endfor %}"
    )
    got = encode_batch(t, [{"messages": SYSTEM_CHAT[1:]}])
    assert isinstance(got[0], Dropped) and "does not write" in got[0].reason


def test_the_space_mistral_writes_before_an_answer_is_supervised_in_either_tokenisation() -> None:
    """Mistral writes "[/INST]" + " " + answer and its prompt ends at "[/INST]": the model
    writes the space. As its own token ("Ġ", "Weekly") or inside the answer's first piece
    ("Ġthe"), it is supervised; leaving "Ġ" out made the trained model start its answers wrong."""
    t = tok("mistral")
    assert t.tokenize(" the")[0] == "Ġthe" and t.tokenize(" Weekly")[0] == "Ġ"
    for answer in ("the fern", "Weekly."):
        msgs = [{"role": "user", "content": "Water?"}, {"role": "assistant", "content": answer}]
        assert supervised(t, msgs) == f" {answer}</s>"


def test_generation_stops_at_the_special_token_the_template_ends_an_answer_with() -> None:
    """Phi-3 ends answers with <|end|>, not its EOS: a model whose generation_config lists only
    the EOS still stops where it was trained to."""
    t = tok("phi3")
    assert t.convert_tokens_to_ids("<|end|>") in stop_token_ids(t)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_a_records_tools_are_written_by_the_template_and_never_supervised(
    name: str, tmp_path: Path
) -> None:
    """A chat record's `tools` field reaches the template, so the model reads the tools it
    calls; the tools are never supervised."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": TOOL_CHAT, "tools": TOOLS}])
    out = tmp_path / "out"
    report = prepare_dataset([str(path)], PrepareSettings("chat", 1024), tok(name), out)
    assert report["rows_out"] == 1 and report["dropped"] == {}
    [record] = load_prepared(out).records
    assert record.tools == tuple(TOOLS)
    ex = encode_record(tok(name), record)
    text = tok(name).decode(ex.input_ids)
    assert '"description": "Weather in a city"' in text  # the model reads its tools
    sup = tok(name).decode([x for x in ex.labels if x != IGNORE_INDEX])
    assert "Weather in a city" not in sup and sup.endswith(
        "Yes, it is sunny: water it.<|im_end|>\n"
    )


def test_tools_with_a_template_that_cannot_write_them_is_a_reason_per_line(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"messages": plant_chats(1)[0]["messages"], "tools": TOOLS}]
    )
    report = prepare_dataset([str(path)], PrepareSettings("chat", 512), tok("phi3"), tmp_path / "o")
    assert report["dropped"] == {"template_error": 1}
    [row] = [json.loads(x) for x in (tmp_path / "o" / "rejected.jsonl").read_text().splitlines()]
    assert "field 'tools'" in row["reason"]
    with pytest.raises(BadRecordError, match=r"tools\[0\] must be"):
        parse_record({"messages": TOOL_CHAT, "tools": [{"name": "x"}]}, "chat")
