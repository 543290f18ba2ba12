"""Cross-entropy through the output projection, a chunk of positions at a time.

For n supervised positions the vocab logits are n x V (49k for SmolLM2): in fp32, with their
gradient, 2 x 4 x n x V bytes (0.8 GB at n = 1,000), the largest tensors of a step. Here the
projection, the loss and its gradients run `chunk` positions at a time inside one autograd
function (the approach of Liger-Kernel's fused linear cross-entropy): the forward computes each
chunk's loss and, at once, its gradients with respect to the hidden states and the projection
weight, and keeps only those; no logits survive a chunk. There is no recomputation, so the cost
is the same matmuls as the plain path.

A model's output transform (`models.output_head`: Cohere's and Granite's scaling, Gemma 2's
soft-capping `cap * tanh(z / cap)`) runs inside each chunk, and its derivative with it
(`scale * (1 - tanh^2)`), so those models keep the chunked path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK = 256
"""Positions per chunk: 256 x 49k fp32 logits are 50 MB, and the matmuls stay large."""


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        needs_w = weight.requires_grad
        grad_h = torch.empty_like(hidden)
        # fp32 accumulator: the weight gradient is a sum over every chunk, and summing bf16
        # partial products would lose the small ones. None for a frozen weight (LoRA's head):
        # zeroing a vocab x hidden fp32 buffer took 1.6% of the demo's LoRA step.
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if needs_w
            else None
        )
        w_mm = _as_autocast_casts(weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # One row index for every chunk (sliced for the last, shorter one).
        rows = torch.arange(chunk, device=targets.device)
        # The gradients are computed here, in the forward, so that no chunk's logits have to be
        # kept (or recomputed) for the backward.
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            # The matmul in bf16 under autocast, as the head's; the transform in fp32.
            logits, tanh = _transformed(F.linear(h, w_mm).float(), scale, softcap)
            lse = torch.logsumexp(logits, dim=-1)
            at = rows[: t.shape[0]]
            total += (lse - logits[at, t]).sum()  # CE = logsumexp - the target's logit
            # Consumes `logits` (in place), so it comes after every read of them.
            grad = _ce_grad(logits, lse, at, t, tanh, scale)
            # In the weight's dtype (bf16 frozen weights without autocast), or bf16 under
            # autocast: as autograd's backward of the head would compute them.
            g = grad if grad.dtype == weight.dtype else grad.to(weight.dtype)
            grad_h[start : start + chunk] = (g @ w_mm).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.t() @ h.to(g.dtype)).float()
            # Free this chunk's V-wide tensors before the next chunk allocates its own, so the
            # peak holds one chunk's logits, not two.
            del logits, grad, tanh
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.weight_dtype = weight.dtype if needs_w else None
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        grad_h, grad_w = ctx.saved_tensors
        # The output is a scalar sum, so the chain rule only scales the saved gradients.
        gw = None if ctx.weight_dtype is None else (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h * grad_out.to(grad_h.dtype), gw, None, None, None, None


def _as_autocast_casts(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as autocast's matmuls would cast it, cast once for every chunk: autocast caches
    the cast of a trained leaf weight, but casts a frozen one again at every product (two per
    chunk, each a vocab x hidden copy). The same values: the matmuls then cast nothing more."""
    kind = weight.device.type
    if not torch.is_autocast_enabled(kind) or not weight.is_floating_point():
        return weight
    dtype = torch.get_autocast_dtype(kind)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _ce_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    at: torch.Tensor,
    t: torch.Tensor,
    tanh: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """d(sum CE)/dz of a chunk (z: the projection's output; the logits are its transform):
    softmax - one_hot, times the transform's derivative. Consumes `logits` and `tanh`."""
    # In place, in the logits' own memory: a second chunk x V fp32 buffer is what the chunking
    # exists to avoid.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax = exp(z - logsumexp(z))
    grad[at, t] -= 1
    if tanh is not None:  # d(cap * tanh(x / cap))/dx = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1))
    if scale != 1.0:
        grad.mul_(scale)
    return grad


def _transformed(
    z: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`softcap * tanh(scale * z / softcap)` of fp32 logits `z` (in `z`'s memory where it can)
    and the tanh, which the gradient needs; without soft-capping, `scale * z` and None."""
    if scale != 1.0:
        z = z.mul_(scale)
    if softcap is None:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = CHUNK,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """`cross_entropy(f(hidden @ weight.T), targets, reduction="sum")` in fp32, `chunk` rows at
    a time: the same value and gradients (to float rounding) without the n x V logits.

    `f` is the model's output transform: `softcap * tanh(scale * z / softcap)`, or `scale * z`
    when `softcap` is None (the identity by default)."""
    # The autograd function's forward also computes the gradients; without a backward to come
    # (evaluation, or nothing trainable upstream) that work is skipped.
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, scale, softcap)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):  # evaluation: the loss only
        z = F.linear(hidden[start : start + chunk], weight).float()
        logits, _ = _transformed(z, scale, softcap)
        total += F.cross_entropy(logits, targets[start : start + chunk], reduction="sum")
    return total


class _LinearTokenLogps(torch.autograd.Function):
    """log p(target) of each row, a chunk of rows at a time, without the n x V logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        # A row's gradient with respect to its hidden state is its upstream gradient times a
        # fixed vector, so with a frozen head (adapters) the forward keeps those vectors (the
        # size of the hidden states) and the backward only scales them. A trained head needs the
        # upstream gradient inside each row's outer product, so then the backward recomputes
        # each chunk's logits (one more matmul).
        frozen = not weight.requires_grad
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if frozen else None
        rows = torch.arange(chunk, device=targets.device)
        mm_dtype = weight.dtype
        w_mm = _as_autocast_casts(weight)
        for start in range(0, hidden.shape[0], chunk):
            t = targets[start : start + chunk]
            z = F.linear(hidden[start : start + chunk], w_mm)
            mm_dtype = z.dtype  # bf16 under autocast: the backward recomputes in it
            logits, tanh = _transformed(z.float(), scale, softcap)
            lse = torch.logsumexp(logits, dim=-1)
            at = rows[: t.shape[0]]
            out[start : start + chunk] = logits[at, t] - lse
            if d_hidden is not None:  # d log p / dz = -(d CE / dz)
                g = _ce_grad(logits, lse, at, t, tanh, scale).neg_()
                d_hidden[start : start + chunk] = (g.to(weight.dtype) @ w_mm).to(hidden.dtype)
        if d_hidden is not None:
            ctx.save_for_backward(d_hidden)
        else:
            ctx.save_for_backward(hidden, weight, targets)
        ctx.frozen, ctx.chunk, ctx.scale, ctx.softcap, ctx.mm_dtype = (
            frozen,
            chunk,
            scale,
            softcap,
            mm_dtype,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        if ctx.frozen:
            (d_hidden,) = ctx.saved_tensors
            return d_hidden * grad_out.unsqueeze(1).to(d_hidden.dtype), None, None, None, None, None
        hidden, weight, targets = ctx.saved_tensors
        # Recomputed in the forward's matmul dtype (bf16 under autocast), so the logits match
        # the ones the forward measured.
        w = weight.to(ctx.mm_dtype)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        rows = torch.arange(ctx.chunk, device=targets.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk].to(ctx.mm_dtype)
            t = targets[start : start + ctx.chunk]
            logits, tanh = _transformed(F.linear(h, w).float(), ctx.scale, ctx.softcap)
            lse = torch.logsumexp(logits, dim=-1)
            g = _ce_grad(logits, lse, rows[: t.shape[0]], t, tanh, ctx.scale)
            g = g.mul_(grad_out[start : start + ctx.chunk].float().neg().unsqueeze(1)).to(w.dtype)
            grad_h[start : start + ctx.chunk] = (g @ w).to(hidden.dtype)
            grad_w += (g.t() @ h).float()
        return grad_h, grad_w.to(weight.dtype), None, None, None, None


def linear_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = CHUNK,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """`log_softmax(f(hidden @ weight.T))[i, targets[i]]` for each row i, in fp32, `chunk` rows
    at a time: the per-token log-probs a preference loss sums per sequence, with the same values
    and gradients (to float rounding) as the plain computation, without the n x V logits.

    `f` is the model's output transform, as for `linear_cross_entropy_sum`."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out: torch.Tensor = _LinearTokenLogps.apply(hidden, weight, targets, chunk, scale, softcap)
        return out
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):  # the reference pass: values only
        z = F.linear(hidden[start : start + chunk], weight).float()
        logits, _ = _transformed(z, scale, softcap)
        t = targets[start : start + chunk]
        out[start : start + chunk] = logits.gather(1, t.unsqueeze(1)).squeeze(1) - torch.logsumexp(
            logits, dim=-1
        )
    return out
