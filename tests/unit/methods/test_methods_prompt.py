"""Prompt-learning methods (prefix, ptuning_v2, prompt) and bottleneck adapters: the loss path and
generation compute what the model computes, packed rows are refused, and the real loop trains."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from support import chat_rows, make_config, prepare_rows, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.config import ConfigError
from leantune.data.loader import collate
from leantune.eval.generation import GREEDY, generate_texts, stop_token_ids
from leantune.eval.perplexity import evaluate_loss
from leantune.methods.artifacts import load_for_inference
from leantune.methods.registry import apply_method, trainable_named_parameters
from leantune.models.loading import enable_gradient_checkpointing
from leantune.models.loss import supervised_logits
from leantune.training.checks import load_config
from leantune.training.recipe import train

PROMPT_METHODS = ["prefix", "ptuning_v2", "prompt"]
PROMPTS = ["Hello world! How are you", "order", "The quick brown fox jumps over the lazy"]


def _perturbed(model_dir: Path, name: str, *extra: str) -> torch.nn.Module:
    """The method applied with its trainable weights moved off their init (as after training)."""
    overrides = [f"method.name={name}", "data.pack=false", "method.num_virtual_tokens=4"]
    cfg = load_config(None, [*overrides, *extra])
    torch.manual_seed(0)
    model = apply_method(AutoModelForCausalLM.from_pretrained(model_dir), cfg.method).eval()
    with torch.no_grad():
        for p in trainable_named_parameters(model).values():
            p.add_(torch.randn_like(p) * 2.0)
    return model


@pytest.mark.parametrize("name", PROMPT_METHODS)
def test_loss_path_equals_the_peft_forward(name: str, tokenizer, tiny_qwen2_dir: Path) -> None:
    model = _perturbed(tiny_qwen2_dir, name)
    rows = [tokenizer(t)["input_ids"] for t in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # right-padded, unpacked
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(width).expand(3, -1)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own forward: deprecated kwargs in transformers 5
        ours = supervised_logits(model, batch)
        reference = model(input_ids=ids).logits[:, -width:][labels != -100]  # prompt: P in front
        with model.disable_adapter():  # type: ignore[operator]  # what the KL term compares to
            disabled = supervised_logits(model, batch)
        base = supervised_logits(model.get_base_model(), batch)  # type: ignore[operator]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(disabled, base)
    assert (ours - base).abs().max() > 1e-2  # the virtual tokens are in effect


def _argmax_loop(model: torch.nn.Module, ids: list[int], n: int, stop: set[int]) -> list[int]:
    """Greedy decoding by full forward passes over the unpadded sequence: the ground truth."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
        if token in stop:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", [*PROMPT_METHODS, "adapter"])
def test_greedy_generate_equals_an_argmax_forward_loop(
    name: str, arch: str, tokenizer, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    # 16 virtual tokens: enough weight in the tiny models' near-uniform attention to change
    # what they generate.
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    model = _perturbed(model_dir, name, "method.num_virtual_tokens=16")
    stop = set(stop_token_ids(tokenizer))
    expected = [
        tokenizer.decode(
            _argmax_loop(model, tokenizer(p)["input_ids"], 8, stop), skip_special_tokens=True
        ).strip()
        for p in PROMPTS
    ]
    # One left-padded batch with a KV cache, as `leantune generate` and exact match run it.
    got = generate_texts(model, tokenizer, PROMPTS, replace(GREEDY, max_new_tokens=8), 3)
    assert got == expected
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = generate_texts(base, tokenizer, PROMPTS, replace(GREEDY, max_new_tokens=8), 3)
    if arch == "qwen2":  # the tied-embedding tiny Llama repeats its last token whatever it sees
        assert got != plain  # the method changes the output: the comparison above means something


@pytest.mark.parametrize("name", PROMPT_METHODS)
def test_packed_rows_are_refused_because_they_compute_something_else(
    name: str, tiny_llama_dir: Path
) -> None:
    with pytest.raises(ConfigError, match=rf"method.name={name} needs data.pack=false"):
        load_config(None, [f"method.name={name}", "data.pack=true"])
    # What a packed row would compute: the second example differs from the same example alone.
    model = _perturbed(tiny_llama_dir, name)
    a, b = [5, 17, 42, 7, 99], [8, 9, 10, 11]

    def logits(ids: list[int], pos: list[int]) -> torch.Tensor:
        t = torch.tensor([ids])
        batch = {"input_ids": t, "labels": t, "position_ids": torch.tensor([pos])}
        return supervised_logits(model, batch)

    with torch.no_grad():
        packed = logits(a + b, [0, 1, 2, 3, 4, 0, 1, 2, 3])
        alone_a, alone_b = logits(a, [0, 1, 2, 3, 4]), logits(b, [0, 1, 2, 3])
    torch.testing.assert_close(packed[:5], alone_a, rtol=1e-5, atol=1e-5)
    assert (packed[5:] - alone_b).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["prefix", "ptuning_v2"])
def test_prefix_methods_refuse_gradient_checkpointing(name: str, tiny_qwen2_dir: Path) -> None:
    with pytest.raises(ConfigError, match=rf"gradient_checkpointing does not work with .*{name}"):
        load_config(
            None, [f"method.name={name}", "data.pack=false", "train.gradient_checkpointing=true"]
        )
    # Why: a checkpointed block runs without the cache that holds the prefix.
    model = _perturbed(tiny_qwen2_dir, name)
    enable_gradient_checkpointing(model)
    model.train()
    ids = torch.tensor([[5, 17, 42, 7]])
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(4)[None]}
    with pytest.raises(RuntimeError, match="size of tensor"):
        supervised_logits(model, batch)


@pytest.mark.parametrize("field", ["adapter_reduction", "num_virtual_tokens", "prefix_hidden_size"])
def test_method_sizes_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"method.{field}: must be >= 1, got 0"):
        load_config(None, ["method.name=prefix", "data.pack=false", f"method.{field}=0"])


def test_prefix_projection_is_the_switch_between_prefix_and_ptuning_v2(
    tiny_llama_dir: Path,
) -> None:
    def kinds(name: str, *extra: str) -> set[str]:
        model = _perturbed(tiny_llama_dir, name, *extra)
        return {n.split("prompt_encoder.default.")[1] for n in trainable_named_parameters(model)}

    mlp = {"embedding.weight", "transform.0.weight", "transform.0.bias"}
    mlp |= {"transform.2.weight", "transform.2.bias"}
    assert kinds("prefix") == mlp
    assert kinds("ptuning_v2") == {"embedding.weight"}
    assert kinds("ptuning_v2", "method.prefix_projection=true") == mlp
    assert kinds("prefix", "method.prefix_projection=false") == {"embedding.weight"}
    model = _perturbed(tiny_llama_dir, "prefix", "method.prefix_hidden_size=24")
    assert model.prompt_encoder.default.transform[0].weight.shape == (
        24,
        32,
    )  # GQA: 2 kv heads x 16


def test_prompt_init_text_starts_from_the_text_embeddings(tokenizer, tiny_llama_dir: Path) -> None:
    cfg = load_config(
        None,
        [
            "method.name=prompt",
            "data.pack=false",
            "method.num_virtual_tokens=6",
            "method.prompt_init_text=order status",
        ],
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    table = base.get_input_embeddings().weight.detach().clone()
    model = apply_method(base, cfg.method)
    ids = tokenizer("order status")["input_ids"]
    ids = (ids * 6)[:6]  # peft repeats the text to fill the virtual tokens
    got = model.prompt_encoder.default.embedding.weight.detach()
    assert len(set(ids)) > 1 and torch.equal(got, table[ids])


@pytest.mark.parametrize("name", ["adapter", *PROMPT_METHODS])
def test_real_loop_trains_and_the_artefact_reloads_to_the_same_eval_loss(
    name: str, tokenizer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(12))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(3, offset=100))
    run_dir = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir,
        train_file,
        run_dir,
        f"method.name={name}",
        "method.num_virtual_tokens=4",
        "data.pack=false",
        f"data.eval={eval_file}",
        "train.lr=null",  # the method's default
        "train.max_steps=3",
        "train.eval_exact_match=true",
        "train.max_new_tokens=8",
        "train.precision=fp32",  # the reloaded model below is evaluated in fp32 too
    )
    summary = train(cfg, log=lambda _: None)
    final = run_dir / "final"
    weights = load_file(run_dir / "checkpoints" / "step-000003" / "model.safetensors")
    marker = "bottleneck_adapters" if name == "adapter" else "prompt_encoder"
    assert weights and all(marker in k for k in weights)
    torch.manual_seed(cfg.train.seed)  # the run's initial trainable weights
    fresh = trainable_named_parameters(
        apply_method(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg.method)
    )
    assert set(fresh) == set(weights)
    assert all(not torch.equal(fresh[k], w) for k, w in weights.items())  # every tensor trained
    model, tok = load_for_inference(str(final))
    if name == "adapter":
        assert (
            json.loads((final / "bottleneck_adapter.json").read_text())["placement"] == "pfeiffer"
        )
    else:  # peft's own format, loadable without leantune
        assert isinstance(model, PeftModel)
        assert PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_llama_dir), final
        )
    data = prepare_rows(eval_file, "chat", tok, 128, pack=False)
    reloaded = evaluate_loss(model, data.rows, int(tok.pad_token_id))
    assert reloaded["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert 0 <= summary["eval_exact_match"] <= 1
    # `leantune generate` on the reloaded artefact (peft inference mode) decodes exactly too.
    stop = set(stop_token_ids(tok))
    expected = [
        tok.decode(_argmax_loop(model, tok(p)["input_ids"], 6, stop), skip_special_tokens=True)
        for p in PROMPTS
    ]
    got = generate_texts(model, tok, PROMPTS, replace(GREEDY, max_new_tokens=6), 3)
    assert got == [e.strip() for e in expected]


def test_collate_of_unpacked_rows_feeds_the_prompt_path(
    tokenizer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Right padding (the unpacked batches of the loop) does not change an example's logits."""
    model = _perturbed(tiny_llama_dir, "prefix")
    rows = prepare_rows(
        write_jsonl(tmp_path / "pad.jsonl", chat_rows(3)),
        "chat",
        tokenizer,
        128,
        pack=False,
    ).rows
    with torch.no_grad():
        together = supervised_logits(model, collate(rows, 0))
        alone = torch.cat([supervised_logits(model, collate([r], 0)) for r in rows])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
