"""RSS per step with oneDNN's kernel caches at their defaults (1024 entries each) and at
leantune's bound (`core.kernel_caches.CAPACITY`), alternating, on LoRA DPO (pairs from
`leantune bench preference`) or LoRA SFT (the demo data, micro-batch 1).

Per run: RSS after each step (metrics.jsonl `rss_bytes`), the median step time (step 1 left
out: it builds everything), the tokens. The same rows in the same order in both arms, so the
row lengths match step for step. One JSON line last.

    PYTHONPATH=src python benchmarks/kernel_caches.py --objective dpo \
        --pairs runs/bench-pref-128/train_pairs.jsonl --steps 16 --reps 2 --out runs/bench-caches
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from leantune.bench.throughput import run_child
from leantune.core.kernel_caches import CAPACITY, LRU, PRIMITIVES
from leantune.layout import RunPaths
from leantune.monitor.metrics import read_metrics

ARMS = {
    "onednn-default": {PRIMITIVES: "1024", LRU: "1024"},  # what torch runs with unless told
    f"bounded-{CAPACITY}": {PRIMITIVES: str(CAPACITY), LRU: str(CAPACITY)},
}


def command(objective: str, pairs: str | None, steps: int, run_dir: Path) -> list[str]:
    """leantune's LoRA command for `objective`, `steps` optimizer steps, nothing but training."""
    if objective == "dpo":
        if pairs is None:
            sys.exit("--objective dpo needs --pairs (`leantune bench preference` writes them)")
        data = [f"data.train={pairs}", "train.objective=dpo", "train.lr=0.002"]
    else:
        data = ["train.micro_batch_size=1"]  # the demo data: one row length per micro-batch
    return [
        sys.executable, "-m", "leantune", "train", "model.path=smollm2-135m-instruct",
        "method.name=lora", *data, f"train.max_steps={steps}", "data.eval=null",
        "train.eval_exact_match=false", "run.progress=false", "monitor.report=false",
        "run.resume=never", f"run.dir={run_dir}",
    ]  # fmt: skip


def one_run(args: argparse.Namespace, arm: str, rep: int) -> dict[str, Any]:
    run_dir = Path(args.out) / f"{args.objective}-{arm}-{rep}"
    code, peak, wall, tail = run_child(
        command(args.objective, args.pairs, args.steps, run_dir), None, ARMS[arm]
    )
    if code != 0:
        sys.exit(f"{arm} run {rep} failed ({code}):\n{tail}")
    rows = [m for m in read_metrics(RunPaths(run_dir).metrics) if "rss_bytes" in m]
    return {
        "arm": arm,
        "rep": rep,
        "rss_gib": [round(m["rss_bytes"] / 2**30, 3) for m in rows],
        "step_time_s": [round(m["step_time_s"], 3) for m in rows],
        "tokens": [int(m["tokens"]) for m in rows],
        "peak_rss_gib": round(peak / 2**30, 3),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objective", choices=("dpo", "sft"), default="dpo")
    p.add_argument("--pairs", help="DPO pairs (JSONL), e.g. from `leantune bench preference`")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="runs/bench-kernel-caches")
    args = p.parse_args()
    runs = [one_run(args, arm, rep) for rep in range(args.reps) for arm in ARMS]
    print(f"| arm | rep | RSS after step 1 -> 3 -> {args.steps} (GiB) | median step (s) |")
    print("|---|---|---|---|")
    for r in runs:
        rss = r["rss_gib"]
        med = statistics.median(r["step_time_s"][1:])
        print(f"| {r['arm']} | {r['rep']} | {rss[0]} -> {rss[2]} -> {rss[-1]} | {med:.2f} |")
    print(json.dumps({"benchmark": "kernel_caches", "objective": args.objective, "runs": runs}))


if __name__ == "__main__":
    main()
