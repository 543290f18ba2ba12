"""The CPU training step's settings, measured: micro-batch rows, frozen-weight dtype, threads,
torch.compile and the allocator. LoRA r16/alpha32 fwd+bwd on the demo model.

    PYTHONPATH=src python benchmarks/cpu_step.py [--reps 2] [--steps 3] [--variants ...]

A variant is `key=value,...` over:

- rows: packed 2,048-token rows per micro-batch (7 examples each, segment attention);
- weights: dtype the frozen base is stored in (fp32, cast by autocast at every op, or bf16);
- precision: fp32 or bf16 (autocast);
- threads: torch intra-op threads;
- compile: 1 compiles every transformer block in place (torch.compile; its first step, the
  compile, is reported apart);
- malloc: glibc's mmap threshold in bytes (MALLOC_MMAP_THRESHOLD_; 0 = glibc's default).

Each variant runs in its own process, so its peak RSS is its own; the processes alternate over
`--reps` rounds; medians and the best round are reported (on a shared machine the least
disturbed round is the closest to the truth). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from attention import EXAMPLES, ROW, cpu_name  # benchmarks/attention.py, beside this script

DEFAULTS = {"rows": "1", "weights": "fp32", "precision": "bf16", "threads": "2", "compile": "0"}
DEFAULTS["malloc"] = "0"
VARIANTS = [
    "rows=1",
    "rows=2",
    "rows=4",
    "rows=1,weights=bf16",
    "rows=4,weights=bf16",
    "rows=1,threads=1",
    "rows=1,compile=1",
    "rows=4,malloc=1048576",
]


def parse_variant(text: str) -> dict[str, str]:
    """`text` as a full setting dict (DEFAULTS filled in); unknown keys are an error."""
    out = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown variant key {key!r} in {text!r}; keys: {sorted(DEFAULTS)}")
        out[key] = value
    return out


def batch_for(rows: int, vocab: int) -> dict:
    """`rows` packed rows of 2,048 tokens, the second half of every example supervised."""
    import torch

    from leantune.data.loader import collate
    from leantune.data.packing import Row

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        ids, labels, pos = [], [], []
        for n in EXAMPLES:
            tokens = torch.randint(100, vocab, (n,), generator=g).tolist()
            ids += tokens
            labels += [-100] * (n // 2) + tokens[n // 2 :]
            pos += list(range(n))
        out.append(Row(ids, labels, pos))
    return collate(out, pad_id=0)


def measure(v: dict[str, str], model_name: str, steps: int) -> dict:
    """One process: load, wrap with LoRA, time `steps` fwd+bwd after one warm-up step."""
    import torch

    from leantune.config import MethodConfig
    from leantune.core.precision import autocast
    from leantune.methods.registry import apply_method
    from leantune.models.loading import load_model, resolve_model
    from leantune.models.loss import token_loss_sum

    torch.set_num_threads(int(v["threads"]))
    source = resolve_model(model_name)
    model = load_model(source, dtype=v["weights"], attn_implementation="segments")
    torch.manual_seed(0)
    model = apply_method(model, MethodConfig(name="lora", r=16, alpha=32, dropout=0.0))
    model.train()
    if v["compile"] == "1":
        # Each block in place (as torchtune does): the loss calls the decoder and the head
        # itself, so a torch.compile wrapper around the whole model would never run.
        from leantune.models.loss import _decoder_and_head

        parts = _decoder_and_head(model)
        assert parts is not None
        for layer in parts[0].layers:
            layer.compile()
    rows = int(v["rows"])
    batch = batch_for(rows, int(model.config.vocab_size))
    times, cpu = [], []
    for _ in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        with autocast("cpu", v["precision"]):
            loss = token_loss_sum(model, batch)
        loss.backward()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        model.zero_grad(set_to_none=True)
    step = statistics.median(times[1:])
    step_cpu = statistics.median(cpu[1:])
    return {
        **v,
        "first_step_s": round(times[0], 2),
        "step_s": round(step, 3),
        "tokens_per_s": round(rows * ROW / step, 1),
        # CPU time counts only this process's work: less disturbed by other load than wall time
        # (with one thread; more threads add their spin-waits at OpenMP barriers).
        "tokens_per_cpu_s": round(rows * ROW / step_cpu, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "loss": round(float(loss.detach()), 4),
    }


def run_child(text: str, args: argparse.Namespace) -> dict:
    v = parse_variant(text)
    cmd = [sys.executable, __file__, "--child", text, "--model", args.model]
    cmd += ["--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=v["threads"])
    if v["malloc"] != "0":
        env["MALLOC_MMAP_THRESHOLD_"] = v["malloc"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{text} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rate, per_cpu, rss = result["tokens_per_s"], result["tokens_per_cpu_s"], result["peak_rss_mb"]
    print(f"  {text:28} {rate:7.1f} tok/s {per_cpu:7.1f} tok/cpu-s  {rss} MB", flush=True)
    return result


def summarise(results: list[dict], variants: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for text in variants:
        runs = [r for r in results if r["variant"] == text]
        out[text] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "best_tokens_per_s": max(r["tokens_per_s"] for r in runs),
            "tokens_per_cpu_s": round(statistics.median(r["tokens_per_cpu_s"] for r in runs), 1),
            "first_step_s": round(statistics.median(r["first_step_s"] for r in runs), 2),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "loss": runs[-1]["loss"],
            "runs": len(runs),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process")
    ap.add_argument("--reps", type=int, default=2, help="alternating rounds of every variant")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated variants")
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(parse_variant(args.child), args.model, args.steps)))
        return
    variants = [v for v in args.variants.split(";") if v]
    results = []
    for rep in range(args.reps):
        print(f"round {rep + 1}/{args.reps}", flush=True)
        for text in variants:
            results.append({**run_child(text, args), "variant": text, "rep": rep})
    summary = summarise(results, variants)
    print(
        f"\n{'variant':28} {'tok/s':>7} {'best':>7} {'1st step s':>10} {'peak MB':>8} {'loss':>7}"
    )
    for text, s in summary.items():
        print(
            f"{text:28} {s['tokens_per_s']:7.1f} {s['best_tokens_per_s']:7.1f} "
            f"{s['first_step_s']:10.2f} {s['peak_rss_mb']:8} {s['loss']:7.3f}"
        )
    line = {
        "benchmark": "cpu_step",
        "model": args.model,
        "cpu": cpu_name(),
        "row_tokens": ROW,
        "steps": args.steps,
        "reps": args.reps,
        "results": summary,
        "runs": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(line) + "\n")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
