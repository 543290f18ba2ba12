"""Preference data: TRL's pair and unpaired formats read, validated line by line,
tokenised with the real chat templates so that each answer is supervised exactly as SFT
supervises an assistant turn, cut by the truncation rules, and packed padding-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import FAMILIES, family_config, family_tokenizer
from support import write_jsonl
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from leantune.config.parse import ConfigError
from leantune.data.chat_spans import for_template
from leantune.data.errors import DataError
from leantune.data.inspection import render_pair
from leantune.data.preference_dataset import preference_data
from leantune.data.preference_formats import (
    PreferenceRecord,
    UnpairedRecord,
    detect_preference_format,
    read_pairs,
    read_unpaired,
)
from leantune.data.preference_packing import pack_pairs, pack_unpaired, pair_length, unpack
from leantune.data.preference_tokenize import (
    Lengths,
    PreferencePair,
    encode_pairs,
    encode_unpaired_records,
    resolve_lengths,
)
from leantune.data.tokenize import IGNORE_INDEX, encode_chat
from leantune.training.checks import check_config, load_config

_TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {}


def tok(name: str) -> PreTrainedTokenizerFast:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = family_tokenizer(FAMILIES[name])
    return _TOKENIZERS[name]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You answer plant questions in one sentence."}
STANDARD = {
    "prompt": "How often to water a fern?",
    "chosen": "Keep it moist.",
    "rejected": "Never.",
}
CONVERSATIONAL = {
    "prompt": [SYSTEM, user("Is a cactus thirsty?")],
    "chosen": [bot("Water it every two weeks.")],
    "rejected": [bot("Water it daily.")],
}
IMPLICIT = {
    "chosen": [user("Basil?"), bot("Sun and water."), user("How much sun?"), bot("Six hours.")],
    "rejected": [user("Basil?"), bot("Sun and water."), user("How much sun?"), bot("None.")],
}
KTO = {"prompt": "Ivy indoors?", "completion": "Yes, in bright shade.", "label": True}


def test_each_pair_format_is_read_as_prompt_and_two_answers(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [STANDARD, CONVERSATIONAL, IMPLICIT])
    said: list[str] = []
    records, bad = read_pairs(path, log=said.append)
    assert bad == []
    assert [r.kind for r in records] == ["standard", "conversational", "implicit"]
    assert [r.line for r in records] == [1, 2, 3]
    assert records[0].prompt == (user("How often to water a fern?"),)
    assert (records[0].chosen, records[0].rejected) == ((bot("Keep it moist."),), (bot("Never."),))
    assert records[1].prompt == (SYSTEM, user("Is a cactus thirsty?"))
    # Implicit: split at the longest common prefix of messages (TRL's maybe_extract_prompt).
    assert records[2].prompt == tuple(IMPLICIT["chosen"][:3])
    assert (records[2].chosen, records[2].rejected) == ((bot("Six hours."),), (bot("None."),))
    # The form is said once per file, from its first record.
    assert said == [f"{path}: TRL standard preference pairs (prompt, chosen, rejected strings)"]


def test_unpaired_records_and_format_detection(tmp_path: Path) -> None:
    conv = {"prompt": [user("Orchid?")], "completion": [bot("Bright, indirect.")], "label": False}
    kto = write_jsonl(tmp_path / "kto.jsonl", [KTO, conv])
    said: list[str] = []
    records, bad = read_unpaired(kto, system_prompt="Be kind.", log=said.append)
    assert bad == []
    assert records[0] == UnpairedRecord(
        str(kto),
        1,
        ({"role": "system", "content": "Be kind."}, user("Ivy indoors?")),
        (bot("Yes, in bright shade."),),
        True,
    )
    assert records[1].label is False and records[1].completion == (bot("Bright, indirect."),)
    assert len(said) == 1 and "unpaired" in said[0]
    pairs = write_jsonl(tmp_path / "p.jsonl", [IMPLICIT])
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}])
    assert [detect_preference_format(p) for p in (pairs, kto, sft)] == ["preference", "kto", None]


BAD_PAIRS: list[tuple[Any, str]] = [
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "field 'chosen' is empty (empty answer)"),
    ({"prompt": "q", "chosen": [bot("  ")], "rejected": "b"}, "chosen[0].content: empty answer"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical"),
    ({**IMPLICIT, "rejected": IMPLICIT["chosen"]}, "chosen and rejected are identical"),
    (
        {"chosen": [user("a"), bot("b")], "rejected": [user("c"), bot("d")]},
        "chosen and rejected share no prompt (their first messages differ)",
    ),
    (
        {"chosen": [user("a"), bot("b")], "rejected": [user("a"), user("x"), bot("d")]},
        "chosen and rejected first differ at message 1, a user message",
    ),
    (
        {"chosen": [user("a"), bot("b")], "rejected": [user("a"), bot("b"), user("c"), bot("d")]},
        "chosen has no message after the prompt it shares with the other answer",
    ),
    (
        {"chosen": "a b", "rejected": "a c"},
        "missing field 'prompt': chosen and rejected as strings",
    ),
    ({"prompt": "q", "chosen": 5, "rejected": "b"}, "field 'chosen' must be a string or a list"),
    ({"prompt": "q", "rejected": "b"}, "missing field 'chosen'"),
    ({"prompt": "q", "chosen": [user("a")], "rejected": "b"}, "chosen[0].role must be assistant"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "images": ["x.png"]}, "field 'images'"),
    ([1, 2], "expected a JSON object, got list"),
    ("{not json", "invalid JSON"),
]


def test_every_bad_pair_is_a_counted_line_with_its_reason(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [STANDARD, *(row for row, _ in BAD_PAIRS)])
    records, bad = read_pairs(path)
    assert [r.line for r in records] == [1]
    assert [(b.file, b.line) for b in bad] == [(str(path), i + 2) for i in range(len(BAD_PAIRS))]
    for b, (_, reason) in zip(bad, BAD_PAIRS, strict=True):
        assert reason in b.reason, (str(b), reason)
        assert str(b).startswith(f"{path}:{b.line}: ")


def test_every_bad_unpaired_line_is_counted_with_its_reason(tmp_path: Path) -> None:
    rows: list[tuple[Any, str]] = [
        ({**KTO, "label": 1}, "field 'label' must be true or false, got a int"),
        ({**KTO, "label": "true"}, "field 'label' must be true or false, got 'true'"),
        ({"prompt": "q", "completion": "a"}, "missing field 'label'"),
        ({**KTO, "completion": " "}, "field 'completion' is empty (empty answer)"),
        ({**KTO, "prompt": ""}, "field 'prompt' is empty"),
    ]
    path = write_jsonl(tmp_path / "kto.jsonl", [KTO, *(row for row, _ in rows)])
    records, bad = read_unpaired(path)
    assert len(records) == 1
    assert [(b.line, reason in b.reason) for b, (_, reason) in zip(bad, rows, strict=True)] == [
        (i + 2, True) for i in range(len(rows))
    ]


def pair(
    prompt: list[dict[str, str]], chosen: str, rejected: str, line: int = 1
) -> PreferenceRecord:
    return PreferenceRecord(
        "p.jsonl", line, tuple(prompt), (bot(chosen),), (bot(rejected),), "conversational"
    )


def supervised(tokenizer: Any, labels: list[int]) -> str:
    return str(tokenizer.decode([t for t in labels if t != IGNORE_INDEX]))


PLANT_PAIRS = [
    ([SYSTEM, user("How often to water a fern?")], "Keep the soil moist.", "Once a month."),
    ([user("Does basil like sun?")], "Yes, six hours a day.", "No, keep it dark."),
    (
        [user("Repot a monstera?"), bot("In spring."), user("Which pot?")],
        "One size larger, with drainage.",
        "Any glass jar.",
    ),
]


BEFORE_ANSWER = {"qwen3": "<think>\n\n</think>\n\n", "qwen3-moe": "<think>\n\n</think>\n\n"}
"""What a template writes between the generation prompt and a final answer (not supervised)."""


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_answer_is_supervised_as_sft_supervises_it_after_one_shared_prompt(name: str) -> None:
    """With the real templates (Llama 3.1's date lines, Qwen2.5's default system prompt, Gemma
    2 folding the system message, Mistral's answer after "[/INST]" with its space): the
    supervised tokens of each answer decode to exactly the answer and its end of turn; the
    prompt is what the template writes before the answer at inference (the generation prompt,
    and Qwen3's empty think block, which SFT does not supervise either); prompt + answer is
    token for token the SFT encoding of that conversation, less what a template writes after
    the last answer (Phi-3's EOS), which is never supervised."""
    t, fam = tok(name), FAMILIES[name]
    lead = " " if name in ("mistral", "mixtral") else ""
    records = [pair(p, c, r, i + 1) for i, (p, c, r) in enumerate(PLANT_PAIRS)]
    pairs, bad, _ = encode_pairs(t, records)
    assert bad == [] and len(pairs) == len(records)
    for p, rec in zip(pairs, records, strict=True):
        answers = (rec.chosen[0]["content"], rec.rejected[0]["content"])
        assert supervised(t, p.chosen_labels) == lead + answers[0] + fam.end_of_turn
        assert supervised(t, p.rejected_labels) == lead + answers[1] + fam.end_of_turn
        prompt, _ = for_template(t, list(rec.prompt))
        at_inference = t.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert t.decode(p.prompt_ids) == at_inference + BEFORE_ANSWER.get(name, "")
        for answer, messages in (("chosen", rec.chosen), ("rejected", rec.rejected)):
            sft = encode_chat(t, [*rec.prompt, *messages], supervise_from=len(rec.prompt))
            seq = p.sequence(answer)
            n = len(seq.input_ids)
            assert (sft.input_ids[:n], sft.labels[:n]) == (seq.input_ids, seq.labels)
            assert set(sft.labels[n - 1 :]) == {IGNORE_INDEX}
            assert len(sft.input_ids) - n == (1 if name == "phi3" else 0)


def test_an_implicit_pair_that_differs_early_supervises_only_its_answers() -> None:
    """Chosen and rejected differ at the first answer: the user turn after it is context, the
    two answers of each side are supervised with their end of turn."""
    t = tok("qwen2.5")
    rec = PreferenceRecord(
        "p.jsonl",
        1,
        (user("Basil?"),),
        (bot("Sun."), user("More?"), bot("Water.")),
        (bot("Dark."), user("More?"), bot("Ice.")),
        "implicit",
    )
    [p], bad, _ = encode_pairs(t, [rec])
    assert bad == []
    assert supervised(t, p.chosen_labels) == "Sun.<|im_end|>\nWater.<|im_end|>\n"
    assert supervised(t, p.rejected_labels) == "Dark.<|im_end|>\nIce.<|im_end|>\n"
    assert "More?" in t.decode(p.chosen_ids)  # rendered, not learned


def _long_record(t: Any) -> tuple[PreferenceRecord, list[int], list[int]]:
    rec = pair(
        [user("Tell me everything about ferns and their watering.")], "Moist soil always.", "No."
    )
    [p], _, _ = encode_pairs(t, [rec])
    return rec, p.prompt_ids, p.chosen_ids


def test_truncation_keeps_the_end_or_the_start_of_the_prompt_and_the_start_of_answers() -> None:
    t = tok("llama3")
    rec, prompt, chosen = _long_record(t)
    cut = Lengths(max_prompt_len=10, max_completion_len=3, truncation="keep_end")
    [p], bad, resolved = encode_pairs(t, [rec], cut)
    assert bad == [] and resolved == (10, 3)
    assert p.prompt_ids == prompt[-10:] and p.chosen_ids == chosen[:3]
    assert p.chosen_labels == chosen[:3] and len(p.rejected_ids) <= 3
    [p], _, _ = encode_pairs(t, [rec], Lengths(10, 3, "keep_start"))
    assert p.prompt_ids == prompt[:10] and p.chosen_ids == chosen[:3]
    pairs, bad, _ = encode_pairs(t, [rec], Lengths(10, 100, "none"))
    assert pairs == []
    assert [str(b) for b in bad] == [
        f"p.jsonl:1: prompt has {len(prompt)} tokens > max_prompt_len=10 (truncation none)"
    ]
    pairs, bad, _ = encode_pairs(t, [rec], Lengths(200, 2, "none"))
    assert [str(b) for b in bad] == [
        f"p.jsonl:1: chosen has {len(chosen)} tokens > max_completion_len=2 (truncation none)"
    ]


def test_auto_lengths_come_from_the_data_and_are_said() -> None:
    t = tok("qwen2.5")
    rec, prompt, chosen = _long_record(t)
    short = pair([user("Ivy?")], "Shade.", "Sun.", line=2)
    said: list[str] = []
    pairs, bad, resolved = encode_pairs(t, [rec, short], log=said.append)
    assert len(pairs) == 2
    assert bad == [] and resolved == (len(prompt), len(chosen))
    assert said == [
        f"max_prompt_len=auto: {len(prompt)} tokens (longest prompt {len(prompt)} at p.jsonl:1); "
        f"max_completion_len=auto: {len(chosen)} tokens (longest answer {len(chosen)} at "
        "p.jsonl:1); truncation=keep_end"
    ]
    # Within data.max_seq_len each keeps at least half when both do not fit.
    assert resolve_lengths(Lengths(), 300, 100, 1024) == (300, 100)
    assert resolve_lengths(Lengths(), 900, 500, 1024) == (524, 500)
    assert resolve_lengths(Lengths(), 900, 100, 1024) == (900, 100)
    assert resolve_lengths(Lengths(), 900, 900, 1024) == (512, 512)
    assert resolve_lengths(Lengths(max_prompt_len=1000), 900, 900, 1024) == (1000, 24)
    assert resolve_lengths(Lengths(max_completion_len=200), 900, 900, 1024) == (824, 200)


def test_a_record_certainly_too_long_is_dropped_before_tokenising() -> None:
    t = tok("qwen2.5")
    huge = pair([user("fern " * 5000)], "Moist.", "Dry.")
    pairs, bad, _ = encode_pairs(t, [huge], Lengths(truncation="none"), max_seq_len=64)
    assert pairs == [] and "known from its length, without tokenising it" in bad[0].reason


def test_unpaired_examples_are_supervised_like_the_answers_of_pairs(tmp_path: Path) -> None:
    t = tok("gemma2")
    path = write_jsonl(tmp_path / "kto.jsonl", [KTO, {**KTO, "label": False, "completion": "No."}])
    records, _ = read_unpaired(path)
    examples, bad, _ = encode_unpaired_records(t, records)
    assert bad == [] and [e.label for e in examples] == [True, False]
    assert supervised(t, examples[1].completion_labels) == "No.<end_of_turn>\n"
    assert examples[0].sequence() == encode_chat(t, [*records[0].prompt, *records[0].completion])


def _pairs(t: Any) -> list[PreferencePair]:
    records = [pair(p, c, r, i + 1) for i, (p, c, r) in enumerate(PLANT_PAIRS * 3)]
    pairs, _, _ = encode_pairs(t, records)
    return pairs


def test_packing_then_unpacking_gives_back_every_sequence_exactly() -> None:
    pairs = _pairs(tok("qwen2.5"))
    seq_len = 2 * max(pair_length(p) for p in pairs)
    rows = pack_pairs(pairs, seq_len)
    assert len(rows) < len(pairs)  # several pairs share a row
    seen: dict[tuple[int, str], Any] = {}
    for row in rows:
        assert len(row.input_ids) <= seq_len
        assert (
            len(row.labels) == len(row.position_ids) == len(row.segment_ids) == len(row.input_ids)
        )
        for k, s in enumerate(row.segments):
            assert row.position_ids[s.start : s.end] == list(range(s.end - s.start))
            assert row.segment_ids[s.start : s.end] == [k] * (s.end - s.start)
        # Both answers of a pair are in the same row, chosen first.
        answers = [(s.example, s.answer) for s in row.segments]
        assert answers[::2] == [(i, "chosen") for i, _ in answers[1::2]]
        seen.update(unpack(row))
    expected = {(i, a): p.sequence(a) for i, p in enumerate(pairs) for a in ("chosen", "rejected")}
    assert seen == expected
    one_each = pack_pairs(pairs, None)
    assert [len(r.segments) for r in one_each] == [2] * len(pairs)
    assert unpack(one_each[4]) == {(4, a): pairs[4].sequence(a) for a in ("chosen", "rejected")}


def test_unpaired_packing_round_trip() -> None:
    t = tok("mistral")
    records = [
        UnpairedRecord("k", i, (user(f"Q{i}?"),), (bot("A" * (i + 1)),), i % 2 == 0)
        for i in range(6)
    ]
    examples, _, _ = encode_unpaired_records(t, records)
    rows = pack_unpaired(examples, 64)
    got = {k: v for row in rows for k, v in unpack(row).items()}
    assert got == {(i, "completion"): e.sequence() for i, e in enumerate(examples)}


def test_per_sequence_log_probs_of_a_packed_row_equal_the_unpacked_ones() -> None:
    """The model's own forward (float64, so that only the masking could make a difference):
    log-probs summed over each segment of a packed row (restarting positions, no mask) equal
    those of each sequence run alone."""
    t = tok("qwen2.5")
    pairs = _pairs(t)[:3]
    torch.manual_seed(0)
    model = (
        AutoModelForCausalLM.from_config(
            family_config(FAMILIES["qwen2.5"], t), attn_implementation="sdpa"
        )
        .to(torch.float64)
        .eval()
    )

    def logps(ids: list[int], labels: list[int], pos: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False
            ).logits[0]
        target = torch.tensor(labels)
        keep = target != IGNORE_INDEX
        lp = torch.log_softmax(logits, -1).gather(1, target.clamp(min=0)[:, None])[:, 0]
        return lp * keep

    [row] = pack_pairs(pairs, 10_000)
    per_token = logps(row.input_ids, row.labels, row.position_ids)
    sums = torch.zeros(len(row.segments), dtype=torch.float64).index_add_(
        0, torch.tensor(row.segment_ids), per_token
    )
    for k, s in enumerate(row.segments):
        seq = pairs[s.example].sequence(s.answer)
        alone = logps(seq.input_ids, seq.labels, list(range(len(seq.input_ids)))).sum()
        torch.testing.assert_close(sums[k], alone, rtol=1e-9, atol=1e-9)
    assert sums.abs().min() > 0  # every segment has supervised tokens


@pytest.mark.parametrize("fmt", ["preference", "kto"])
def test_preference_formats_with_the_sft_objective_are_refused_naming_the_objective(
    tmp_path: Path, fmt: str
) -> None:
    """Accepted by the schema (not "must be one of"), then refused by name with
    train.objective=sft: preference data trains a preference objective."""
    data = write_jsonl(tmp_path / "d.jsonl", [STANDARD])
    objective = "kto" if fmt == "kto" else "dpo"
    with pytest.raises(ConfigError, match=f"data.format={fmt}: .* train.objective={objective}"):
        check_config(load_config(None, [f"data.train={data}", f"data.format={fmt}"]))


def test_inspect_shows_the_prompt_once_and_each_answers_supervised_span() -> None:
    t = tok("qwen2.5")
    [p], _, _ = encode_pairs(t, [pair([user("Ivy?")], "Shade.", "Sun.")])
    prompt = t.decode(p.prompt_ids)
    assert render_pair(t, p) == "\n".join(
        [
            f"prompt ({len(p.prompt_ids)} tokens):",
            prompt,
            f"chosen ({len(p.chosen_ids)} tokens, {len(p.chosen_ids)} supervised):",
            "[[Shade.<|im_end|>\n]]",
            f"rejected ({len(p.rejected_ids)} tokens, {len(p.rejected_ids)} supervised):",
            "[[Sun.<|im_end|>\n]]",
        ]
    )
    assert prompt.endswith("<|im_start|>user\nIvy?<|im_end|>\n<|im_start|>assistant\n")


def test_a_pair_the_template_cannot_share_a_prompt_for_is_a_bad_line() -> None:
    """A template that writes the prompt depending on the answer (here: the last message's
    length first) gives two prompts, and one that refuses an answer refuses the pair."""
    t = family_tokenizer(FAMILIES["qwen2.5"])
    t.chat_template = (
        "{%- if messages[-1]['content'] == 'Boom.' %}{{ raise_exception('boom') }}{%- endif %}"
        "{{ messages[-1]['content'] | length }}" + FAMILIES["qwen2.5"].template
    )
    records = [
        pair([user("Ivy?")], "Shade.", "Sun.", line=1),
        pair([user("Ivy?")], "Shady.", "Sunny.", line=2),
        pair([user("Ivy?")], "Shade.", "Boom.", line=3),
    ]
    pairs, bad, _ = encode_pairs(t, records)
    assert [p.line for p in pairs] == [2]
    assert [str(b) for b in bad] == [
        "p.jsonl:1: the prompt renders to other tokens before chosen than before rejected (the "
        "chat template writes the prompt depending on the answer)",
        "p.jsonl:3: rejected: the chat template refused the conversation: boom",
    ]


def test_preference_data_is_tokenised_once_and_refuses_mostly_bad_files(tmp_path: Path) -> None:
    t = tok("qwen2.5")
    path = write_jsonl(tmp_path / "pairs.jsonl", [STANDARD, CONVERSATIONAL, IMPLICIT, "{bad"])
    said: list[str] = []
    kw: dict[str, Any] = {"fmt": "preference", "tokenizer": t, "max_bad_fraction": 0.5}
    data = preference_data(path, cache_dir=tmp_path / "cache", log=said.append, **kw)
    assert (len(data.pairs), data.total_lines, [b.line for b in data.bad]) == (3, 4, [4])
    assert len(said) == 2 and said[0].endswith("(prompt, chosen, rejected strings)")
    [cached] = (tmp_path / "cache").iterdir()
    again: list[str] = []
    # From the cache (no tokenizer call), said again, equal.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(t), "__call__", lambda *a, **k: pytest.fail("tokenised again"))
        second = preference_data(path, cache_dir=tmp_path / "cache", log=again.append, **kw)
    assert second == data and again == said and list((tmp_path / "cache").iterdir()) == [cached]
    with pytest.raises(DataError, match=r"1 of 4 lines are bad .*\n  .*pairs.jsonl:4: invalid"):
        preference_data(path, fmt="preference", tokenizer=t)
    kto = write_jsonl(tmp_path / "kto.jsonl", [KTO, KTO])
    with pytest.raises(DataError, match=r"this looks like data.format=kto; use data.format=kto"):
        preference_data(kto, fmt="preference", tokenizer=t)


def test_a_damaged_cache_entry_is_tokenised_again(tmp_path: Path) -> None:
    t = tok("llama3")
    path = write_jsonl(tmp_path / "pairs.jsonl", [STANDARD])
    first = preference_data(path, fmt="preference", tokenizer=t, cache_dir=tmp_path / "c")
    [entry] = (tmp_path / "c").iterdir()
    entry.write_text('{"format": "preference", "pairs": [{"prompt_ids": 1}]}', encoding="utf-8")
    assert preference_data(path, fmt="preference", tokenizer=t, cache_dir=tmp_path / "c") == first
    assert '"pairs": [{"prompt_ids": [' in entry.read_text(encoding="utf-8")
