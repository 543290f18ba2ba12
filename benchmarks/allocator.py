"""CPU allocators on leantune's own training run: glibc's malloc, jemalloc (its defaults and
PyTorch's CPU launcher's settings) and tcmalloc, alternating, on `leantune bench throughput`'s
corpus and command (128 generated conversations, LoRA r16/alpha32 or full, lr 2e-4, 1 epoch).

Per run: useful tokens/s, peak RSS (wait4), each step's time and RSS, the last losses (the same
for every allocator: the allocator changes no arithmetic). One JSON line last.

    PYTHONPATH=src python benchmarks/allocator.py --reps 2 --method lora \
        --variants glibc,tcmalloc --out runs/bench-allocator
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from leantune.bench.chat_corpus import write_corpus
from leantune.bench.throughput import leantune_command, run_child
from leantune.core.allocator import ENV, find_tcmalloc, library_dirs
from leantune.layout import RunPaths
from leantune.models.loading import load_tokenizer, resolve_model
from leantune.monitor.metrics import read_metrics
from leantune.monitor.summary import finished_summary

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2
RUN_CPU_MALLOC_CONF = (  # torch.backends.xeon.run_cpu's, for jemalloc
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,"
    "dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"
)


def variants() -> dict[str, dict[str, str]]:
    """Each variant's environment over this one (leantune's own choice switched off where
    another allocator is measured)."""
    return {
        "glibc": {ENV: "system"},
        "jemalloc": {ENV: "system", "LD_PRELOAD": JEMALLOC},
        "jemalloc-tuned": {
            ENV: "system",
            "LD_PRELOAD": JEMALLOC,
            "MALLOC_CONF": RUN_CPU_MALLOC_CONF,
        },
        "tcmalloc": {ENV: "tcmalloc"},
    }


def one_run(
    name: str, rep: int, model: str, train: Path, method: str, work: Path
) -> dict[str, Any]:
    out = work / f"{name}-{method}-{rep}"
    code, rss, wall, tail = run_child(
        leantune_command(model, train, method, out), 2, variants()[name]
    )
    if code:
        raise RuntimeError(f"{name} rep {rep} failed (exit {code}):\n{tail}")
    steps = read_metrics(RunPaths(out).metrics)
    summary = finished_summary(out)
    tokens = sum(int(s["tokens"]) for s in steps)
    return {
        "variant": name, "method": method, "rep": rep,
        "tok_s": round(tokens / summary["train_time_s"], 1),
        "train_time_s": round(summary["train_time_s"], 1), "peak_rss_gib": round(rss / 2**30, 2),
        "steps": len(steps), "step_s": [round(s["step_time_s"], 1) for s in steps],
        "rss_gib": [round(s.get("rss_bytes", 0) / 2**30, 2) for s in steps],
        "loss": [round(s["loss"], 4) for s in steps][-3:], "wall_s": round(wall, 1),
        "finished": time.strftime("%H:%M:%S"),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--method", default="lora", choices=("lora", "full"))
    p.add_argument("--variants", default="glibc,tcmalloc", help=",".join(variants()))
    p.add_argument("--out", default="runs/bench-allocator")
    args = p.parse_args()
    if find_tcmalloc(library_dirs({})) is None:
        raise SystemExit("tcmalloc is not installed (Debian: apt-get install libtcmalloc-minimal4)")
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    source = resolve_model("smollm2-135m-instruct")
    train = write_corpus(work / "train.jsonl", load_tokenizer(source, False), 128, 0, 40, 1200)
    names = args.variants.split(",")
    runs = []
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:  # alternate who goes first
            runs.append(one_run(name, rep, source.location, train, args.method, work))
            print(json.dumps(runs[-1]), flush=True)
    medians = {
        n: {
            k: statistics.median(r[k] for r in runs if r["variant"] == n)
            for k in ("tok_s", "peak_rss_gib")
        }
        for n in names
    }
    print(
        json.dumps(
            {"benchmark": "allocator", "method": args.method, "medians": medians, "runs": runs}
        )
    )


if __name__ == "__main__":
    main()
