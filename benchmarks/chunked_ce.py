"""Peak memory and time of the loss on SmolLM2-135M: the whole-batch logits vs chunked.

    PYTHONPATH=src python benchmarks/chunked_ce.py [--tokens 2048] [--supervised 0.7]

Each variant runs in its own process (its peak RSS is its own): one LoRA forward and backward
of a 2,048-token row with 70% of the positions supervised, in the run's precision (bf16 autocast
where this CPU runs it fast, else fp32). `plain` projects every supervised position at once
(n x 49,152 logits, upcast to fp32, and their gradient), `chunked` is leantune's
`linear_cross_entropy_sum`. One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from leantune.bench.throughput import run_child


def child(impl: str, tokens: int, supervised: float, precision: str) -> dict[str, float]:
    from leantune.core.chunked_ce import linear_cross_entropy_sum
    from leantune.core.precision import autocast
    from leantune.methods.registry import apply_method
    from leantune.models.loading import load_model, resolve_model
    from leantune.models.loss import supervised_hidden
    from leantune.training.checks import load_config

    torch.manual_seed(0)
    model = apply_method(
        load_model(resolve_model("smollm2-135m-instruct")), load_config(None, []).method
    )
    ids = torch.randint(0, 49152, (1, tokens))
    labels = ids.clone()
    labels[:, : int(tokens * (1 - supervised))] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(tokens)[None]}
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with autocast("cpu", precision):
            found = supervised_hidden(model, batch)
            assert found is not None
            hidden, head = found
            t = labels[labels != -100]
            if impl == "plain":
                loss = F.cross_entropy(head(hidden).float(), t, reduction="sum")
            else:
                loss = linear_cross_entropy_sum(hidden, head.weight, t)
        loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"loss": float(loss), "step_s": min(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--supervised", type=float, default=0.7)
    p.add_argument("--child", choices=("plain", "chunked"))
    p.add_argument("--precision", default=None)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.tokens, a.supervised, a.precision)))
        return
    from leantune.core.precision import resolve_precision

    precision = a.precision or resolve_precision("auto", "cpu", None, "auto").precision
    results: dict[str, list[dict[str, float]]] = {}
    for impl in ("plain", "chunked", "plain", "chunked"):  # alternating
        cmd = [sys.executable, __file__, "--child", impl, "--tokens", str(a.tokens),
               "--supervised", str(a.supervised), "--precision", precision]  # fmt: skip
        code, rss, _, out = run_child(cmd, os.cpu_count() or 1)
        assert code == 0, out
        row = json.loads(out.strip().splitlines()[-1])
        results.setdefault(impl, []).append({**row, "peak_rss_bytes": rss})
    summary = {
        impl: {
            "peak_rss_gib": min(r["peak_rss_bytes"] for r in rows) / 2**30,
            "loss_fwd_bwd_s": min(r["step_s"] for r in rows),
            "loss": rows[0]["loss"],
        }
        for impl, rows in results.items()
    }
    print(
        f"precision {precision}, {a.tokens} tokens, {a.supervised:.0%} supervised", file=sys.stderr
    )
    for impl, r in summary.items():
        line = (
            f"{impl:8s} peak RSS {r['peak_rss_gib']:.2f} GiB, fwd+bwd {r['loss_fwd_bwd_s']:.2f} s"
        )
        print(line, file=sys.stderr)
    print(json.dumps({"benchmark": "chunked_ce", "precision": precision, "tokens": a.tokens,
                      "supervised": a.supervised, "results": summary}))  # fmt: skip


if __name__ == "__main__":
    main()
