"""Bottleneck adapters: an exact no-op at init, placement, the documented layout, KL, no merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support import QA_ROWS, prepare_rows, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.data.loader import collate
from leantune.methods.adapter import AdapterSettings, apply_adapter
from leantune.methods.artifacts import load_for_inference, save_final
from leantune.methods.registry import merge_for_inference, trainable_named_parameters
from leantune.models.loss import supervised_logits, token_loss_sum

IDS = torch.tensor([[5, 17, 42, 7, 99, 3]])


def _randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in trainable_named_parameters(model).values():
            torch.nn.init.normal_(p, std=0.2)


@pytest.mark.parametrize("placement", ["houlsby", "pfeiffer"])
def test_fresh_adapters_are_an_exact_no_op(placement: str, tiny_qwen2_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    with torch.no_grad():
        expected = base(input_ids=IDS).logits
        model = apply_adapter(base, AdapterSettings(placement=placement))  # type: ignore[arg-type]
        assert torch.equal(model(input_ids=IDS).logits, expected)


@pytest.mark.parametrize(("placement", "per_block"), [("houlsby", 2), ("pfeiffer", 1)])
def test_placement_and_size(placement: str, per_block: int, tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    apply_adapter(model, AdapterSettings(placement=placement, reduction_factor=16))  # type: ignore[arg-type]
    params = trainable_named_parameters(model)
    sites = {n.rsplit(".", 2)[0] for n in params}
    assert len(sites) == 2 * per_block  # 2 blocks
    expected_sites = {"mlp"} if placement == "pfeiffer" else {"attn", "mlp"}
    assert {s.rsplit(".", 1)[1] for s in sites} == expected_sites
    # hidden 64, bottleneck 64 / 16 = 4: down 64x4 + 4, up 4x64 + 64
    assert sum(p.numel() for p in params.values()) == 2 * per_block * (64 * 4 + 4 + 4 * 64 + 64)
    with pytest.raises(ValueError, match="adapter_reduction=128"):
        apply_adapter(
            AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
            AdapterSettings(reduction_factor=128),
        )


def test_saved_layout_reloads_and_merge_leaves_it_working(
    tokenizer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = apply_adapter(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), AdapterSettings(placement="houlsby")
    ).eval()
    _randomise(model)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    final = save_final(model, tokenizer, tmp_path / "final", str(tiny_llama_dir))
    assert not (final / "model.safetensors").exists()  # only the adapters, not the base
    weights = load_file(final / "bottleneck_adapter.safetensors")
    assert set(weights) == {
        f"layers.{i}.{s}.{p}.{w}"
        for i in (0, 1)
        for s in ("attn", "mlp")
        for p in ("down", "up")
        for w in ("weight", "bias")
    }
    assert weights["layers.1.attn.down.weight"].shape == (4, 64)
    assert all(t.dtype == torch.float32 for t in weights.values())
    reloaded, _ = load_for_inference(str(final))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=1e-6, atol=1e-6)
        merge_for_inference(model)  # non-linear: nothing to merge, the adapters keep running
        assert torch.equal(model(input_ids=IDS).logits, expected)


def test_kl_to_base_is_zero_at_init_and_exact_after_a_change(
    tokenizer, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    model = apply_adapter(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), AdapterSettings()
    ).eval()
    data = prepare_rows(
        write_jsonl(tmp_path / "d.jsonl", QA_ROWS), "chat", tokenizer, 64, pack=True
    )
    batch = collate(data.rows, 0)
    with torch.no_grad():
        assert torch.equal(token_loss_sum(model, batch, 0.5), token_loss_sum(model, batch))
        _randomise(model)
        ce = token_loss_sum(model, batch)
        with_kl = token_loss_sum(model, batch, 0.5)
        log_p = F.log_softmax(supervised_logits(model, batch).float(), -1)
        log_q = F.log_softmax(supervised_logits(base, batch).float(), -1)  # the real base model
        manual = (log_p.exp() * (log_p - log_q)).sum()
    assert manual > 0
    torch.testing.assert_close(with_kl - ce, 0.5 * manual, rtol=1e-4, atol=1e-5)
