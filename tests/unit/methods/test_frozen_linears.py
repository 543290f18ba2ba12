"""A frozen base's linear weights stored in the autocast dtype (`methods.frozen`): the same
products as autocast's cast at every forward, so training is bit-identical with less memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import (
    PAIRS,
    _final_weights,
    pref_args,
    run_cli,
    tiny_llama_config,
    tiny_qwen2_config,
    tiny_train_args,
    write_jsonl,
)
from torch import nn
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

import leantune.training.build as build
from leantune.config import MethodConfig
from leantune.methods.frozen import frozen_linears, store_frozen_linears
from leantune.methods.registry import apply_method
from leantune.monitor.metrics import read_metrics


def _names(model: nn.Module, layers: list[nn.Linear]) -> set[str]:
    ids = {id(m) for m in layers}
    return {n for n, m in model.named_modules() if id(m) in ids}


def test_only_frozen_unshared_float_linears_qualify() -> None:
    torch.manual_seed(0)
    qwen = apply_method(Qwen2ForCausalLM(tiny_qwen2_config()), MethodConfig(name="lora"))
    names = _names(qwen, frozen_linears(qwen))
    assert "base_model.model.lm_head" in names  # untied head: used only by its own forward
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer" in names
    assert not any("lora_" in n for n in names)  # trainable adapters stay fp32
    # A tied head shares the embedding's weight, which the embedding lookup reads as fp32.
    llama = apply_method(LlamaForCausalLM(tiny_llama_config()), MethodConfig(name="lora"))
    assert not any(n.endswith("lm_head") for n in _names(llama, frozen_linears(llama)))
    # DoRA computes its magnitude from the float base weight: its bases keep it.
    dora = apply_method(Qwen2ForCausalLM(tiny_qwen2_config()), MethodConfig(name="dora"))
    assert not any("base_layer" in n for n in _names(dora, frozen_linears(dora)))
    # Full fine-tuning: nothing is frozen.
    full = apply_method(Qwen2ForCausalLM(tiny_qwen2_config()), MethodConfig(name="full"))
    assert frozen_linears(full) == []


def test_stored_weights_give_the_same_forward_and_gradients_under_autocast() -> None:
    torch.manual_seed(0)
    a = apply_method(Qwen2ForCausalLM(tiny_qwen2_config()), MethodConfig(name="lora"))
    b = apply_method(Qwen2ForCausalLM(tiny_qwen2_config()), MethodConfig(name="lora"))
    b.load_state_dict(a.state_dict())
    # B = 0 at the start: random adapters, the same in both, so they count in the products.
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if pa.requires_grad:
            with torch.no_grad():
                pa.normal_(0, 0.1)
                pb.copy_(pa)
    freed = store_frozen_linears(b, torch.bfloat16)
    linear = sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in frozen_linears(a)
    )
    assert freed == 2 * linear > 0
    ids = torch.randint(3, 384, (2, 17))
    outs = []
    for model in (a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        outs.append((logits, grads))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys() and outs[0][1]
    for name, grad in outs[0][1].items():
        assert torch.equal(grad, outs[1][1][name]), name


def _no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "store_frozen_linears", lambda model, dtype: 0)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_bf16_lora_run_is_bit_identical_with_the_weights_stored_low(
    tiny_qwen2_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    objective: str,
) -> None:
    """SFT, and DPO whose reference forward runs the same stored weights with adapters off."""
    runs = {}
    for stored in (True, False):
        run = tmp_path / f"run-{stored}"
        if objective == "sft":
            args = tiny_train_args(tiny_qwen2_dir, chat_files[0], run, "train.max_steps=3")
        else:
            pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
            args = pref_args(tiny_qwen2_dir, pairs, run, "dpo", "train.max_steps=3")
        with monkeypatch.context() as m:
            if not stored:
                _no_store(m)
            done = run_cli([*args, "train.precision=bf16", "method.name=lora"])
        assert done.code == 0, done.err
        logged = "frozen linear weights stored in bf16" in done.out + done.err
        assert logged == stored
        runs[stored] = run
    ra, rb = (read_metrics(runs[s] / "metrics.jsonl") for s in (True, False))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb] and len(ra) == 3
    wa, wb = _final_weights(runs[True]), _final_weights(runs[False])
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
