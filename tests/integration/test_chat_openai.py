"""OpenAI-format chat records train what they say.

OpenAI's fine-tuning format (and Axolotl's, which reads it) marks a turn not to learn with
`"weight": 0` on the assistant message; its tool calls come as `tool_calls` with the arguments
as a JSON *string*, or, in the older form OpenAI still accepts, as `function_call` with the
functions in a top-level `functions` and the results in `function` messages. A turn of weight 0
is not supervised, `function_call`/`functions` train as tool calls (not only the text beside a
call), and string arguments reach the template as the JSON object they hold (Qwen's and Llama's
templates would write a string JSON-escaped: `"arguments": "{\\"city\\": ...}"`).

Every check runs on the real templates of tests/chat_templates.py, through both tokenising paths
(`encode_chat`, and `prepare`'s `encode_batch`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from model_zoo import FAMILIES, family_tokenizer
from support import write_jsonl
from transformers import PreTrainedTokenizerFast

from leantune.data.formats import BadRecordError, parse_record, read_records
from leantune.data.prepare.dedup import minhash, record_text
from leantune.data.prepare.records import encode_batch
from leantune.data.tokenize import IGNORE_INDEX, encode_chat

_TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {}


def tok(name: str) -> PreTrainedTokenizerFast:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = family_tokenizer(FAMILIES[name])
    return _TOKENIZERS[name]


def encoded(name: str, record: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a chat record, the same from both tokenising paths."""
    parsed = parse_record(record, "chat")
    t = tok(name)
    ex = encode_chat(t, parsed["messages"], tools=parsed.get("tools"))
    [(ids, labels)] = encode_batch(t, [parsed], None)  # type: ignore[misc]
    assert ids.tolist() == ex.input_ids and labels.tolist() == ex.labels
    return ex.input_ids, ex.labels


def supervised_text(name: str, labels: list[int]) -> str:
    return tok(name).decode([x for x in labels if x != IGNORE_INDEX])


TURNS = [
    {"role": "user", "content": "My fern is yellow."},
    {"role": "assistant", "content": "Let the soil dry out."},
    {"role": "user", "content": "And the cactus?"},
    {"role": "assistant", "content": "Water it monthly."},
]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3", "mistral", "gemma2", "qwen3", "phi3"])
def test_a_weight_0_turn_is_rendered_but_not_learned(name: str) -> None:
    """The weight-0 answer's tokens leave the labels; the tokens and every other label are
    exactly those of the same record without weights."""
    ids, labels = encoded(name, {"messages": TURNS})
    weighted = [TURNS[0], {**TURNS[1], "weight": 0}, TURNS[2], {**TURNS[3], "weight": 1}]
    w_ids, w_labels = encoded(name, {"messages": weighted})
    assert w_ids == ids
    changed = [i for i, (a, b) in enumerate(zip(labels, w_labels, strict=True)) if a != b]
    assert changed and all(w_labels[i] == IGNORE_INDEX for i in changed)
    lost = supervised_text(name, [labels[i] for i in changed])
    end = FAMILIES[name].end_of_turn
    assert lost.strip() == ("Let the soil dry out." + end).strip()
    assert "Water it monthly." in supervised_text(name, w_labels)
    assert "soil" not in supervised_text(name, w_labels)


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        (
            {"role": "assistant", "content": "a", "weight": 0.5},
            r"messages\[1\]\.weight: must be 0 .* or 1 .*got 0.5",
        ),
        ({"role": "assistant", "content": "a", "weight": 2}, r"messages\[1\]\.weight"),
        ({"role": "assistant", "content": "a", "weight": "0"}, r"messages\[1\]\.weight"),
        ({"role": "assistant", "content": "a", "weight": True}, r"messages\[1\]\.weight"),
        ({"role": "user", "content": "a", "weight": 1}, r"messages\[1\]\.weight: .*assistant"),
    ],
)
def test_other_weights_are_refused_naming_the_field(message: dict[str, Any], needle: str) -> None:
    record = {"messages": [TURNS[0], message, {"role": "assistant", "content": "b"}]}
    with pytest.raises(BadRecordError, match=needle):
        parse_record(record, "chat")


def test_a_bad_weight_is_a_bad_line_with_file_and_line(tmp_path: Path) -> None:
    bad = {"messages": [TURNS[0], {**TURNS[1], "weight": 0.3}]}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": TURNS}, bad])
    records, rejected = read_records(path, "chat")
    assert len(records) == 1
    assert [str(b) for b in rejected] == [
        f"{path}:2: messages[1].weight: must be 0 (do not learn this turn) or 1 (learn it), got 0.3"
    ]


# --- tool calls as OpenAI writes them -------------------------------------------------------

ASK = {"role": "user", "content": "Water the basil today?"}
ANSWER = {"role": "assistant", "content": "Yes, it is sunny: water it."}
ARGS = {"city": "Paris"}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CHAT = {
    "messages": [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny, 21 C"},
        ANSWER,
    ],
    "tools": [{"type": "function", "function": FUNCTION}],
}


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3"])
def test_string_arguments_train_as_the_object_they_hold(name: str) -> None:
    """OpenAI writes `arguments` as a JSON string; the templates expect an object (Qwen2.5 and
    Llama 3.1 pass it through `tojson`, which escaped the string)."""
    as_string = json.loads(json.dumps(CHAT))
    as_string["messages"][1]["tool_calls"] = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert encoded(name, as_string) == encoded(name, CHAT)
    assert '"city": "Paris"' in supervised_text(name, encoded(name, as_string)[1])


@pytest.mark.parametrize("arguments", ['{"city": ', '["Paris"]', ""])
def test_string_arguments_that_are_not_a_json_object_are_refused(arguments: str) -> None:
    record = json.loads(json.dumps(CHAT))
    record["messages"][1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(
        BadRecordError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"
    ):
        parse_record(record, "chat")


@pytest.mark.parametrize("name", ["qwen2.5", "llama3"])
def test_function_call_and_functions_train_as_tool_calls(name: str) -> None:
    """OpenAI's older form: `function_call`, `functions` and `function` results: the call and the
    functions reach the template as tool calls and tools, not only the text beside the call."""
    legacy = {
        "messages": [
            ASK,
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
            ANSWER,
        ],
        "functions": [FUNCTION],
    }
    ids, labels = encoded(name, legacy)
    want_ids, want_labels = encoded(name, CHAT)
    assert labels == want_labels
    assert tok(name).decode(ids) == tok(name).decode(want_ids)
    assert "get_weather" in supervised_text(name, labels)


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        (
            {
                "messages": [
                    ASK,
                    {
                        "role": "assistant",
                        "content": "x",
                        "function_call": CALL["function"],
                        "tool_calls": [CALL],
                    },
                ]
            },
            r"messages\[1\]: both 'tool_calls' and 'function_call'",
        ),
        (
            {"messages": [{**ASK, "tool_calls": [CALL]}, ANSWER]},
            r"messages\[0\]\.tool_calls: only an assistant message",
        ),
        (
            {"messages": [ASK, ANSWER], "functions": [FUNCTION], "tools": CHAT["tools"]},
            r"both 'tools' and 'functions'",
        ),
        ({"messages": [ASK, ANSWER], "functions": [{"description": "x"}]}, r"functions\[0\]"),
    ],
)
def test_contradicting_or_misplaced_tool_fields_are_refused(
    record: dict[str, Any], needle: str
) -> None:
    with pytest.raises(BadRecordError, match=needle):
        parse_record(record, "chat")


def test_functions_are_refused_where_tools_are() -> None:
    with pytest.raises(BadRecordError, match="field 'functions'"):
        parse_record({"instruction": "i", "output": "o", "functions": [FUNCTION]}, "sharegpt")


def test_a_tool_call_is_an_answer_in_a_completion_too() -> None:
    parsed = parse_record(
        {
            "prompt": [ASK],
            "completion": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
        },
        "prompt_completion",
    )
    assert parsed["messages"][-1]["tool_calls"][0]["function"]["arguments"] == ARGS


def test_near_duplicates_compare_tool_calls_too() -> None:
    """Two records that differ only in the call's arguments are not the same example."""
    other = json.loads(json.dumps(CHAT))
    other["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo, Norway"}
    a, b = (record_text(parse_record(r, "chat")) for r in (CHAT, other))
    assert a != b and (minhash(a, 64) != minhash(b, 64)).any()


def test_a_sharegpt_turn_takes_the_same_weights() -> None:
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0}]
    parsed = parse_record({"conversations": [*turns, {"from": "gpt", "value": "b"}]}, "sharegpt")
    assert [m.get("weight") for m in parsed["messages"]] == [None, 0, None]
    bad = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0.5}]
    with pytest.raises(BadRecordError, match=r"conversations\[1\]\.weight: must be 0"):
        parse_record({"conversations": bad}, "sharegpt")


# --- LLaMA-Factory's alpaca fields ------------------------------------------------------------


def test_alpaca_system_and_history_are_trained_as_they_say() -> None:
    """LLaMA-Factory's alpaca `system` and `history` were dropped: the model learned the last
    answer without the conversation before it."""
    record = {
        "instruction": "And the cactus?",
        "output": "Water it monthly.",
        "system": "You are a careful gardener.",
        "history": [["My fern is yellow.", "Let the soil dry out."]],
    }
    messages = parse_record(record, "alpaca")["messages"]
    chat = [{"role": "system", "content": "You are a careful gardener."}, *TURNS]
    assert messages == chat
    assert encode_chat(tok("qwen2.5"), messages) == encode_chat(tok("qwen2.5"), chat)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("history", [["only one"]], r"history\[0\] must be a pair"),
        ("history", "earlier", "field 'history' must be a list"),
        ("system", 3, "field 'system' must be a string"),
        ("tools", [CALL], "field 'tools': tool descriptions are not supported"),
        ("images", ["a.png"], "field 'images': images"),
    ],
)
def test_alpaca_fields_leantune_cannot_honour_are_refused(
    field: str, value: Any, needle: str
) -> None:
    with pytest.raises(BadRecordError, match=needle):
        parse_record({"instruction": "i", "output": "o", field: value}, "alpaca")
