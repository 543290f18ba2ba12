"""Every method in the registry: trains only its own parameters, saves, reloads to equal logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from support import QA_ROWS, prepare_rows, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.core.optim import build_optimizer
from leantune.data.loader import collate
from leantune.methods.adapter import BLOCK_ATTR
from leantune.methods.artifacts import load_for_inference, save_final
from leantune.methods.registry import (
    BASE_QUANTIZATION,
    METHODS,
    PROMPT_LEARNING_METHODS,
    apply_method,
    base_quantization,
    trainable_named_parameters,
)
from leantune.models.loading import ModelSource, load_model
from leantune.training.checks import load_config
from leantune.training.trainer import backward_window

# The parameter kinds each adapter method trains (peft names), and nothing else.
EXPECTED_KINDS = {
    "lora": {"lora_A", "lora_B"},
    "dora": {"lora_A", "lora_B", "lora_magnitude_vector"},
    "qlora": {"lora_A", "lora_B"},
    "ia3": {"ia3_l"},
    "adapter": {BLOCK_ATTR},
    "prefix": {"prompt_encoder"},
    "ptuning_v2": {"prompt_encoder"},
    "prompt": {"prompt_encoder"},
}
KIND_MARKERS = ("prompt_encoder", BLOCK_ATTR)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_trains_its_parameters_and_round_trips(
    name: str, tokenizer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    pack = name not in PROMPT_LEARNING_METHODS  # virtual tokens need unpacked rows
    cfg = load_config(None, [f"method.name={name}", f"data.pack={str(pack).lower()}"])
    torch.manual_seed(0)
    if name in BASE_QUANTIZATION and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip(f"{name} needs bitsandbytes")
    # Loaded as the recipe loads it (qlora quantises the base while loading).
    quant = base_quantization(cfg.method, "fp32")  # the steps below run in fp32
    model = apply_method(
        load_model(ModelSource(str(tiny_llama_dir)), quantization=quant), cfg.method
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = trainable_named_parameters(model)
    kinds = {
        next((c for c in n.split(".") if c.startswith(("lora_", "ia3_")) or c in KIND_MARKERS), n)
        for n in params
    }
    if name == "full":
        assert set(params) == set(before)
    elif name == "freeze":  # defaults: last 2 blocks (all of the tiny model's) and the norms
        assert all(".layers." in n or "norm" in n for n in params)
        assert not any("embed_tokens" in n for n in params)
    else:
        assert kinds == EXPECTED_KINDS[name], kinds
    data = prepare_rows(
        write_jsonl(tmp_path / "d.jsonl", QA_ROWS), "chat", tokenizer, 64, pack=pack
    )
    opt = build_optimizer(params, lr=1e-2, weight_decay=0.0)
    model.train()
    for _ in range(3):
        backward_window(model, [collate(data.rows, 0)], torch.device("cpu"), "fp32")
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (n in params), f"{name}: {n} moved={moved}"

    save_final(model, tokenizer, tmp_path / "final", str(tiny_llama_dir), quantization=quant)
    reloaded, _ = load_for_inference(str(tmp_path / "final"))
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_freeze_trains_only_the_last_blocks_and_norms(tiny_qwen2_dir: Path) -> None:
    from leantune.methods.freeze import apply_freeze

    model = apply_freeze(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), 1, norms=True)
    params = trainable_named_parameters(model)
    assert any(n.startswith("model.layers.1.") for n in params)
    assert not any(n.startswith("model.layers.0.") and "norm" not in n for n in params)
    assert "model.norm.weight" in params and "model.layers.0.input_layernorm.weight" in params
    assert "lm_head.weight" not in params and "model.embed_tokens.weight" not in params
    only_blocks = apply_freeze(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), 1, False)
    assert all(n.startswith("model.layers.1.") for n in trainable_named_parameters(only_blocks))
    with pytest.raises(ValueError, match="only 2 blocks"):
        apply_freeze(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), 3, True)


def test_kl_to_base_is_zero_at_init_and_exact_after_a_change(
    tokenizer, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    import torch.nn.functional as F

    from leantune.models.loss import supervised_logits, token_loss_sum

    cfg = load_config(None, ["method.name=lora"])
    model = apply_method(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), cfg.method).eval()
    data = prepare_rows(
        write_jsonl(tmp_path / "d.jsonl", QA_ROWS), "chat", tokenizer, 64, pack=True
    )
    batch = collate(data.rows, 0)
    with torch.no_grad():
        # A fresh LoRA (B = 0) is the base model: the KL term is exactly zero.
        assert torch.equal(token_loss_sum(model, batch, 0.5), token_loss_sum(model, batch))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
        ce = token_loss_sum(model, batch)
        with_kl = token_loss_sum(model, batch, 0.5)
        log_p = F.log_softmax(supervised_logits(model, batch).float(), -1)
        with model.disable_adapter():
            log_q = F.log_softmax(supervised_logits(model, batch).float(), -1)
        manual = (log_p.exp() * (log_p - log_q)).sum()
    assert manual > 0
    torch.testing.assert_close(with_kl - ce, 0.5 * manual, rtol=1e-4, atol=1e-5)


def test_kl_needs_an_adapter_method() -> None:
    from leantune.config import ConfigError

    with pytest.raises(ConfigError, match=r"train\.kl_coef needs an adapter method"):
        load_config(None, ["method.name=full", "train.kl_coef=0.1"])
