"""One QLoRA step at Qwen2.5-7B's shape (random weights), against its matmul bound, with the
dequantisation of the 4-bit base timed apart and every step's time recorded.

    PYTHONPATH=src python benchmarks/qlora_step.py [--shape 7b] [--steps 6] [--seq 512]

The model is built from config (`leantune.bench.model_shapes`, the published vocabulary, the
demo tokenizer; nothing downloaded), loaded and quantised to NF4 as `leantune train` does
(`load_model` with `base_quantization`, then `apply_method`), and trained `--steps` optimizer
steps of `--batch` rows of `--seq` random tokens with the trainer's own `backward_window`. At
7B, loading and quantising take minutes and ~6 GiB: run nothing else meanwhile; `--shape tiny`
or `0.5b` check the script in seconds.

Reported: load + quantise time; per step its seconds, its time over the matmul bound (the
step's matmul FLOPs at the peak measured in this run, in the precision the step computes in),
the RSS and the page faults it took (a step that is 2-3x its neighbour shows there whether
memory was being mapped in); one full dequantisation of the base, timed alone, and how many of
them a step needs (forward, and backward for the input gradient; a third forward with
gradient checkpointing). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from leantune.bench.model_shapes import SHAPES, build_model, parameter_count
from leantune.bench.throughput import cpu_name, flops_per_token, matmul_peak
from leantune.core.optim import build_optimizer
from leantune.core.precision import resolve_precision
from leantune.core.process_memory import current_rss_bytes
from leantune.data.loader import collate
from leantune.data.packing import Row
from leantune.methods.registry import apply_method, base_quantization, trainable_named_parameters
from leantune.models.demo_model import ensure_demo_model
from leantune.models.loading import load_model, resolve_model
from leantune.training.checks import load_config
from leantune.training.trainer import backward_window


def random_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[Row]:
    """`n` rows of `seq` random tokens, every position supervised (labels stored shifted)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=gen).tolist()
        rows.append(Row(ids, [*ids[1:], -100], list(range(seq))))
    return rows


def dequantise_all(model: torch.nn.Module) -> tuple[float, int]:
    """Seconds to dequantise every 4-bit weight of `model` once (what one pass over the base
    costs before its matmuls), and how many weights that was."""
    import bitsandbytes.functional as bnbf

    weights = [
        m.weight
        for m in model.modules()
        if getattr(getattr(m, "weight", None), "quant_state", None) is not None
    ]
    start = time.perf_counter()
    for w in weights:
        bnbf.dequantize_4bit(w.data, w.quant_state)
    return time.perf_counter() - start, len(weights)


def _faults() -> tuple[int, int]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_minflt, u.ru_majflt


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else ensure_demo_model()
    work = Path(args.work)
    model_dir = build_model(args.shape, work / f"model-{args.shape}-{tokenizer_dir.name}",
                            tokenizer_dir)  # fmt: skip
    precision = resolve_precision(args.precision, "cpu", None, "auto").precision
    cfg = load_config(None, ["method.name=qlora", f"model.path={model_dir}"])
    started = time.perf_counter()
    model = load_model(resolve_model(str(model_dir)),
                       quantization=base_quantization(cfg.method, precision))  # fmt: skip
    torch.manual_seed(0)
    model = apply_method(model, cfg.method)
    load_s = time.perf_counter() - started
    opt = build_optimizer(trainable_named_parameters(model), 2e-4, 0.0, "adamw", "cpu")
    model.train()
    vocab = int(model.config.vocab_size)
    rows = random_rows(args.steps * args.batch, args.seq, vocab)
    peaks = {p: matmul_peak(p, args.threads) for p in ("fp32", "bf16")}
    tokens = args.batch * args.seq
    flops = flops_per_token(str(model_dir), "lora", args.seq) * tokens
    bound_s = flops / (peaks[precision] * 1e9)
    steps = []
    for step in range(args.steps):
        batches = [collate(rows[step * args.batch + i : step * args.batch + i + 1], 0)
                   for i in range(args.batch)]  # fmt: skip
        faults = _faults()
        start = time.perf_counter()
        loss = backward_window(model, batches, torch.device("cpu"), precision)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        minor, major = (a - b for a, b in zip(_faults(), faults, strict=True))
        steps.append({
            "step": step + 1, "seconds": round(seconds, 3),
            "over_bound": round(seconds / bound_s, 2), "loss": round(loss, 4),
            "rss_gib": round(current_rss_bytes() / 2**30, 2),
            "minor_faults": minor, "major_faults": major,
        })  # fmt: skip
        print(json.dumps(steps[-1]), flush=True)
    dequant_s, n_weights = dequantise_all(model)
    passes = 2 * args.batch  # forward and backward per micro-batch (no checkpointing here)
    later = [s["seconds"] for s in steps[1:]] or [steps[0]["seconds"]]
    median = statistics.median(later)
    return {
        "benchmark": "qlora_step",
        "shape": args.shape,
        "weights": "random",
        "parameters": parameter_count(model_dir),
        "cpu": cpu_name(),
        "threads": args.threads,
        "precision": precision,
        "tokens_per_step": tokens,
        "load_and_quantise_s": round(load_s, 1),
        "matmul_peak_gflops": {k: round(v, 1) for k, v in peaks.items()},
        "matmul_bound_s": round(bound_s, 3),
        "median_step_s": round(median, 3),
        "median_over_bound": round(median / bound_s, 2),
        "slowest_over_fastest": round(max(later) / min(later), 2),
        "dequantise_once_s": round(dequant_s, 3),
        "dequantised_weights": n_weights,
        "dequantise_per_step_s": round(dequant_s * passes, 3),
        "dequantise_share_of_step": round(dequant_s * passes / median, 3),
        "steps": steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps, each timed")
    ap.add_argument("--batch", type=int, default=1, help="rows (micro-batches of 1) per step")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--work", default="runs/qlora-step", help="the built model's folder")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the demo's)")
    result = run(ap.parse_args())
    r = result
    print(f"\n{r['shape']} QLoRA, random weights, {r['precision']}, {r['tokens_per_step']} tokens")
    print(f"per step, load + quantise {r['load_and_quantise_s']} s")
    print("| step | s | x bound | RSS GiB | minor faults | major faults |")
    print("|---|---|---|---|---|---|")
    for s in r["steps"]:
        cells = ("step", "seconds", "over_bound", "rss_gib", "minor_faults", "major_faults")
        print("| " + " | ".join(str(s[c]) for c in cells) + " |")
    print(
        f"matmul bound {r['matmul_bound_s']} s, median step {r['median_step_s']} s "
        f"({r['median_over_bound']}x); dequantising the base once {r['dequantise_once_s']} s, "
        f"twice per row: {r['dequantise_share_of_step']:.0%} of the median step"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
