"""Tests for leantune.eval.generation and leantune.eval.exact_match on tiny CPU models.

The batching tests use the tiny Qwen2 (untied lm_head): the tiny Llama ties its embeddings, so
greedy decoding just repeats the last prompt token ("\\n") and every output strips to "", which
would make equality checks pass vacuously.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from support import chain_model, run_cli
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from leantune.eval.exact_match import answers_match, evaluate_exact_match, exact_match_score
from leantune.eval.generation import (
    GREEDY,
    SamplingSettings,
    generate_texts,
    model_sampling,
    render_prompt,
    stop_token_ids,
    with_overrides,
)

# Deliberately not sorted by length, so that the length-sorted batching has to restore the order.
USER_TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "order A-1234",
    "Numbers 0 1 2 3 4 5 6 7 8 9",
    "help me",
]
SHORT_GREEDY = replace(GREEDY, max_new_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the thread
    contention made this file ~10x slower (90 s instead of 8 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerFast) -> list[str]:
    return [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in USER_TEXTS]


def one_by_one(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, prompts: list[str]):
    return [generate_texts(model, tokenizer, [p], SHORT_GREEDY, batch_size=1)[0] for p in prompts]


# ---------------------------------------------------------------------------------------------
# settings, stop tokens, prompt rendering


def test_greedy_constant_and_defaults() -> None:
    assert GREEDY.temperature == 0.0 and GREEDY.repetition_penalty == 1.0 and GREEDY.greedy
    default = SamplingSettings()
    assert (default.max_new_tokens, default.top_p, default.top_k) == (256, 0.9, 0)
    assert default.repetition_penalty == 1.2 and default.greedy
    assert not SamplingSettings(temperature=0.7).greedy


@pytest.mark.parametrize(
    "field,value",
    [("max_new_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1)],
)
def test_sampling_settings_reject_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingSettings(**{field: value})


def test_stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    # eos is <|im_end|> (2); <|endoftext|> (0) is in the vocab; <|eot_id|>, <end_of_turn> are not.
    assert stop_token_ids(tokenizer) == [2, 0]
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[2, 7])) == [2, 0, 7]
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=9)) == [2, 0, 9]


def test_render_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------------------------------------
# batching, padding, order, state


def test_batched_left_padded_greedy_equals_one_by_one(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str]
) -> None:
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert len(set(lengths)) == len(lengths), "prompts must differ in length to need padding"
    expected = one_by_one(qwen2, tokenizer, prompts)
    assert all(expected), "empty outputs would make this comparison vacuous"
    assert len(set(expected)) > 1
    # batch_size=2 gives several batches and a partial last one; 16 puts everything in one.
    for batch_size in (2, 16):
        assert generate_texts(qwen2, tokenizer, prompts, SHORT_GREEDY, batch_size) == expected
    # A different order of the same prompts gives the same outputs in that order.
    reordered = prompts[::-1]
    assert generate_texts(qwen2, tokenizer, reordered, SHORT_GREEDY, 2) == expected[::-1]


def test_missing_pad_token_falls_back_to_eos_and_state_is_restored(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str]
) -> None:
    expected = generate_texts(qwen2, tokenizer, prompts, SHORT_GREEDY, batch_size=16)
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    no_pad.padding_side = "right"
    qwen2.train()
    try:
        assert generate_texts(qwen2, no_pad, prompts, SHORT_GREEDY, batch_size=16) == expected
        assert qwen2.training, "the caller's train mode must be restored"
    finally:
        qwen2.eval()
    assert no_pad.pad_token is None and no_pad.padding_side == "right"


def test_empty_inputs(qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    assert generate_texts(qwen2, tokenizer, [], SHORT_GREEDY) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_texts(qwen2, tokenizer, ["hi", ""], SHORT_GREEDY)
    with pytest.raises(ValueError, match="batch_size"):
        generate_texts(qwen2, tokenizer, ["hi"], SHORT_GREEDY, batch_size=0)


# ---------------------------------------------------------------------------------------------
# stopping


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
def test_generation_stops_at_stop_token(tokenizer: PreTrainedTokenizerFast, stop: str) -> None:
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    newline = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    a, b, c, d = tokenizer.convert_tokens_to_ids(["a", "b", "c", "d"])
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    model = chain_model(tokenizer, {newline: a, a: b, b: c, c: stop_id, stop_id: d, d: d})
    # Control: without stopping, the model goes on past the stop token.
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    raw = model.generate(
        input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=[383], pad_token_id=0
    )
    assert raw[0, ids.shape[1] :].tolist() == [a, b, c, stop_id, d, d]

    out = generate_texts(model, tokenizer, [prompt, "xyz" + prompt], SHORT_GREEDY)
    assert out == ["abc", "abc"]


def test_output_is_cut_at_stop_token_even_if_not_special(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    # A generation_config eos id that is an ordinary token: its text must not leak into the answer.
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    newline = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    a, b, q, d = tokenizer.convert_tokens_to_ids(["a", "b", "q", "d"])
    model = chain_model(tokenizer, {newline: a, a: b, b: q, q: d, d: d})
    model.generation_config.eos_token_id = q
    assert generate_texts(model, tokenizer, [prompt], SHORT_GREEDY) == ["ab"]


# ---------------------------------------------------------------------------------------------
# sampling


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str]
) -> None:
    hot = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, repetition_penalty=1.0)
    rng_before = torch.get_rng_state()
    first = generate_texts(qwen2, tokenizer, prompts, hot, batch_size=2, seed=123)
    assert torch.equal(torch.get_rng_state(), rng_before), "the global RNG must be untouched"
    assert generate_texts(qwen2, tokenizer, prompts, hot, batch_size=2, seed=123) == first
    assert generate_texts(qwen2, tokenizer, prompts, hot, batch_size=2, seed=124) != first
    greedy = generate_texts(qwen2, tokenizer, prompts, SHORT_GREEDY, batch_size=2)
    assert first != greedy
    # Unseeded calls draw from the global stream, so two of them differ.
    unseeded = generate_texts(qwen2, tokenizer, prompts, hot, batch_size=2)
    assert generate_texts(qwen2, tokenizer, prompts, hot, batch_size=2) != unseeded
    # With top_k=1 only the argmax survives, so sampling collapses to greedy decoding.
    top1 = replace(hot, top_k=1)
    assert generate_texts(qwen2, tokenizer, prompts, top1, batch_size=2, seed=5) == greedy


# ---------------------------------------------------------------------------------------------
# decoding settings of `leantune generate`: the model's generation_config, else greedy


def test_model_sampling_follows_the_generation_config() -> None:
    qwen_like = GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    )
    got = model_sampling(qwen_like)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert got.max_new_tokens == 256 and not got.greedy
    assert model_sampling(GenerationConfig(do_sample=True, max_new_tokens=64)) == SamplingSettings(
        max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0
    )  # unset fields: transformers' own defaults


@pytest.mark.parametrize(
    "config",
    [None, GenerationConfig(), GenerationConfig(do_sample=False, temperature=0.6, top_p=0.9)],
    ids=["none", "unset", "do_sample false"],
)
def test_model_sampling_is_greedy_without_do_sample(config: GenerationConfig | None) -> None:
    got = model_sampling(config)
    assert got.greedy and got.repetition_penalty == 1.0 and got.max_new_tokens == 256


def test_model_sampling_names_a_bad_generation_config() -> None:
    with pytest.raises(ValueError, match=r"generation_config: SamplingSettings\.top_p"):
        model_sampling(GenerationConfig(do_sample=True, top_p=1.5))


def test_flags_replace_only_what_they_give() -> None:
    greedy = model_sampling(None)
    assert with_overrides(greedy) == greedy
    assert with_overrides(greedy, max_new_tokens=9) == replace(greedy, max_new_tokens=9)
    hot = with_overrides(greedy, temperature=0.8)
    assert (hot.temperature, hot.top_p, hot.top_k) == (0.8, 1.0, 50)
    # A sampling filter on a greedy model asks for sampling, at transformers' temperature 1.
    assert with_overrides(greedy, top_p=0.9).temperature == 1.0
    assert with_overrides(greedy, top_k=5, temperature=0).greedy
    sampling = model_sampling(GenerationConfig(do_sample=True, temperature=0.7, top_k=20))
    assert with_overrides(sampling, temperature=0).greedy
    assert with_overrides(sampling, top_k=3) == replace(sampling, top_k=3)


def _generate(model: Path, *flags: str) -> str:
    result = run_cli(["generate", "--model", str(model), "--prompt", "hi", *flags])
    assert result.code == 0, result
    return result.out


def test_generate_is_greedy_for_a_model_without_generation_config(tiny_qwen2_dir: Path) -> None:
    """The tiny model's generation_config.json is the one transformers derives from its config
    (no do_sample): replies do not depend on the seed, and equal --temperature 0's."""
    short = ("--max-new-tokens", "12")
    first = _generate(tiny_qwen2_dir, *short, "--seed", "1")
    assert first.strip(), "an empty reply would make the comparison vacuous"
    assert _generate(tiny_qwen2_dir, *short, "--seed", "2") == first
    assert _generate(tiny_qwen2_dir, *short, "--temperature", "0") == first
    # A sampling flag given on the command line samples.
    hot = ("--temperature", "1.5", "--top-k", "0")
    assert _generate(tiny_qwen2_dir, *short, *hot, "--seed", "1") != first


def test_generate_follows_a_sampling_generation_config(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "sampling_model"
    shutil.copytree(tiny_qwen2_dir, model)
    GenerationConfig(
        do_sample=True, temperature=1.5, top_k=0, max_new_tokens=12, eos_token_id=2
    ).save_pretrained(model)
    seeded = {_generate(model, "--seed", str(seed)) for seed in range(3)}
    assert len(seeded) > 1, "sampling from the generation_config: the seed matters"
    greedy = _generate(tiny_qwen2_dir, "--max-new-tokens", "12")
    assert _generate(model, "--temperature", "0") == greedy  # the flag wins


# ---------------------------------------------------------------------------------------------
# exact match


@pytest.mark.parametrize(
    "prediction,reference,expected",
    [
        ('{"b": 2, "a": [1, {"c": null}]}', '{"a": [1, {"c": null}], "b": 2}', True),
        ('  {"a":1}\n', '{"a": 1}', True),
        ('```json\n{"a": 1}\n```', '{"a": 1}', True),
        ('```JSON {"a": 1} ```', '{"a": 1}', True),
        ("```\n[1, 2]\n```", "[1, 2]", True),
        ('{"a": 1', '{"a": 1}', False),
        ('Sure! {"a": 1}', '{"a": 1}', False),
        ('{"a": 1, "b": 2}', '{"a": 1}', False),
        ("[2, 1]", "[1, 2]", False),
        ('{"a": true}', '{"a": 1}', False),
        ("1.0", "1", True),
        ("refund", '"refund"', False),
        ('"refund"', '"refund"', True),
        ("  Paris \n", "Paris", True),
        ("New   York\tCity", "New York City", True),
        ("paris", "Paris", False),
        ("Par is", "Paris", False),
        ('{"a": 1}', "{'a': 1}", False),
        ("{'a': 1}", "{'a': 1}", True),
    ],
)
def test_answers_match(prediction: str, reference: str, expected: bool) -> None:
    assert answers_match(prediction, reference) is expected


def test_exact_match_score() -> None:
    assert exact_match_score(["a", "b", "c", "d"], ["a", "x", " c ", "y"]) == 0.5
    assert exact_match_score(["a"], ["a"]) == 1.0
    assert exact_match_score(["a", "b"], ["x", "y"]) == 0.0
    assert exact_match_score([], []) == 0.0
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        exact_match_score(["a", "b"], ["a"])


def conversations_half_right(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast
) -> tuple[list[list[dict[str, str]]], list[str]]:
    """Conversations whose references are the model's own greedy answers for even indices."""
    histories = [
        [{"role": "user", "content": t}] for t in USER_TEXTS[:3]
    ] + [  # multi-turn: an earlier assistant turn belongs to the prompt
        [
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": '{"intent": "greet"}'},
            {"role": "user", "content": "order A-1234"},
        ]
    ]
    prompts = [render_prompt(tokenizer, h) for h in histories]
    own = generate_texts(model, tokenizer, prompts, SHORT_GREEDY)
    conversations = [
        [*h, {"role": "assistant", "content": own[i] if i % 2 == 0 else "WRONG ANSWER"}]
        for i, h in enumerate(histories)
    ]
    return conversations, own


def test_evaluate_exact_match(qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    conversations, own = conversations_half_right(qwen2, tokenizer)
    score, predictions = evaluate_exact_match(
        qwen2, tokenizer, conversations, batch_size=3, max_new_tokens=12
    )
    assert predictions == own
    references = [c[-1]["content"] for c in conversations]
    assert score == exact_match_score(predictions, references) == 0.5


def test_evaluate_exact_match_rejects_conversation_without_reference(
    qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    with pytest.raises(ValueError, match="conversation 1 must end with the reference assistant"):
        evaluate_exact_match(
            qwen2,
            tokenizer,
            [
                [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                [{"role": "user", "content": "a"}],
            ],
        )


# ---------------------------------------------------------------------------------------------
# peft


# peft's get_peft_model reads transformers' deprecated `is_gradient_checkpointing`.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_works_with_peft_lora_model(
    tiny_qwen2_dir: Path, tokenizer: PreTrainedTokenizerFast, prompts: list[str]
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    base_out = generate_texts(base, tokenizer, prompts, SHORT_GREEDY, batch_size=2)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, lora)
    peft_model.train()
    peft_out = generate_texts(peft_model, tokenizer, prompts, SHORT_GREEDY, batch_size=2)
    assert peft_model.training
    assert peft_out != base_out, "a random (non-identity) adapter must change the outputs"
    assert one_by_one(peft_model, tokenizer, prompts) == peft_out

    conversations, own = conversations_half_right(peft_model, tokenizer)
    score, predictions = evaluate_exact_match(peft_model, tokenizer, conversations, 2, 12)
    assert predictions == own and score == 0.5

    merged = peft_model.merge_and_unload()
    assert generate_texts(merged, tokenizer, prompts, SHORT_GREEDY, batch_size=2) == peft_out
