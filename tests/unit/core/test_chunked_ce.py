"""The chunked linear cross-entropy equals the plain one, in value and in gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leantune.core.chunked_ce import linear_cross_entropy_sum


def _plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_value_and_gradients_equal_the_plain_cross_entropy(chunk: int, weight_grad: bool) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(97, 16, generator=g, requires_grad=weight_grad)
    t = torch.randint(0, 97, (50,), generator=g)
    ref = _plain(h, w, t)
    ref.backward(torch.tensor(0.37))
    ref_h, ref_w = h.grad.clone(), (w.grad.clone() if weight_grad else None)  # type: ignore[union-attr]
    h.grad, w.grad = None, None
    got = linear_cross_entropy_sum(h, w, t, chunk=chunk)
    got.backward(torch.tensor(0.37))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)
    if weight_grad:
        torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)
    else:
        assert w.grad is None


def test_under_bf16_autocast_it_stays_close_to_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(300, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 300, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _plain(h, w, t)
    ref.backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    h.grad, w.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy_sum(h, w, t, chunk=16)
    got.backward()
    assert got.dtype == torch.float32 and h.grad.dtype == torch.float32  # type: ignore[union-attr]
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(h.grad, ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, ref_w, rtol=2e-2, atol=2e-2)


def test_without_gradients_it_only_computes_the_loss() -> None:
    h, w = torch.randn(30, 8), torch.randn(20, 8)
    t = torch.randint(0, 20, (30,))
    with torch.no_grad():
        got = linear_cross_entropy_sum(h, w, t, chunk=4)
    torch.testing.assert_close(got, _plain(h, w, t), rtol=1e-6, atol=1e-5)
    assert got.grad_fn is None


def test_bf16_weights_without_autocast_match_autograd() -> None:
    # Frozen weights stored in bf16 (model.dtype=bf16) with train.precision=fp32: the head's
    # matmuls run in bf16 and its gradients come back in bf16, as autograd's would.
    g = torch.Generator().manual_seed(2)
    h = torch.randn(30, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(50, 16, generator=g).bfloat16()
    t = torch.randint(0, 50, (30,), generator=g)
    ref = _plain(h, w, t)
    ref.backward()
    ref_h = h.grad.clone()  # type: ignore[union-attr]
    h.grad = None
    got = linear_cross_entropy_sum(h, w, t, chunk=8)
    got.backward()
    assert h.grad.dtype == torch.bfloat16  # type: ignore[union-attr]
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(h.grad, ref_h, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("scale", "softcap"), [(0.5, None), (1.0, 3.0), (2.0, 5.0)])
@pytest.mark.parametrize("grad", [True, False])
def test_output_transforms_equal_autograd_through_them(
    scale: float, softcap: float | None, grad: bool
) -> None:
    """Scaling (Cohere, Granite) and soft-capping (Gemma 2) inside the chunks: the loss and
    gradients of autograd through `softcap * tanh(scale * z / softcap)`, with logits (~ +-12)
    well into the tanh's bend, where skipping it changes the loss by a lot."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(97, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 97, (50,), generator=g)
    z = F.linear(h, w) * scale
    logits = z if softcap is None else softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(logits, t, reduction="sum")
    assert not torch.allclose(ref, _plain(h, w, t), rtol=0.05)  # the transform matters here
    with torch.set_grad_enabled(grad):
        got = linear_cross_entropy_sum(h, w, t, chunk=16, scale=scale, softcap=softcap)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-5)
    if not grad:
        return
    ref.backward(torch.tensor(0.37))
    ref_h, ref_w = h.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    h.grad, w.grad = None, None
    got.backward(torch.tensor(0.37))
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)


def _frozen_head_under_autocast(chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A LoRA-like head: hidden states that train, a frozen fp32 weight, bf16 autocast."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(70, 32, generator=g, requires_grad=True)
    w = torch.randn(300, 32, generator=g)
    t = torch.randint(0, 300, (70,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(h, w, t, chunk=chunk)
    loss.backward()
    assert h.grad is not None
    return loss, h.grad, w


def test_a_frozen_head_under_autocast_equals_autocasting_every_chunk_bit_for_bit() -> None:
    # What autocast computes when each chunk's products cast the fp32 weight themselves: the
    # weight cast once for all chunks must give the same bits.
    loss, grad_h, w = _frozen_head_under_autocast(chunk=16)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(70, 32, generator=g)
    t = torch.randint(0, 300, (70,), generator=_after(torch.Generator().manual_seed(2)))
    total, rows = torch.zeros(()), []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(0, 70, 16):
            logits = F.linear(h[s : s + 16], w).float()
            lse = torch.logsumexp(logits, dim=-1)
            at = torch.arange(logits.shape[0])
            total += (lse - logits[at, t[s : s + 16]]).sum()
            grad = (logits - lse.unsqueeze(1)).exp()
            grad[at, t[s : s + 16]] -= 1
            rows.append((grad @ w).to(h.dtype))
    assert torch.equal(loss, total)
    assert torch.equal(grad_h, torch.cat(rows))


def _after(g: torch.Generator) -> torch.Generator:
    """`g` after drawing the hidden states and the weight of `_frozen_head_under_autocast`."""
    torch.randn(70, 32, generator=g)
    torch.randn(300, 32, generator=g)
    return g


def test_a_frozen_head_is_cast_once_and_gets_no_weight_sized_gradient_buffer() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _frozen_head_under_autocast(chunk=16)
    weight_sized = [
        e.name
        for e in prof.events()
        if e.name in ("aten::_to_copy", "aten::zeros") and e.input_shapes[:1] == [[300, 32]]
    ]
    # Five chunks: one cast of the weight (not one per product of every chunk), and no fp32
    # accumulator for a gradient the frozen weight does not have.
    assert weight_sized == ["aten::_to_copy"]
