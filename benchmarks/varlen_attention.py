"""Segment attention against torch's varlen flash attention on packed rows (CUDA).

    PYTHONPATH=src python benchmarks/varlen_attention.py [--rows 4] [--iters 20]
    PYTHONPATH=src python benchmarks/varlen_attention.py --cpu-layout-check

leantune's segment attention (`leantune.models.attention.segment_attention_forward`) runs one
causal SDPA call per example of a packed row. `torch.nn.attention.varlen.varlen_attn` runs the
whole batch's examples in one flash-attention kernel from cumulative sequence offsets; it is
CUDA-only (torch 2.13), and would become the CUDA path for packed rows if it wins.

Both get the same inputs in the layout transformers hands an attention function, (batch, heads,
seq, dim) with grouped KV heads, in bf16 and fp16: rows of 2,048 tokens, each packed with the
same 7 examples as `benchmarks/attention.py`, for two head layouts (SmolLM2-135M: 9 query / 3 KV
heads of 64; Qwen2.5-1.5B: 12 / 2 of 128). Reported per case: the median forward and
forward+backward time over `--iters` (CUDA events, after warm-up), the speed-up, and the largest
difference of the outputs and of the input gradients between the two, next to each one's
difference from an fp32 reference (the segment path in fp32), so that "equal" means "as close
as the kernels' own rounding". Prints a table and ends with one JSON line.

Without CUDA it prints why it skipped and exits 0. `--cpu-layout-check` runs the layout code
(the packing into varlen's (tokens, heads, dim), the offsets, the unpacking) on CPU in fp32,
with per-example SDPA standing in for the varlen kernel, and fails on any difference: what a
CUDA run then tests is the kernel alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from leantune.models.attention import segment_attention_forward

EXAMPLES = [412, 361, 330, 297, 260, 222, 166]
"""Seven example lengths that fill one 2,048-token row (benchmarks/attention.py's spread)."""
HEADS = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
"""name: (query heads, KV heads, head dim)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


class Layer(torch.nn.Module):
    """What the attention function reads from its module: causal, grouped KV heads."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """leantune's segment attention: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    batch, _, seq, _ = q.shape
    pos = torch.cat([torch.arange(n, device=q.device) for n in lengths]).expand(batch, seq)
    layer = Layer(q.shape[1] // k.shape[1])
    out, _ = segment_attention_forward(layer, q, k, v, None, position_ids=pos)
    return out


def offsets(lengths: list[int], rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """varlen's cumulative offsets (int32, starting at 0) over every row's examples, and the
    longest example."""
    all_lengths = torch.tensor(lengths * rows, dtype=torch.int32)
    cu = torch.zeros(len(all_lengths) + 1, dtype=torch.int32)
    cu[1:] = all_lengths.cumsum(0)
    return cu.to(device), max(lengths)


def varlen_layout(kernel: Callable[..., Any]) -> Attention:
    """The varlen path around `kernel` (`varlen_attn`'s signature): (batch, heads, seq, dim)
    in, (batch, seq, heads, dim) out, as `segments`."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        batch, heads, seq, dim = q.shape
        cu, longest = offsets(lengths, batch, q.device)

        def packed(x: torch.Tensor) -> torch.Tensor:  # (tokens, heads, dim): rows end to end
            return x.transpose(1, 2).reshape(batch * seq, x.shape[1], dim)

        out = kernel(
            packed(q), packed(k), packed(v), cu, cu, longest, longest,
            window_size=(-1, 0), enable_gqa=heads != k.shape[1],
        )  # fmt: skip
        return out.view(batch, seq, heads, dim)

    return attend


def sdpa_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    window_size: tuple[int, int],
    enable_gqa: bool,
) -> torch.Tensor:
    """`varlen_attn` on CPU for the layout check: causal SDPA per example of (tokens, heads,
    dim)."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k)
    bounds = cu_q.tolist()
    assert max(b - a for a, b in itertools.pairwise(bounds)) == max_q == max_k
    parts = []
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=enable_gqa)
        parts.append(o[0].transpose(0, 1))
    return torch.cat(parts, dim=0)


def inputs(
    rows: int, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of `rows` packed 2,048-token rows, and the upstream gradient of the output."""
    hq, hkv, dim = heads
    seq = sum(EXAMPLES)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, h, seq, dim, generator=g) for h in (hq, hkv, hkv))
    grad = torch.randn(rows, seq, hq, dim, generator=g)
    return tuple(x.to(device, dtype) for x in (q, k, v, grad))  # type: ignore[return-value]


def run(
    attend: Attention, tensors: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of q, k and v for the upstream gradient."""
    q, k, v, grad = (t.detach().requires_grad_(i < 3) for i, t in enumerate(tensors))
    out = attend(q, k, v, EXAMPLES)
    out.backward(grad)
    return out.detach(), [t.grad for t in (q, k, v)]  # type: ignore[misc]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def median_ms(fn: Callable[[], Any], iters: int) -> float:
    """The median of `iters` timed calls after 3 warm-up ones (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(
    name: str, precision: str, rows: int, iters: int, varlen: Attention, device: torch.device
) -> dict[str, Any]:
    """One (head layout, precision) case: times and differences."""
    tensors = inputs(rows, HEADS[name], DTYPES[precision], device)
    reference = run(segments, tuple(t.float() for t in tensors))
    seg, var = run(segments, tensors), run(varlen, tensors)
    row: dict[str, Any] = {"heads": name, "precision": precision, "tokens": rows * sum(EXAMPLES)}
    for label, (out, grads) in (("segments", seg), ("varlen", var)):
        row[f"{label}_out_vs_fp32"] = max_diff(out, reference[0])
        row[f"{label}_grad_vs_fp32"] = max(map(max_diff, grads, reference[1]))
    row["out_diff"] = max_diff(seg[0], var[0])
    row["grad_diff"] = max(map(max_diff, seg[1], var[1]))
    q, k, v, _ = tensors
    for label, attend in (("segments", segments), ("varlen", varlen)):

        def forward(a: Attention = attend) -> None:
            with torch.no_grad():
                a(q, k, v, EXAMPLES)

        def forward_backward(a: Attention = attend) -> None:
            run(a, tensors)

        row[f"{label}_fwd_ms"] = median_ms(forward, iters)
        row[f"{label}_fwd_bwd_ms"] = median_ms(forward_backward, iters)
    row["speedup_fwd_bwd"] = row["segments_fwd_bwd_ms"] / row["varlen_fwd_bwd_ms"]
    return row


def layout_check() -> int:
    """The layout code on CPU in fp32, the varlen kernel replaced by per-example SDPA."""
    worst = 0.0
    for name, heads in HEADS.items():
        tensors = inputs(2, heads, torch.float32, torch.device("cpu"))
        (out_a, grads_a), (out_b, grads_b) = (
            run(segments, tensors),
            run(varlen_layout(sdpa_stand_in), tensors),
        )
        diff = max(max_diff(out_a, out_b), *map(max_diff, grads_a, grads_b))
        print(f"{name}: segments vs the varlen layout (SDPA stand-in), fp32: max diff {diff:.2e}")
        worst = max(worst, diff)
    ok = worst < 1e-5
    print(json.dumps({"benchmark": "varlen_attention", "cpu_layout_check": ok, "max_diff": worst}))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=4, help="packed 2,048-token rows per batch")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--cpu-layout-check", action="store_true", help="the layout code on CPU")
    args = ap.parse_args()
    if args.cpu_layout_check:
        return layout_check()
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        skip = f"torch {torch.__version__} has no torch.nn.attention.varlen (added in 2.10)"
        print(f"skipped: {skip}")
        print(json.dumps({"benchmark": "varlen_attention", "skipped": skip}))
        return 0
    if not torch.cuda.is_available():
        skip = (
            f"no CUDA device (torch {torch.__version__}): varlen_attn is CUDA-only; "
            "--cpu-layout-check tests the layout code on CPU"
        )
        print(f"skipped: {skip}")
        print(json.dumps({"benchmark": "varlen_attention", "skipped": skip}))
        return 0
    device = torch.device("cuda")
    varlen = varlen_layout(varlen_attn)
    rows = [
        compare(name, precision, args.rows, args.iters, varlen, device)
        for name in HEADS
        for precision in DTYPES
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rows} rows x 2048")
    print(
        f"{'heads':13} {'prec':4} {'seg fwd':>8} {'var fwd':>8} {'seg f+b':>8} {'var f+b':>8} "
        f"{'speedup':>7} {'out diff':>9} {'grad diff':>9} {'seg/fp32':>9} {'var/fp32':>9}"
    )
    for r in rows:
        print(
            f"{r['heads']:13} {r['precision']:4} {r['segments_fwd_ms']:8.2f} "
            f"{r['varlen_fwd_ms']:8.2f} {r['segments_fwd_bwd_ms']:8.2f} "
            f"{r['varlen_fwd_bwd_ms']:8.2f} {r['speedup_fwd_bwd']:6.2f}x {r['out_diff']:9.2e} "
            f"{r['grad_diff']:9.2e} {r['segments_out_vs_fp32']:9.2e} {r['varlen_out_vs_fp32']:9.2e}"
        )
    print(
        json.dumps(
            {"benchmark": "varlen_attention", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
