"""Causal attention of one short bf16 segment as whole-segment matmuls (the segment path's CPU
kernel for short examples).

Torch's CPU flash kernel computes attention in blocks with per-call set-up, and its bf16
backward is slow for short sequences: on a 2-core AVX512-BF16 EPYC under load, one thread, 9
query and 3 KV heads of 64, forward and backward of one segment took (best of 15, alternating)
1.7 ms here against 3.6 ms with flash at 101 tokens, 2.4 against 9.3 at 137 and 9.8 against
12.8 at 256; from about 512 tokens flash wins, and in fp32 it wins at every length. So bf16
segments up to `SHORT_SEGMENT` tokens run as bf16 batched matmuls with the softmax in fp32
(the whole demo step: `benchmarks/step_ab.py`). The scores (segment x segment, fp32) are
transient: backward recomputes them from the row log-sum-exp that forward keeps, so what stays
saved per segment is what the flash kernel saves. Grouped KV heads are not repeated: a KV
head's queries are stacked into one matmul. The scores are bf16 products rounded to bf16
before the fp32 softmax (the flash kernel keeps them in fp32): on a tiny Llama the loss and
gradients stay as close to fp32 as the flash kernel's (tests/unit/models/test_short_attention.py).
"""

from __future__ import annotations

from typing import Any

import torch

SHORT_SEGMENT = 256
"""The longest bf16 segment (tokens) that runs here rather than on the flash kernel."""


def short_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one segment: q (heads, len, dim), k and v (kv heads, len, dim) in;
    (heads, len, dim) out. Any float dtype; the model's path sends bf16 only."""
    out: torch.Tensor = _ShortScaledDotProduct.apply(q, k, v, scale)
    return out


def _scores(qg: torch.Tensor, k: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """Scaled causal scores (kv heads, group x len, len) in fp32 (or the inputs' wider dtype),
    -inf above the diagonal."""
    s = torch.bmm(qg, k.transpose(1, 2))
    s = s.float() if s.element_size() < 4 else s
    above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
    return s.mul_(scale).view(k.shape[0], -1, n, n).masked_fill_(above, float("-inf")).flatten(1, 2)


class _ShortScaledDotProduct(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        h, n, d = q.shape
        qg = q.reshape(k.shape[0], -1, d)  # query head h attends with KV head h // group
        s = _scores(qg, k, scale, n)
        lse = torch.logsumexp(s, -1, keepdim=True)
        out = torch.bmm(s.sub_(lse).exp_().to(v.dtype), v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.view(h, n, d)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        h, n, d = q.shape
        qg = q.reshape(k.shape[0], -1, d)
        g = grad.reshape(out.shape).to(v.dtype)
        p = _scores(qg, k, ctx.scale, n).sub_(lse).exp_()
        grad_v = torch.bmm(p.to(v.dtype).transpose(1, 2), g)
        # The softmax's backward in fp32: dS = P * (dP - rowsum(dO * O)).
        dp = torch.bmm(g, v.transpose(1, 2))
        dp = dp.float() if dp.element_size() < 4 else dp
        wide = torch.float32 if g.element_size() < 4 else g.dtype
        rowsum = (g.to(wide) * out.to(wide)).sum(-1, keepdim=True)
        ds = dp.sub_(rowsum).mul_(p).mul_(ctx.scale).to(q.dtype)
        grad_q = torch.bmm(ds, k).view(h, n, d)
        grad_k = torch.bmm(ds.transpose(1, 2), qg)
        return grad_q, grad_k, grad_v, None
