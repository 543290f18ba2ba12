"""Input that must not take the machine down.

Answer spans come from one render of the conversation (time linear in its length) and equal
the prefix method's on ordinary records; supervision never covers text that is not an assistant
turn of the record; a record certainly longer than data.max_seq_len is rejected before it is
tokenised, by a bound that never exceeds the true token count.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import prepare_rows, write_jsonl
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from leantune.data.bounds import token_floor
from leantune.data.formats import parse_alpaca, parse_chat
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.records import PrepareSettings, encode_batch
from leantune.data.tokenize import IGNORE_INDEX, encode_chat

# --- the SmolLM2 tokenizer (the demo model's), offline -------------------------------------


def load_smollm_tokenizer() -> PreTrainedTokenizerFast:
    """The demo model's tokenizer: from the converted cache, else straight from the GGUF."""
    from leantune.models.demo_model import find_demo_gguf, leantune_home

    cached = leantune_home() / "models" / "smollm2-135m-instruct"
    if (cached / "COMPLETE").is_file():
        return AutoTokenizer.from_pretrained(cached)
    try:
        gguf = find_demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smol() -> PreTrainedTokenizerFast:
    return load_smollm_tokenizer()


# --- the prefix-rendering method, kept here as the reference ---------------------------------


def _render(tok: Any, messages: list[dict[str, str]], gen: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def prefix_spans(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The answer spans as leantune found them before: one render per prefix (quadratic)."""
    full = _render(tok, messages, gen=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], gen=True) if i else ""
        through = full if i == len(messages) - 1 else _render(tok, messages[: i + 1], gen=False)
        assert full.startswith(before) and full.startswith(through)
        spans.append((len(before), len(through)))
    return full, spans


def prefix_encode(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    full, spans = prefix_spans(tok, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    sup = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    labels = [ids[i + 1] if sup[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
    return ids, [*labels, IGNORE_INDEX]


# --- records ----------------------------------------------------------------------------------

WORDS = [
    "order",
    "refund",
    "A-1234",
    '{"intent": "refund", "priority": "high"}',
    "héllo wörld",
    "中文测试",
    "👨\u200d👩\u200d👧",
    "line\nbreak",
    "tabs\tand  spaces",
    "<b>html</b>",
    "user",
    "assistant",
    "system",
    "1 2 3",
    "?!",
    "ok",
]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


def ordinary_records(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat (multi-turn, system prompts, repeated roles) and alpaca records; none starts with
    an assistant message."""
    rng = random.Random(seed)
    out: list[list[dict[str, str]]] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            obj = {
                "instruction": _text(rng),
                "input": _text(rng) if i % 8 else "",
                "output": _text(rng),
            }
            out.append(parse_alpaca(obj, "Be brief." if i % 3 else None))
            continue
        msgs = [{"role": "system", "content": _text(rng)}] if kind == 1 else []
        for _ in range(rng.randint(1, 6)):
            msgs.append({"role": "user", "content": _text(rng)})
            if rng.random() < 0.15:
                msgs.append({"role": "user", "content": _text(rng)})
            msgs.append({"role": "assistant", "content": _text(rng)})
            if rng.random() < 0.1:
                msgs.append({"role": "assistant", "content": _text(rng)})
        prompt = "You are terse." if kind == 3 else None
        out.append(parse_chat({"messages": msgs}, prompt))
    return out


def _supervised_text(tok: Any, labels: list[int]) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def _answers(messages: list[dict[str, str]], end: str = "<|im_end|>\n") -> str:
    return "".join(m["content"] + end for m in messages if m["role"] == "assistant")


# --- section 5: spans in linear time, identical to the prefix method ------------------------


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_spans_equal_the_prefix_method_on_ordinary_records(which: str, tokenizer, request) -> None:
    tok = tokenizer if which == "tiny" else request.getfixturevalue("smol")
    records = ordinary_records(240, seed=1 if which == "tiny" else 2)
    batched = encode_batch(tok, [{"messages": m} for m in records])
    for msgs, got in zip(records, batched, strict=True):
        ids, labels = prefix_encode(tok, msgs)
        ex = encode_chat(tok, msgs)
        assert (ex.input_ids, ex.labels) == (ids, labels), msgs
        assert isinstance(got, tuple)
        assert got[0].tolist() == ids and got[1].tolist() == labels


def _long_chat(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "Answer with the number."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"what is {i} + 1?"})
        msgs.append({"role": "assistant", "content": str(i + 1)})
    return msgs


def _count_renders(monkeypatch, tok: Any) -> list[int]:
    calls: list[int] = []
    real = type(tok).apply_chat_template

    def counting(self, conversation, *args, **kwargs):
        calls.append(len(conversation))
        return real(self, conversation, *args, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", counting)
    return calls


def test_a_long_conversation_is_rendered_once(tokenizer, monkeypatch) -> None:
    calls = _count_renders(monkeypatch, tokenizer)
    encode_chat(tokenizer, _long_chat(1))  # the template is probed once per tokenizer
    msgs = _long_chat(2000)
    calls.clear()
    ex = encode_chat(tokenizer, msgs)
    assert calls == [len(msgs)]  # the prefix method rendered 4,001 times here
    assert _supervised_text(tokenizer, ex.labels) == _answers(msgs)
    calls.clear()
    [(ids, labels)] = encode_batch(tokenizer, [{"messages": msgs}])
    assert calls == [len(msgs)] and ids.tolist() == ex.input_ids and labels.tolist() == ex.labels


def test_forty_thousand_messages_are_encoded(tokenizer) -> None:
    msgs = _long_chat(20_000)
    ex = encode_chat(tokenizer, msgs)
    assert _supervised_text(tokenizer, ex.labels) == _answers(msgs)


def _retemplated(tokenizer: Any, template: str) -> Any:
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.chat_template = template
    return other


TRIMMING = (  # Llama-3 style: the template trims each message, so contents are not verbatim
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_trims_content_is_located_in_one_render(
    tmp_path: Path, tokenizer, monkeypatch
) -> None:
    """Such a template is located in the one render, not by rendering every prefix: the walk
    finds trimmed text, and a conversation of 602 messages renders once and keeps every answer."""
    tok = _retemplated(tokenizer, TRIMMING)
    msgs = [
        {"role": "user", "content": "  padded question  "},
        {"role": "assistant", "content": " answer one\n"},
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": "two"},
    ]
    ex = encode_chat(tok, msgs)
    assert (ex.input_ids, ex.labels) == prefix_encode(tok, msgs)
    assert _supervised_text(tok, ex.labels) == "answer one<|im_end|>\ntwo<|im_end|>\n"
    long = [{"role": "user", "content": " x "}, *_long_chat(300)]
    calls = _count_renders(monkeypatch, tok)
    long_ex = encode_chat(tok, long)
    assert calls == [len(long)]
    assert _supervised_text(tok, long_ex.labels) == _answers(long)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}, {"messages": long}])
    out = tmp_path / "out"
    s = PrepareSettings(format="chat", max_seq_len=100_000)
    report = prepare_dataset([str(path)], s, tok, out)
    assert report["rows_out"] == 2 and report["dropped"] == {}


# --- supervision covers only the record's assistant turns -----------------------------------


def _mixed_records() -> list[list[dict[str, str]]]:
    return [
        [{"role": "assistant", "content": "I start the conversation."}],
        [
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Refund order A-1234."},
            {"role": "assistant", "content": '{"intent": "refund"}'},
        ],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        *ordinary_records(40, seed=5),
    ]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_supervision_is_exactly_the_assistant_turns(which: str, tokenizer, request) -> None:
    """The SmolLM2 template injects a default system prompt before an assistant-first record;
    the prefix method supervised it ("system\\nYou are a helpful AI assistant named SmolLM")."""
    tok = tokenizer if which == "tiny" else request.getfixturevalue("smol")
    records = _mixed_records()
    batched = encode_batch(tok, [{"messages": m} for m in records])
    for msgs, got in zip(records, batched, strict=True):
        ex = encode_chat(tok, msgs)
        assert _supervised_text(tok, ex.labels) == _answers(msgs), msgs
        assert isinstance(got, tuple) and got[1].tolist() == ex.labels


def test_prepared_data_supervises_only_assistant_turns(tmp_path: Path, smol) -> None:
    records = _mixed_records()
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in records])
    data = prepare_rows(path, "chat", smol, 2048, pack=False)
    out = tmp_path / "out"
    prepare_dataset([str(path)], PrepareSettings(format="chat", max_seq_len=2048), smol, out)
    from leantune.data.dataset import load_prepared

    prepared = load_prepared(out)
    for got in (data, prepared):
        assert len(got.examples) == len(records)
        for msgs, ex in zip(records, got.examples, strict=True):
            assert _supervised_text(smol, ex.labels) == _answers(msgs)


# --- the token floor: over-long records are rejected before tokenising ----------------------


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-like tokenizer: Metaspace pieces, byte fallback, a normalizer that grows text."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer=trainer)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _nfkc_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE behind an NFKC normalizer, which can shrink text (Qwen2 uses NFC)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["ﬁne ﬁne ① full width ｆｕｌｌ"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["hello world"] * 5, trainers.WordPieceTrainer(vocab_size=50, special_tokens=["[UNK]"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300) | st.lists(
    st.sampled_from(
        [
            "#" * 80,
            " " * 90,
            "\n",
            "<|im_start|>",
            "<|im_end|>",
            "ﬁ",
            "①",
            "e\u0301",
            "ｆ",
            "▁",
            "hello",
            " world",
            "中",
        ]
    ),
    max_size=40,
).map("".join)


@pytest.mark.parametrize("which", ["tiny", "smollm2", "byte_fallback", "nfkc"])
def test_the_token_floor_never_exceeds_the_token_count(which: str, tokenizer, request) -> None:
    tok = {
        "tiny": lambda: tokenizer,
        "smollm2": lambda: request.getfixturevalue("smol"),
        "byte_fallback": _byte_fallback_tokenizer,
        "nfkc": _nfkc_tokenizer,
    }[which]()
    floor = token_floor(tok)
    assert floor is not None

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(TEXT)
    def check(text: str) -> None:
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert floor.at_least(text) <= n

    check()
    dense = "#" * 80 * 50  # SmolLM2's longest token repeated: the floor is nearly tight there
    assert floor.at_least(dense) <= len(tok(dense, add_special_tokens=False)["input_ids"])


def test_no_floor_where_one_token_can_cover_any_length() -> None:
    # WordPiece maps an unknown word of any length to one [UNK]: no bound holds.
    assert token_floor(_wordpiece_tokenizer()) is None
    strip = _nfkc_tokenizer()
    strip.backend_tokenizer.normalizer = normalizers.Strip()  # strips each split differently
    assert token_floor(strip) is None


def _count_tokenised(monkeypatch, tok: Any) -> list[int]:
    """Lengths of every text the tokenizer is asked to tokenise."""
    seen: list[int] = []
    real = type(tok).__call__

    def counting(self, text=None, *args, **kwargs):
        items = text if isinstance(text, list) else [text]
        seen.extend(len(t) for t in items if isinstance(t, str))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", counting)
    return seen


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_an_over_long_record_is_rejected_without_tokenising(
    fmt: str, tmp_path: Path, tokenizer, monkeypatch
) -> None:
    huge = "word " * 1_000_000  # 5 MB
    row = (
        {"text": huge}
        if fmt == "text"
        else {
            "messages": [
                {"role": "user", "content": huge},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    small = (
        {"text": "short"}
        if fmt == "text"
        else {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    path = write_jsonl(tmp_path / "d.jsonl", [small, row, small])
    seen = _count_tokenised(monkeypatch, tokenizer)
    out = tmp_path / "out"
    s = PrepareSettings(format=fmt, max_seq_len=64)
    report = prepare_dataset([str(path)], s, tokenizer, out)
    assert report["dropped"] == {"too_long": 1} and report["rows_out"] == 2
    [rej] = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert rej["line"] == 2 and rej["kind"] == "too_long"
    assert "data.max_seq_len=64" in rej["reason"] and "at least" in rej["reason"]
    data = prepare_rows(path, fmt, tokenizer, 64, pack=False, max_bad_fraction=0.5)
    assert [b.line for b in data.bad] == [2] and data.bad[0].reason.startswith("too long")
    assert len(data.examples) == 2
    assert seen and max(seen) < 1000  # the 5 MB record never reached the tokenizer


def test_a_record_that_fits_is_never_rejected_by_the_floor(tmp_path: Path, smol) -> None:
    dense = "#" * 16_000  # runs of SmolLM2's longest tokens: about 64 bytes a token
    n = len(smol(dense, add_special_tokens=False)["input_ids"])
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": dense}])
    data = prepare_rows(path, "text", smol, n + 1, pack=False)  # + the end-of-text token
    assert len(data.examples) == 1 and not data.bad
    report = prepare_dataset(
        [str(path)], PrepareSettings(format="text", max_seq_len=n + 1), smol, tmp_path / "o"
    )
    assert report["rows_out"] == 1 and report["dropped"] == {}
    report = prepare_dataset(
        [str(path)], PrepareSettings(format="text", max_seq_len=n), smol, tmp_path / "o2"
    )
    assert report["dropped"] == {"too_long": 1}


def test_the_supervised_mask_is_a_merge_not_a_product() -> None:
    """A token is supervised when it overlaps a span: the product definition, on random
    tokenisations and spans (a token that straddles a span's start, like Mistral's " answer"
    piece, overlaps it; one that ends where the span starts does not)."""
    from leantune.data.tokenize import supervised_mask

    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(1, 20)))
        offsets = list(zip([0, *cuts], [*cuts, 60], strict=True))
        points = sorted(rng.sample(range(0, 61), 2 * rng.randint(0, 4)))
        spans = [(points[i], points[i + 1]) for i in range(0, len(points), 2)]
        want = [any(s < e2 and e > s2 for s2, e2 in spans) for s, e in offsets]
        assert supervised_mask(np.array(offsets), spans).tolist() == want
    straddle = np.array([(0, 3), (3, 9), (9, 12)])  # "[/INST]" + " Water" + "</s>"
    assert supervised_mask(straddle, [(4, 12)]).tolist() == [False, True, True]
    assert supervised_mask(straddle, [(3, 12)]).tolist() == [False, True, True]
    assert supervised_mask(straddle, []).tolist() == [False] * 3
