"""The demo's exact match: leantune's against transformers' own `generate` batched by hand.

    PYTHONPATH=src python benchmarks/eval_speed.py [--model smollm2-135m-instruct] [--limit 100]
        [--batch-size 50] [--max-new-tokens N] [--reps 1] [--out FILE]

Both arms decode the same examples (the demo's held-out file by default) with the same loaded
model, greedily, with the same most new tokens per answer (by default leantune eval's cap: the
longest reference answer's tokens + max(16, 25%)), one after the other in each repetition:

- `leantune`: `evaluate_exact_match`, what `leantune eval` and the demo's exact match run
  (length-sorted left-padded batches, a KV cache, every end-of-turn token stops an answer);
- `hf`: what a user writes by hand: the same rendered prompts in file order, `batch_size` at a
  time, `tokenizer(..., padding=True)` on the left, `model.generate(max_new_tokens=...,
  do_sample=False)` with the model's own eos tokens, the new tokens decoded and scored the same way.

After one untimed warm-up answer per arm, the arms alternate which goes first. Reported per
arm: the median wall time over the repetitions, answers per second, the new tokens
it generated, and its exact match; then leantune's time over HF's (target <= 1.0, issue 35).
A readable table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from leantune.eval.exact_match import (
    answer_token_cap,
    evaluate_exact_match,
    exact_match_score,
    longest_answer_tokens,
)
from leantune.eval.generation import render_prompt
from leantune.eval.progress import GenerationProgress
from leantune.methods.artifacts import load_for_inference
from leantune.models.quiet import quiet_libraries

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cpu_name

DEMO_DATA = Path(__file__).resolve().parents[1] / "src/leantune/demo/data/support_eval.jsonl"


def conversations(path: Path, limit: int) -> list[list[dict[str, str]]]:
    """The first `limit` conversations of a chat JSONL file, each ending with its answer."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["messages"] for row in rows[:limit]]


def run_leantune(
    model: Any, tokenizer: Any, convs: list[list[dict[str, str]]], batch: int, cap: int
) -> dict[str, Any]:
    """leantune's exact match, timed; the tokens it generated, counted by its progress."""
    last: list[GenerationProgress] = []
    start = time.perf_counter()
    score, _ = evaluate_exact_match(model, tokenizer, convs, batch, cap, last.append)
    return {"s": time.perf_counter() - start, "exact_match": score, "tokens": last[-1].new_tokens}


def run_hf(
    model: Any, tokenizer: Any, convs: list[list[dict[str, str]]], batch: int, cap: int
) -> dict[str, Any]:
    """transformers' generate batched by hand on the same prompts, timed and scored alike."""
    prompts = [render_prompt(tokenizer, c[:-1]) for c in convs]
    references = [c[-1]["content"] for c in convs]
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    predictions: list[str] = []
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            enc = tokenizer(
                prompts[i : i + batch],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,  # the rendered prompt holds them already
            )
            out = model.generate(**enc, max_new_tokens=cap, do_sample=False, pad_token_id=pad)
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                # generate pads an ended answer; the answer is what comes before its stop.
                end = next((j for j, t in enumerate(row) if t in stops), len(row))
                tokens += min(end + 1, len(row))
                predictions.append(tokenizer.decode(row[:end], skip_special_tokens=True).strip())
    seconds = time.perf_counter() - start
    return {
        "s": seconds,
        "exact_match": exact_match_score(predictions, references),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the demo's)")
    p.add_argument("--data", type=Path, default=DEMO_DATA, help="chat JSONL (default: demo's)")
    p.add_argument("--limit", type=int, default=100, help="examples (the demo evaluates 100)")
    p.add_argument("--batch-size", type=int, default=50, help="the demo's eval_batch_size")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: leantune's cap")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    quiet_libraries()
    model, tokenizer = load_for_inference(args.model, args.dtype)
    model.eval()
    convs = conversations(args.data, args.limit)
    longest = longest_answer_tokens(tokenizer, [c[-1]["content"] for c in convs])
    cap = args.max_new_tokens if args.max_new_tokens is not None else answer_token_cap(longest)
    arms = {"leantune": run_leantune, "hf": run_hf}
    # Warm-up, untimed: the first forward passes pay for allocations and one-off set-up.
    for run in arms.values():
        run(model, tokenizer, convs[:1], 1, 2)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for rep in range(args.reps):
        # Alternating which arm goes first: a machine whose load drifts favours neither.
        for name in list(arms)[:: 1 if rep % 2 == 0 else -1]:
            runs[name].append(arms[name](model, tokenizer, convs, args.batch_size, cap))

    medians = {
        name: {
            "s": statistics.median(r["s"] for r in rows),
            "exact_match": rows[-1]["exact_match"],
            "tokens": rows[-1]["tokens"],
        }
        for name, rows in runs.items()
    }
    print(f"{len(convs)} examples, batch {args.batch_size}, at most {cap} new tokens, greedy")
    print(f"{'arm':<10}{'s':>9}{'answers/s':>11}{'tokens':>8}{'exact':>7}")
    for name, a in medians.items():
        rate = len(convs) / a["s"]
        print(f"{name:<10}{a['s']:>9.2f}{rate:>11.2f}{a['tokens']:>8}{a['exact_match']:>7.2f}")
    result = {
        "benchmark": "eval_speed",
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "model": args.model,
        "dtype": args.dtype,
        "examples": len(convs),
        "batch_size": args.batch_size,
        "max_new_tokens": cap,
        "longest_reference_tokens": longest,
        "reps": args.reps,
        "leantune_s": round(medians["leantune"]["s"], 3),
        "hf_s": round(medians["hf"]["s"], 3),
        "leantune_over_hf": round(medians["leantune"]["s"] / medians["hf"]["s"], 3),
        "leantune_exact_match": medians["leantune"]["exact_match"],
        "hf_exact_match": medians["hf"]["exact_match"],
        "leantune_tokens": medians["leantune"]["tokens"],
        "hf_tokens": medians["hf"]["tokens"],
        "date": time.strftime("%Y-%m-%d"),
    }
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
