"""The short-segment kernel (`models.short_attention`): exact attention in fp64, and on a tiny
model in bf16 autocast as close to fp32 as the flash kernel it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import tiny_llama_config
from transformers import LlamaForCausalLM

import leantune.models.attention as attention
from leantune.data.loader import collate
from leantune.data.packing import pack_examples
from leantune.data.tokenize import Example
from leantune.models.attention import register_segment_attention
from leantune.models.loss import token_loss_sum
from leantune.models.short_attention import short_causal


@pytest.mark.parametrize(("heads", "kv_heads", "n"), [(6, 2, 17), (4, 4, 9), (3, 1, 1)])
def test_equals_causal_sdpa_in_fp64(heads: int, kv_heads: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    shapes = [(heads, n, 8), (kv_heads, n, 8), (kv_heads, n, 8)]
    inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grad = torch.randn(heads, n, 8, generator=g, dtype=torch.float64)

    def run(fn: object) -> list[torch.Tensor]:
        x = [t.clone().requires_grad_() for t in inputs]
        out = fn(*x)  # type: ignore[operator]
        out.backward(grad)
        return [out.detach()] + [t.grad for t in x]

    got = run(lambda q, k, v: short_causal(q, k, v, 0.3))
    want = run(
        lambda q, k, v: F.scaled_dot_product_attention(
            q[None], k[None], v[None], scale=0.3, is_causal=True, enable_gqa=True
        )[0]
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    examples = []
    for n in [21, 40, 9, 33, 25]:
        ids = torch.randint(3, 384, (n,), generator=g).tolist()
        examples.append(Example(ids, [-100, *ids[1:]]))
    return collate(pack_examples(examples, seq_len=64), pad_id=0)


def _loss_and_grads(model: torch.nn.Module, bf16: bool) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = token_loss_sum(model, _batch())
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), torch.cat(grads)


def test_bf16_model_as_close_to_fp32_as_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loss and every gradient of a packed batch under bf16 autocast, with the short kernel and
    with the flash kernel, against fp32 (flash): the short kernel's error is at most the flash
    kernel's (with a margin for rounding luck), and it did run."""
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    cfg.num_key_value_heads = 2
    model = LlamaForCausalLM(cfg).train()
    model.set_attn_implementation(register_segment_attention())
    calls = []
    monkeypatch.setattr(attention, "short_causal", lambda *a: calls.append(1) or short_causal(*a))
    ref_loss, ref_grads = _loss_and_grads(model, bf16=False)
    short_loss, short_grads = _loss_and_grads(model, bf16=True)
    assert calls  # bf16 segments of <= SHORT_SEGMENT tokens took the short kernel
    monkeypatch.setattr(attention, "SHORT_SEGMENT", 0)
    calls.clear()
    flash_loss, flash_grads = _loss_and_grads(model, bf16=True)
    assert not calls
    assert short_loss != flash_loss  # two kernels, not one path twice
    loss_err = [abs(x - ref_loss) / abs(ref_loss) for x in (short_loss, flash_loss)]
    grad_err = [
        float((x - ref_grads).norm() / ref_grads.norm()) for x in (short_grads, flash_grads)
    ]
    assert loss_err[0] < 5e-3 and grad_err[0] < 5e-2  # bf16's own rounding
    assert loss_err[0] <= 2 * loss_err[1] + 1e-4
    assert grad_err[0] <= 1.5 * grad_err[1]


@pytest.mark.parametrize("short", [True, False])
def test_one_cast_per_layer_is_bit_identical(monkeypatch: pytest.MonkeyPatch, short: bool) -> None:
    """q, k and v cast to bf16 once per layer give the same loss and gradients, bit for bit, as
    autocast's casts at every segment's kernel call (with either kernel)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).train()
    model.set_attn_implementation(register_segment_attention())
    if not short:
        monkeypatch.setattr(attention, "SHORT_SEGMENT", 0)
    once = _loss_and_grads(model, bf16=True)
    cast = attention._autocast_once
    kernel = attention._segment_kernel

    def per_segment(*args: object) -> attention.Kernel:
        inner = kernel(*args)  # type: ignore[arg-type]
        return lambda q, k, v: inner(*cast(q, k, v))

    monkeypatch.setattr(attention, "_autocast_once", lambda *t: t)
    monkeypatch.setattr(attention, "_segment_kernel", per_segment)
    each = _loss_and_grads(model, bf16=True)
    assert once[0] == each[0]
    assert torch.equal(once[1], each[1])
