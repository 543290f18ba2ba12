"""The formats people have: ShareGPT, TRL prompt/completion, a hint for a
file in another format than data.format says, and data.chat_template for a tokenizer without one.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import (
    CHATML_TEMPLATE,
    prepare_rows,
    run_cli,
    save_tiny_model,
    tiny_train_args,
    write_jsonl,
)
from transformers import AutoTokenizer

from leantune.data.dataset import DataError
from leantune.data.formats import FORMATS, detect_format, read_records
from leantune.data.prepare.pipeline import cache_key, prepare_dataset
from leantune.data.prepare.records import PrepareSettings
from leantune.data.tokenize import IGNORE_INDEX, encode_record

SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Say hi"},
        {"from": "gpt", "value": "hello world"},
        {"from": "human", "value": "Again"},
        {"from": "gpt", "value": "hello again"},
    ],
    "system": "Be brief.",
}
SHAREGPT_MESSAGES = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "hello again"},
)
PC_STRINGS = {"prompt": "Say hi", "completion": "hello world"}
PC_MESSAGES = {
    "prompt": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Say it in full"},
    ],
    "completion": [{"role": "assistant", "content": "hello world"}],
}
# One record of each format, all holding the same exchange.
SAMPLES: dict[str, dict[str, Any]] = {
    "chat": {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "hello world"},
        ]
    },
    "alpaca": {"instruction": "Say hi", "output": "hello world"},
    "text": {"text": "Say hi. hello world"},
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "Say hi"},
            {"from": "gpt", "value": "hello world"},
        ]
    },
    "prompt_completion": PC_STRINGS,
}
KEY = {
    "chat": "messages",
    "alpaca": "instruction",
    "text": "text",
    "sharegpt": "conversations",
    "prompt_completion": "prompt",
}


def supervised_text(tokenizer, record) -> str:
    ex = encode_record(tokenizer, record)
    return tokenizer.decode([t for t in ex.labels if t != IGNORE_INDEX])


# --- ShareGPT ---------------------------------------------------------------------------------


def test_sharegpt_becomes_chat_messages_with_its_system_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [SHAREGPT])
    [record], bad = read_records(path, "sharegpt")
    assert not bad and record.messages == SHAREGPT_MESSAGES
    # role/content entries and user/assistant names are read too
    other = {
        "conversations": [
            {"role": "user", "content": "Say hi"},
            {"from": "assistant", "value": "hello world"},
        ]
    }
    [record], bad = read_records(write_jsonl(tmp_path / "o.jsonl", [other]), "sharegpt")
    assert not bad and record.messages == SHAREGPT_MESSAGES[1:3]


def test_sharegpt_supervises_every_gpt_turn(tmp_path: Path, tokenizer) -> None:
    [record], _ = read_records(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT]), "sharegpt")
    assert supervised_text(tokenizer, record) == "hello world<|im_end|>\nhello again<|im_end|>\n"


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (
            {
                "conversations": [
                    {"from": "human", "value": "weather?"},
                    {"from": "function_call", "value": '{"name": "w"}'},
                    {"from": "observation", "value": "sunny"},
                    {"from": "gpt", "value": "sunny"},
                ]
            },
            "conversations[1].from='function_call': tool calls and tool results are not supported",
        ),
        (
            {**SAMPLES["sharegpt"], "tools": '[{"name": "w"}]'},
            "field 'tools': tool descriptions are not supported",
        ),
        (
            {**SAMPLES["sharegpt"], "images": ["a.jpg"]},
            "field 'images': images, videos and audio are not supported",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "q"}],
                "chosen": {"from": "gpt", "value": "a"},
                "rejected": {"from": "gpt", "value": "b"},
            },
            "preference data (chosen/rejected) is not supported",
        ),
        (
            {"conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
            "conversations[0].from must be one of human/gpt/system (or user/assistant), "
            "got 'robot'",
        ),
        (
            {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
            "the last turn must be from gpt (the answer to learn)",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
            "conversations[1].value: empty answer",
        ),
        (
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                ],
                "system": "t",
            },
            "both a 'system' field and a system turn",
        ),
        ({"conversations": []}, "field 'conversations' must be a non-empty list"),
        ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value must be"),
    ],
)
def test_sharegpt_records_it_cannot_train_are_bad_lines_with_a_reason(
    tmp_path: Path, record: dict[str, Any], reason: str
) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [SAMPLES["sharegpt"], record])
    records, bad = read_records(path, "sharegpt")
    assert len(records) == 1
    assert [(b.line, reason in b.reason) for b in bad] == [(2, True)], bad


def test_unsupported_records_are_counted_as_their_own_kind(tmp_path: Path, tokenizer) -> None:
    rows = [SAMPLES["sharegpt"], {**SAMPLES["sharegpt"], "images": ["a.jpg"]}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    report = prepare_dataset(
        [str(path)], PrepareSettings("sharegpt", 128), tokenizer, tmp_path / "o"
    )
    assert report["dropped"] == {"unsupported": 1} and report["rows_out"] == 1


# --- prompt/completion ------------------------------------------------------------------------


def test_prompt_completion_strings_are_a_user_turn_and_an_answer(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [PC_STRINGS])
    [record], bad = read_records(path, "prompt_completion", system_prompt="Sys")
    assert not bad
    assert record.messages == (
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hello world"},
    )
    assert supervised_text(tokenizer, record) == "hello world<|im_end|>\n"


def test_prompt_completion_supervises_only_the_completion(tmp_path: Path, tokenizer) -> None:
    """An assistant turn inside the prompt is context, as in TRL: only the completion is learned."""
    path = write_jsonl(tmp_path / "p.jsonl", [PC_MESSAGES])
    [record], bad = read_records(path, "prompt_completion")
    assert not bad and record.messages is not None and len(record.messages) == 4
    assert supervised_text(tokenizer, record) == "hello world<|im_end|>\n"
    # the prepare pipeline (train's path) and the prepared directory agree
    out = tmp_path / "o"
    prepare_dataset([str(path)], PrepareSettings("prompt_completion", 128), tokenizer, out)
    from leantune.data.dataset import load_prepared

    data = load_prepared(out)
    [ex] = data.examples
    assert (
        tokenizer.decode([t for t in ex.labels if t != IGNORE_INDEX]) == "hello world<|im_end|>\n"
    )
    assert data.records[0].supervise_from == 3
    assert encode_record(tokenizer, data.records[0]).labels == ex.labels


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"completion": "a"}, "missing field 'prompt'"),
        ({"prompt": "q"}, "missing field 'completion'"),
        ({"prompt": "q", "completion": " "}, "field 'completion' is empty"),
        ({"prompt": 3, "completion": "a"}, "field 'prompt' must be a string or a list of messages"),
        (
            {"prompt": "q", "completion": [{"role": "user", "content": "a"}]},
            "completion[0].role must be assistant",
        ),
        (
            {"prompt": [{"role": "robot", "content": "q"}], "completion": "a"},
            "prompt[0].role must be one of system/user/assistant",
        ),
        ({"prompt": "q", "chosen": "a", "rejected": "b"}, "preference data (chosen/rejected)"),
        ({"prompt": "q", "completion": "a", "label": False}, "unpaired preference data (label)"),
    ],
)
def test_prompt_completion_records_it_cannot_train_are_bad_lines(
    tmp_path: Path, record: dict[str, Any], reason: str
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [PC_STRINGS, record])
    records, bad = read_records(path, "prompt_completion")
    assert len(records) == 1
    assert [(b.line, reason in b.reason) for b in bad] == [(2, True)], bad


# --- every reader -----------------------------------------------------------------------------


def _csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    out = io.StringIO()
    header = sorted({k for r in rows for k in r})
    w = csv.writer(out)
    w.writerow(header)
    for r in rows:
        cells = [r.get(k, "") for k in header]  # a missing field is an empty cell
        w.writerow([v if isinstance(v, str) else json.dumps(v) for v in cells])
    return out.getvalue().encode()


def write_kind(path: Path, rows: list[dict[str, Any]]) -> Path:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    name = path.name
    if name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress(body))
    elif name.endswith(".jsonl.zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(body))
    elif name.endswith(".jsonl"):
        path.write_bytes(body)
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_bytes(_csv_bytes(rows))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst", "json", "parquet", "csv"])
@pytest.mark.parametrize(
    ("fmt", "rows"),
    [
        ("sharegpt", [SHAREGPT, SAMPLES["sharegpt"]]),
        ("prompt_completion", [PC_MESSAGES, {**PC_MESSAGES, "prompt": PC_MESSAGES["prompt"][:1]}]),
        ("prompt_completion", [PC_STRINGS, {"prompt": "[not json", "completion": "[1, 2]"}]),
    ],
)
def test_every_reader_reads_sharegpt_and_prompt_completion(
    tmp_path: Path, tokenizer, kind: str, fmt: str, rows: list[dict[str, Any]]
) -> None:
    reference, _ = read_records(write_kind(tmp_path / "ref.jsonl", rows), fmt)
    path = write_kind(tmp_path / f"d.{kind}", rows)
    records, bad = read_records(path, fmt)
    assert not bad and [r.messages for r in records] == [r.messages for r in reference]
    assert [r.supervise_from for r in records] == [r.supervise_from for r in reference]
    assert detect_format(path) == fmt
    report = prepare_dataset([str(path)], PrepareSettings(fmt, 128), tokenizer, tmp_path / "o")
    assert report["rows_out"] == len(rows) and report["dropped"] == {}


def test_detect_format_knows_every_format(tmp_path: Path) -> None:
    for fmt, sample in SAMPLES.items():
        assert detect_format(write_jsonl(tmp_path / f"{fmt}.jsonl", [sample])) == fmt
    assert set(SAMPLES) == set(FORMATS)


# --- the hint: the format the file is really in -----------------------------------------------

PAIRS = [(real, said) for real in SAMPLES for said in SAMPLES if real != said]


@pytest.mark.parametrize(("real", "said"), PAIRS)
def test_a_file_in_another_format_names_the_format_to_use(
    tmp_path: Path, tokenizer, real: str, said: str
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [SAMPLES[real]] * 4)
    with pytest.raises(DataError) as e:
        prepare_rows(path, said, tokenizer, 128, pack=False)
    message = str(e.value)
    assert f"every record lacks '{KEY[said]}' but has '{KEY[real]}'" in message, message
    assert f"use data.format={real}" in message


def test_the_hint_needs_most_lines_to_miss_the_field(tmp_path: Path, tokenizer) -> None:
    rows = [SAMPLES["chat"]] * 3 + [SAMPLES["sharegpt"]] + [{"messages": 1}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        prepare_rows(path, "chat", tokenizer, 128, pack=False)
    assert "data.format=" not in str(e.value)


def test_train_on_a_sharegpt_file_says_to_use_sharegpt(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "s.jsonl", [SHAREGPT] * 6)
    r = run_cli(tiny_train_args(tiny_llama_dir, data, tmp_path / "run"))  # data.format=chat
    assert r.code == 2, r
    assert "every record lacks 'messages' but has 'conversations'" in r.err
    assert "this looks like ShareGPT; use data.format=sharegpt" in r.err


def test_prepare_kept_nothing_names_the_format_to_use(tmp_path: Path, tiny_llama_dir: Path) -> None:
    data = write_jsonl(tmp_path / "p.jsonl", [PC_STRINGS] * 3)
    r = run_cli(
        ["prepare", "--data", str(data), "--format", "alpaca", "--model", str(tiny_llama_dir)]
    )
    assert r.code == 2, r
    assert "every record lacks 'instruction' but has 'prompt'" in r.err
    assert "use data.format=prompt_completion" in r.err


# --- train, prepare and eval on ShareGPT and prompt/completion ------------------------------------


def test_prepare_cli_takes_sharegpt_and_prompt_completion(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    for fmt, rows in (("sharegpt", [SHAREGPT] * 3), ("prompt_completion", [PC_MESSAGES] * 2)):
        data = write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
        out = tmp_path / f"{fmt}.prepared"
        args = ["prepare", "--data", str(data), "--format", fmt, "--model", str(tiny_llama_dir)]
        r = run_cli([*args, "--out", str(out), "--dedup", "none"])
        assert r.code == 0, r
        assert json.loads(r.out.strip().splitlines()[-1])["rows_out"] == len(rows)


def test_train_then_eval_on_sharegpt_and_prompt_completion(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "s.jsonl", rows)
    run = tmp_path / "run"
    args = tiny_train_args(tiny_llama_dir, data, run, "data.format=sharegpt", "train.max_steps=2")
    r = run_cli(args)
    assert r.code == 0, r
    assert "data s.jsonl: 8 examples" in r.out
    pc = write_jsonl(tmp_path / "p.jsonl", [PC_MESSAGES, PC_STRINGS])
    for path, fmt in ((data, "sharegpt"), (pc, "prompt_completion")):
        r = run_cli(["eval", "--model", str(run / "final"), "--data", str(path)])
        assert r.code == 0, r
        result = json.loads(r.out)
        assert result["format"] == fmt and result["bad_lines"] == 0
        assert result["examples"] == (len(rows) if fmt == "sharegpt" else 2)
        assert "exact_match" in result


# --- data.chat_template -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny Llama with its tokenizer's chat template removed (a base model)."""
    out = save_tiny_model(tmp_path_factory.mktemp("bare"), "llama", tokenizer_dir)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


def _bare(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    return tok


def test_no_template_error_offers_data_chat_template(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [SAMPLES["chat"]])
    with pytest.raises(DataError) as e:
        prepare_rows(path, "chat", _bare(tokenizer), 128, pack=False)
    assert "no chat template" in str(e.value)
    assert "data.chat_template=chatml" in str(e.value)


def test_builtin_templates_render_and_locate_the_answer(tmp_path: Path, tokenizer) -> None:
    from leantune.data.templates import BUILTIN_TEMPLATES, apply_chat_template

    assert {"chatml", "zephyr", "llama3"} <= set(BUILTIN_TEMPLATES)
    [record], _ = read_records(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT]), "sharegpt")
    expected = {
        "chatml": "hello world<|im_end|>\nhello again<|im_end|>\n",
        "zephyr": "hello world<|im_end|>\nhello again<|im_end|>\n",  # eos is <|im_end|> here
    }
    for name, answer in expected.items():
        tok = _bare(tokenizer)
        apply_chat_template(tok, name)
        assert tok.chat_template == BUILTIN_TEMPLATES[name].text
        assert supervised_text(tok, record) == answer, name
    tok = _bare(tokenizer)
    tok.bos_token = "<|endoftext|>"  # llama3's template opens with it
    warnings = apply_chat_template(tok, "llama3")
    assert any("<|eot_id|>" in w for w in warnings), warnings  # not tokens of this tokenizer
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nhello world<|eot_id|>" in (
        tok.apply_chat_template(list(record.messages or ()), tokenize=False)
    )
    assert supervised_text(tok, record).startswith("hello world<|eot_id|>")


def test_chatml_builtin_is_the_tiny_tokenizers_template(tokenizer) -> None:
    from leantune.data.templates import BUILTIN_TEMPLATES

    assert BUILTIN_TEMPLATES["chatml"].text == CHATML_TEMPLATE


def test_a_jinja_file_is_a_template(tmp_path: Path, tokenizer) -> None:
    from leantune.data.templates import apply_chat_template

    jinja = tmp_path / "t.jinja"
    jinja.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok = _bare(tokenizer)
    assert apply_chat_template(tok, str(jinja)) == []
    assert (
        supervised_text(
            tok, read_records(write_jsonl(tmp_path / "d.jsonl", [SAMPLES["chat"]]), "chat")[0][0]
        )
        == "hello world<|im_end|>"
    )


def test_cache_key_includes_data_chat_template(tmp_path: Path, tokenizer) -> None:
    from leantune.data.templates import apply_chat_template

    path = write_jsonl(tmp_path / "d.jsonl", [SAMPLES["chat"]])
    keys = set()
    for name in ("chatml", "zephyr"):
        tok = _bare(tokenizer)
        apply_chat_template(tok, name)
        keys.add(cache_key([str(path)], PrepareSettings("chat", 128), tok))
    assert len(keys) == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("chatm", "data.chat_template: 'chatm' is neither a built-in template (chatml"),
        ("missing.jinja", "missing.jinja: no such file"),
        ("bad.jinja", "bad.jinja:2: not a valid Jinja template"),
    ],
)
def test_a_bad_chat_template_exits_2_before_the_model_loads(
    tmp_path: Path, bare_model_dir: Path, value: str, message: str
) -> None:
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n")
    data = write_jsonl(tmp_path / "d.jsonl", [SAMPLES["chat"]] * 4)
    target = value if value == "chatm" else str(tmp_path / value)
    r = run_cli(
        tiny_train_args(bare_model_dir, data, tmp_path / "run", f"data.chat_template={target}")
    )
    assert r.code == 2 and message in r.err, r
    assert not (tmp_path / "run").exists()


def test_a_relative_template_path_in_a_config_is_relative_to_it(tmp_path: Path) -> None:
    from leantune.training.checks import load_config

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "t.jinja").write_text(CHATML_TEMPLATE)
    data = write_jsonl(tmp_path / "conf" / "d.jsonl", [SAMPLES["chat"]])
    (tmp_path / "conf" / "c.yaml").write_text(
        f"data:\n  train: {data.name}\n  chat_template: t.jinja\n"
    )
    cfg = load_config(tmp_path / "conf" / "c.yaml")
    assert cfg.data.chat_template == str((tmp_path / "conf" / "t.jinja").resolve())
    assert (
        load_config(tmp_path / "conf" / "c.yaml", ["data.chat_template=chatml"]).data.chat_template
        == "chatml"
    )


def test_train_with_a_template_saves_it_with_the_model(
    tmp_path: Path, bare_model_dir: Path
) -> None:
    """A base model without a template trains with data.chat_template=chatml; final/ carries the
    template, so eval and generate render prompts the way the model was trained."""
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = run_cli(tiny_train_args(bare_model_dir, data, tmp_path / "run0", "train.max_steps=2"))
    assert r.code == 2 and "data.chat_template=chatml" in r.err, r
    run = tmp_path / "run"
    r = run_cli(
        tiny_train_args(bare_model_dir, data, run, "train.max_steps=2", "data.chat_template=chatml")
    )
    assert r.code == 0, r
    assert AutoTokenizer.from_pretrained(run / "final").chat_template == CHATML_TEMPLATE
    r = run_cli(["eval", "--model", str(run / "final"), "--data", str(data)])
    assert r.code == 0 and json.loads(r.out)["examples"] == 8, r
    r = run_cli(
        ["generate", "--model", str(run / "final"), "--prompt", "q 1", "--max-new-tokens", "2"]
    )
    assert r.code == 0, r


def test_the_run_fingerprint_covers_data_chat_template() -> None:
    from leantune.config import Config
    from leantune.training.run.fingerprint import trajectory_settings

    cfg = Config()
    before = trajectory_settings(cfg)
    cfg.data.chat_template = "chatml"
    assert (
        trajectory_settings(cfg)["data.chat_template"] == "chatml" != before["data.chat_template"]
    )


def test_prepare_takes_a_chat_template_flag(tmp_path: Path, bare_model_dir: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [SAMPLES["chat"]] * 2)
    args = ["prepare", "--data", str(data), "--format", "chat", "--model", str(bare_model_dir)]
    r = run_cli([*args, "--out", str(tmp_path / "a")])
    assert r.code == 2 and "data.chat_template=chatml" in r.err, r
    r = run_cli([*args, "--out", str(tmp_path / "b"), "--chat-template", "chatm"])
    assert r.code == 2 and "data.chat_template: 'chatm' is neither" in r.err, r
    r = run_cli(
        [*args, "--out", str(tmp_path / "c"), "--chat-template", "chatml", "--dedup", "none"]
    )
    assert r.code == 0, r
    report = json.loads((tmp_path / "c" / "prepare_report.json").read_text())
    assert report["rows_out"] == 2 and report["settings"]["format"] == "chat"


def test_eval_and_generate_take_a_chat_template_for_a_model_without_one(
    tmp_path: Path, bare_model_dir: Path
) -> None:
    """A base model without a template is evaluated on chat data with --chat-template; without
    it the error names the flag, and a bad one is refused before the model loads."""
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(3)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    model = str(bare_model_dir)
    r = run_cli(["eval", "--model", model, "--data", str(data)])
    assert r.code == 2 and "--chat-template" in r.err, r
    r = run_cli(["eval", "--model", model, "--data", str(data), "--chat-template", "chatml"])
    assert r.code == 0, r
    out = json.loads(r.out)
    assert out["examples"] == 3 and "exact_match" in out
    args = ["generate", "--model", model, "--prompt", "q 1", "--max-new-tokens", "2"]
    assert run_cli([*args, "--chat-template", "chatml"]).code == 0
    r = run_cli([*args, "--chat-template", str(tmp_path / "missing.jinja")])
    assert r.code == 2 and "missing.jinja" in r.err, r
