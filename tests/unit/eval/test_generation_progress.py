"""Eval and generate respect the user's time: per-answer stopping, the progress line with ETA,
and the exact-match answer cap computed from the references (tiny CPU models)."""

from __future__ import annotations

import copy
import io
import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support import chain_model, chat_rows, run_cli, write_jsonl
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from leantune.eval.exact_match import (
    answer_token_cap,
    evaluate_exact_match,
    exact_match_score,
    longest_answer_tokens,
)
from leantune.eval.generation import GREEDY, generate_texts, render_prompt
from leantune.eval.progress import GenerationProgress
from leantune.monitor.metrics import GenerationBar

TEXTS = ["hi", "order A-1234", "Numbers 0 1 2 3", "help me", "where is my lamp?"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir: Path) -> PreTrainedModel:
    # Untied lm_head: its greedy answers differ between prompts (the tiny Llama's do not).
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr is for a user at a prompt."""

    def isatty(self) -> bool:
        return True


def chats(texts: list[str], answers: list[str]) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": t}, {"role": "assistant", "content": a}]
        for t, a in zip(texts, answers, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# stopping per answer


def test_an_answer_that_ended_stops_contributing_and_the_batch_ends_with_the_last(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    a, b, c, d, e = tokenizer.convert_tokens_to_ids(["a", "b", "c", "d", "e"])
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # After "a" the answer ends at once; after "b" it takes c, d, e first. Past the stop token
    # the chain goes on ("z" forever), so a row that kept decoding would show it.
    model = chain_model(tokenizer, {a: stop, b: c, c: d, d: e, e: stop})
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    events: list[GenerationProgress] = []
    settings = replace(GREEDY, max_new_tokens=30)

    out = generate_texts(model, tokenizer, ["xa", "xb"], settings, on_progress=events.append)

    assert out == ["", "cde"]
    # Four tokens for the longer answer: one forward each, not the 30 max_new_tokens allow.
    assert len(forwards) == 4
    assert [(p.done, p.new_tokens) for p in events] == [(1, 2), (1, 3), (1, 4), (2, 5), (2, 5)]
    # transformers pads a row from its stop token on: the ended row's tail is padding, not "z".
    ids = tokenizer(["xa", "xb"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    raw = model.generate(
        input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=[stop], pad_token_id=0
    )
    assert raw[:, ids.shape[1] :].tolist() == [[stop, 0, 0, 0], [c, d, e, stop]]


# ---------------------------------------------------------------------------------------------
# progress


def test_progress_counts_answers_tokens_and_work_at_every_step(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]
    events: list[GenerationProgress] = []
    settings = replace(GREEDY, max_new_tokens=6)
    plain = generate_texts(qwen2, tokenizer, prompts, settings, batch_size=2)

    got = generate_texts(qwen2, tokenizer, prompts, settings, 2, on_progress=events.append)

    assert got == plain  # watching changes nothing
    # The random model never stops: 3 batches x (6 steps + the batch's end).
    assert len(events) == 3 * 7
    assert [p.work_done for p in events[:7]] == [2, 4, 6, 8, 10, 12, 12]
    # Answers that never stop are done when their batch returns (events 7, 14 and 21).
    assert [p.done for p in events] == [0] * 6 + [2] * 7 + [4] * 7 + [5]
    assert replace(events[-1], elapsed_s=0.0) == GenerationProgress(5, 5, 30, 30, 30)
    assert all(x.elapsed_s <= y.elapsed_s for x, y in itertools.pairwise(events))


def fake_progress(done: int, work: int, tokens: int, start: float = 0.0) -> GenerationProgress:
    """Where a call of 6 prompts x 100 new tokens stands, `start` (monotonic) after it began."""
    return GenerationProgress(done, 6, tokens, work, 600, time.monotonic() - start)


def test_the_bar_shows_examples_tokens_per_s_and_eta_on_a_terminal_only() -> None:
    screen = Terminal()
    bar = GenerationBar("eval", file=screen)
    start = time.monotonic()
    for step in range(1, 11):  # 10 updates over 0.3 s: tqdm's own default would draw each one
        time.sleep(0.03)
        bar(fake_progress(step // 2 + 1, step * 60, step * 10, start))
    bar.close()
    final = screen.getvalue().rsplit("\r", 1)[-1]
    match = re.fullmatch(r"eval: 6/6 examples, (\d+\.\d) tok/s \[00:0\d, ETA 00:00\]\n", final)
    assert match is not None
    assert 0 < float(match.group(1)) <= 100 / 0.3  # 100 tokens in at least 0.3 s
    # Throttled to a line a second: the first and the last.
    assert screen.getvalue().count("eval:") <= 3

    for stream, enabled in ((io.StringIO(), True), (Terminal(), False)):  # a pipe; --quiet
        bar = GenerationBar("eval", enabled=enabled, file=stream)
        bar(fake_progress(1, 100, 100))
        bar.close()
        assert stream.getvalue() == ""


def test_a_slow_step_after_fast_ones_is_drawn() -> None:
    # tqdm's adaptive miniters, grown by fast steps, would skip the clock for the next hundreds
    # of updates: on a long batch, minutes of silence. Every update checks the clock here.
    screen = Terminal()
    bar = GenerationBar("generate", file=screen)
    step, start = 0, time.monotonic()
    while time.monotonic() - start < 1.2:  # fast steps past one redraw, which tunes miniters
        step += 1
        bar(fake_progress(0, step, step, start))
        time.sleep(0.001)
    before = screen.getvalue()
    time.sleep(1.1)
    bar(fake_progress(1, step + 1, step + 1, start))
    assert screen.getvalue() != before
    assert "generate: 1/6 examples" in screen.getvalue() and "ETA" in screen.getvalue()
    bar.close()


# ---------------------------------------------------------------------------------------------
# the exact-match cap


def test_the_cap_is_the_longest_reference_plus_a_margin(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    assert [answer_token_cap(n) for n in (0, 10, 64, 65, 100)] == [16, 26, 80, 82, 125]
    references = ["ok", '{"item": "lamp", "id": 12}', "a b c"]
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references]
    assert longest_answer_tokens(tokenizer, references) == max(lengths) > 1
    assert longest_answer_tokens(tokenizer, []) == 0


def exact_match_run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    conversations: list[list[dict[str, str]]],
    max_new_tokens: int | None,
) -> tuple[float, list[str], GenerationProgress, list[str]]:
    events: list[GenerationProgress] = []
    notes: list[str] = []
    score, predictions = evaluate_exact_match(
        model, tokenizer, conversations, 2, max_new_tokens, events.append, notes.append
    )
    return score, predictions, events[-1], notes


def test_the_cap_comes_from_the_references_and_an_explicit_value_wins(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    answers = ["yes", '{"item": "lamp", "id": 12}', "no", "maybe", "x"]
    longest = longest_answer_tokens(tokenizer, answers)
    conversations = chats(TEXTS, answers)

    _, capped, last, notes = exact_match_run(qwen2, tokenizer, conversations, None)
    cap = answer_token_cap(longest)
    # The random model never stops, so every answer is exactly `cap` tokens of work.
    assert last.work_total == len(TEXTS) * cap == last.new_tokens
    assert notes == [
        f"exact match: answers capped at {cap} new tokens (longest reference {longest} + 16); "
        "max_new_tokens (--max-new-tokens) sets another cap"
    ]

    _, explicit, last, notes = exact_match_run(qwen2, tokenizer, conversations, 5)
    assert last.work_total == len(TEXTS) * 5 and notes == []
    assert explicit != capped


def test_answers_shorter_than_the_cap_score_as_without_it(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    # Make the random model's answers end: the third token each prompt greedily produces
    # becomes a stop token, so every answer ends within three tokens, well under the cap.
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]
    rows = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    third = [
        qwen2.generate(input_ids=torch.tensor([r]), max_new_tokens=3, do_sample=False)[0, -1]
        for r in rows
    ]
    model = copy.deepcopy(qwen2)
    model.generation_config.eos_token_id = sorted({int(t) for t in third})
    answers = generate_texts(model, tokenizer, prompts, replace(GREEDY, max_new_tokens=64))
    references = [a if i % 2 == 0 else "WRONG ANSWER" for i, a in enumerate(answers)]
    conversations = chats(TEXTS, references)

    capped = exact_match_run(model, tokenizer, conversations, None)
    uncapped = exact_match_run(model, tokenizer, conversations, 64)

    cap = capped[2].work_total // len(TEXTS)
    assert cap < 64  # the cap is a real one
    assert capped[:2] == uncapped[:2] == (exact_match_score(answers, references), answers)
    assert capped[0] == 0.6
    # The same tokens were generated: the cap cut none of them.
    assert capped[2].new_tokens == uncapped[2].new_tokens <= 3 * len(TEXTS)


# ---------------------------------------------------------------------------------------------
# the command line


def test_eval_says_the_cap_and_quiet_silences_it(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "held_out.jsonl", chat_rows(3))
    args = ["eval", "--model", str(tiny_qwen2_dir), "--data", str(data), "--batch-size", "3"]
    references = [r["messages"][-1]["content"] for r in chat_rows(3)]
    # The tokenizer as eval loads it (the model's type's class: Qwen2's splits digits).
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    cap = answer_token_cap(longest_answer_tokens(tokenizer, references))

    default = run_cli(args)
    assert default.code == 0
    (note,) = [line for line in default.err.splitlines() if line.startswith("exact match:")]
    assert note.startswith(f"exact match: answers capped at {cap} new tokens")

    explicit = run_cli([*args, "--max-new-tokens", "4"])
    quiet = run_cli([*args, "--quiet"])
    assert explicit.code == quiet.code == 0
    assert "capped" not in explicit.err and "capped" not in quiet.err
    # stdout keeps only the JSON result; the default cap scores like --quiet's (same cap).
    assert json.loads(default.out)["exact_match"] == json.loads(quiet.out)["exact_match"]
