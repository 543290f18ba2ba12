"""Attention on packed rows: the block-mask path against segment attention, LoRA fwd+bwd.

    PYTHONPATH=src python benchmarks/attention.py [--model smollm2-135m-instruct] [--steps 3]

The issue-14 probe: 2,048 tokens per step on the demo model (SmolLM2-135M), LoRA r16/alpha32
on every linear layer, in these layouts:

- one packed row of 7 examples, sdpa: transformers builds the block-diagonal row x row mask
  and SDPA computes the whole row (the path before `model.attn_implementation=segments`);
- the same row, segments: causal SDPA per example (`leantune.models.attention`);
- four 512-token rows, one example each (causal sdpa, no mask): the target;
- one 2,048-token row, one example (causal sdpa, no mask): for scale.

in fp32 and bf16 autocast. Each (layout, precision) runs in its own process, so that its peak
RSS is its own; the processes alternate over `--reps` rounds and the medians (and the best
round's tokens/s) are reported. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

ROW = 2048
EXAMPLES = [412, 361, 330, 297, 260, 222, 166]
"""Seven example lengths that fill one 2,048-token row (a realistic spread)."""
LAYOUTS = {
    "packed_sdpa": ("one packed 2048 row, 7 examples (block mask)", "sdpa"),
    "packed_segments": ("one packed 2048 row, 7 examples (segments)", "segments"),
    "rows_4x512": ("four 512 rows (causal, no mask)", "sdpa"),
    "row_2048": ("one 2048 row, one example (causal, no mask)", "sdpa"),
}
PRECISIONS = ("fp32", "bf16")


def batch_for(layout: str, vocab: int) -> dict[str, torch.Tensor]:
    """2,048 tokens in `layout`, the second half of every example supervised (an answer)."""
    from leantune.data.loader import collate
    from leantune.data.packing import Row

    assert sum(EXAMPLES) == ROW
    g = torch.Generator().manual_seed(0)
    groups = {"rows_4x512": [[512]] * 4, "row_2048": [[ROW]]}.get(layout, [EXAMPLES])
    rows = []
    for lengths in groups:
        ids, labels, pos = [], [], []
        for n in lengths:
            tokens = torch.randint(100, vocab, (n,), generator=g).tolist()
            ids += tokens
            labels += [-100] * (n // 2) + tokens[n // 2 :]
            pos += list(range(n))
        rows.append(Row(ids, labels, pos))
    return collate(rows, pad_id=0)


def rss_mb() -> float:
    """Resident set size now, MB."""
    from leantune.core.process_memory import current_rss_bytes

    return current_rss_bytes() / 2**20


def measure(layout: str, precision: str, model_name: str, steps: int) -> dict:
    """One process: load, wrap with LoRA, time `steps` fwd+bwd after one warm-up step."""
    from leantune.config import MethodConfig
    from leantune.core.precision import autocast
    from leantune.methods.registry import apply_method, count_parameters
    from leantune.models.loading import load_model, resolve_model
    from leantune.models.loss import token_loss_sum

    attn = LAYOUTS[layout][1]
    model = load_model(resolve_model(model_name), attn_implementation=attn)
    torch.manual_seed(0)
    model = apply_method(model, MethodConfig(name="lora", r=16, alpha=32, dropout=0.0))
    model.train()
    batch = batch_for(layout, int(model.config.vocab_size))
    loaded = rss_mb()
    times, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with autocast("cpu", precision):
            loss = token_loss_sum(model, batch)
        loss.backward()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        model.zero_grad(set_to_none=True)
    step = statistics.median(times[1:])
    trainable, _ = count_parameters(model)
    return {
        "layout": layout,
        "precision": precision,
        "step_s": round(step, 3),
        "tokens_per_s": round(ROW / step, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "loaded_rss_mb": round(loaded),
        "loss": round(losses[-1], 4),
        "trainable": trainable,
    }


def run_child(layout: str, precision: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", layout, precision, "--model", args.model]
    cmd += ["--steps", str(args.steps)]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{layout} {precision} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def summarise(results: list[dict]) -> dict[str, dict]:
    """Medians over the rounds, by `layout/precision`."""
    out: dict[str, dict] = {}
    for key in {f"{r['layout']}/{r['precision']}" for r in results}:
        runs = [r for r in results if f"{r['layout']}/{r['precision']}" == key]
        out[key] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            # On a shared machine the least disturbed round is the closest to the truth.
            "best_tokens_per_s": max(r["tokens_per_s"] for r in runs),
            "step_s": round(statistics.median(r["step_s"] for r in runs), 3),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "loaded_rss_mb": max(r["loaded_rss_mb"] for r in runs),
            "loss": runs[-1]["loss"],
            "runs": len(runs),
        }
    return out


def print_table(summary: dict[str, dict]) -> None:
    print(
        f"\n{'layout':48} {'prec':5} {'tok/s':>7} {'best':>7} {'step s':>7} "
        f"{'peak RSS MB':>12} {'loss':>9}"
    )
    for layout, (title, _) in LAYOUTS.items():
        for precision in PRECISIONS:
            s = summary.get(f"{layout}/{precision}")
            if s is None:
                continue
            print(
                f"{title:48} {precision:5} {s['tokens_per_s']:7.1f} "
                f"{s['best_tokens_per_s']:7.1f} {s['step_s']:7.2f} "
                f"{s['peak_rss_mb']:12} {s['loss']:9.3f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process")
    ap.add_argument("--reps", type=int, default=1, help="alternating rounds of every process")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the measured processes, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc "
        "then returns freed activations at once, so peak RSS follows the live memory)",
    )
    ap.add_argument("--child", nargs=2, metavar=("LAYOUT", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.model, args.steps)))
        return
    layouts, precisions = args.layouts.split(","), args.precisions.split(",")
    results = []
    for rep in range(args.reps):
        for precision in precisions:
            for layout in layouts:
                r = run_child(layout, precision, args)
                print(
                    f"round {rep + 1}: {layout} {precision}: {r['tokens_per_s']} tok/s, "
                    f"peak RSS {r['peak_rss_mb']} MB",
                    flush=True,
                )
                results.append(r)
    report(summarise(results), precisions, args)


def report(summary: dict[str, dict], precisions: list[str], args: argparse.Namespace) -> None:
    """The table, the ratios against the block-mask baseline, then one JSON line."""
    print_table(summary)
    ratios = {}
    for precision in precisions:
        old = summary.get(f"packed_sdpa/{precision}")
        new = summary.get(f"packed_segments/{precision}")
        if old and new:
            ratios[precision] = {
                "speedup": round(new["tokens_per_s"] / old["tokens_per_s"], 2),
                "peak_rss_ratio": round(new["peak_rss_mb"] / old["peak_rss_mb"], 2),
            }
            print(
                f"{precision}: segments {ratios[precision]['speedup']}x the block-mask path's "
                f"tokens/s, peak RSS {ratios[precision]['peak_rss_ratio']}x"
            )
    line = {
        "benchmark": "attention",
        "model": args.model,
        "method": "lora r16 alpha32, every linear layer",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tokens_per_step": ROW,
        "examples": EXAMPLES,
        "steps": args.steps,
        "reps": args.reps,
        "baseline": "packed_sdpa",
        "env": args.env,
        "results": summary,
        "segments_vs_block_mask": ratios,
    }
    print(json.dumps(line, sort_keys=True))


if __name__ == "__main__":
    main()
