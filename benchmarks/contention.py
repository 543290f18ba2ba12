"""leantune and HF Trainer + PEFT under contention: the same short LoRA run of each, on an idle
machine and beside 1 (and 2) busy cores, in one invocation; each system's loaded/idle ratio of
useful tokens/s.

A busy core is a child process running a single-threaded numpy loop, started before the run and
killed after it. Both systems train the corpus of `leantune bench throughput` (the same model,
LoRA r16/alpha32, lr 2e-4) with their defaults: leantune chooses its own threads and wait policy
(no OMP_NUM_THREADS), the baseline runs as its user would (torch's default threads, libgomp's
default wait policy, the commands of `leantune.bench.throughput`). `--leantune-env K=V` adds
leantune runs with K=V in their environment (OMP_WAIT_POLICY=ACTIVE: leantune with libgomp's
spinning, to see what the passive policy is worth). The runs alternate who goes first; a table
on stderr, one JSON line last.

    PYTHONPATH=src python benchmarks/contention.py --conversations 16 --max-tokens 300 \
        --steps 3 --busy 0,1,2 --out runs/bench-contention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from leantune.bench.chat_corpus import write_corpus
from leantune.bench.throughput import (
    baseline_environment,
    cpu_name,
    hf_command,
    leantune_command,
    leantune_result,
    run_child,
)
from leantune.bench.throughput_args import BASELINE_RESULT, HF_BATCH
from leantune.layout import RunPaths
from leantune.models.loading import load_tokenizer, resolve_model

# One core's worth: numpy's elementwise ops run in the calling thread only.
BUSY_LOOP = """
import numpy as np
a = np.random.rand(1 << 16)
while True:
    a = a * 1.000001 + 1e-9
"""


def start_busy(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` busy single-threaded processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=env) for _ in range(count)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def systems(extra: list[str]) -> list[tuple[str, dict[str, str]]]:
    """(name, environment over this one) for each system measured."""
    out = [("hf_trainer_peft", {}), ("leantune", {})]
    for kv in extra:
        key, _, value = kv.partition("=")
        out.append((f"leantune[{kv}]", {key: value}))
    return out


def one_run(name: str, env: dict[str, str], busy: int, rep: int, ctx: dict[str, Any]) -> dict:
    """Train once beside `busy` busy cores; the run's useful tokens/s and what it chose."""
    out = Path(ctx["work"]) / f"{name}-busy{busy}-{rep}".replace("[", "_").replace("]", "")
    steps = ["train.max_steps=" + str(ctx["steps"])] if ctx["steps"] else []
    if name.startswith("leantune"):
        cmd = leantune_command(ctx["model"], ctx["train"], "lora", out, ctx["precision"]) + steps
        threads, base = None, os.environ  # leantune's own choice of threads and wait policy
    else:
        threads = os.cpu_count() or 1  # torch's default, what a user of the baseline has
        cmd = [*hf_command(ctx["model"], ctx["train"], "lora", out, ctx["hf_precision"], threads,
                           HF_BATCH), "--max-steps", str(ctx["steps"] or -1)]  # fmt: skip
        base = baseline_environment(os.environ)
    procs = start_busy(busy)
    try:
        time.sleep(0.5)  # the busy loops running before the run starts
        code, rss, wall, tail = run_child(cmd, threads, env, base_env=base)
    finally:
        stop_busy(procs)
    if code != 0:
        raise RuntimeError(f"{name} beside {busy} busy failed (exit {code}):\n{tail}")
    if name.startswith("leantune"):
        result = leantune_result(out)
        events = RunPaths(out).events
        chosen = [ln for ln in tail.splitlines() if "threads:" in ln]
        if events.exists():
            chosen += [json.loads(x)["message"] for x in events.read_text().splitlines()
                       if json.loads(x)["kind"] == "threads"]  # fmt: skip
        result["threads_log"] = chosen
    else:
        result = json.loads((out / BASELINE_RESULT).read_text())
    tok_s = result["useful_tokens"] / result["train_time_s"]
    return {
        "system": name, "busy": busy, "rep": rep, "useful_tokens_per_s": round(tok_s, 2),
        "train_time_s": round(result["train_time_s"], 2), "steps": result["steps"],
        "step_time_s": round(result["train_time_s"] / max(1, result["steps"]), 2),
        "peak_rss_gib": round(rss / 2**30, 2), "wall_s": round(wall, 1),
        "threads_log": result.get("threads_log"), "loadavg_after": os.getloadavg()[0],
    }  # fmt: skip


def summarise(runs: list[dict[str, Any]], busy_counts: list[int]) -> dict[str, Any]:
    """Per system: median useful tokens/s per busy count, and loaded/idle ratios."""
    table: dict[str, Any] = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        row: dict[str, Any] = {}
        for b in busy_counts:
            mine = [
                r["useful_tokens_per_s"] for r in runs if r["system"] == name and r["busy"] == b
            ]
            row[f"busy{b}_tok_s"] = statistics.median(mine)
        idle = row.get("busy0_tok_s")
        for b in busy_counts:
            if b and idle:
                row[f"busy{b}_ratio"] = round(row[f"busy{b}_tok_s"] / idle, 3)
        table[name] = row
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=24, help="training conversations")
    p.add_argument("--min-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=600, help="longest conversation")
    p.add_argument("--steps", type=int, default=0, help="updates per run at most (0: one epoch)")
    p.add_argument("--busy", default="0,1,2", help="busy cores beside each run (0: idle)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every run")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--leantune-env", action="append", default=[], metavar="K=V")
    p.add_argument("--out", default="runs/bench-contention")
    args = p.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    (work / "runs.jsonl").write_text("")  # one line per finished run, as it finishes
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source, False)
    train = write_corpus(
        work / "train.jsonl", tokenizer, args.conversations, 0, args.min_tokens, args.max_tokens
    )
    # The baseline in the precision leantune's auto picks here (bf16 only where it is faster).
    from leantune.core.precision import resolve_precision  # torch: after the corpus is written

    hf_precision = args.precision
    if hf_precision == "auto":
        hf_precision = resolve_precision("auto", "cpu", None, "auto").precision
    ctx = {"model": source.location, "train": train, "steps": args.steps, "work": work,
           "precision": args.precision, "hf_precision": hf_precision}  # fmt: skip
    busy_counts = [int(b) for b in args.busy.split(",")]
    runs = []
    names = systems(args.leantune_env)
    for rep in range(args.reps):
        for i, busy in enumerate(busy_counts):
            order = names if (rep + i) % 2 == 0 else names[::-1]  # alternate who goes first
            for name, env in order:
                r = one_run(name, env, busy, rep, ctx)
                print(
                    f"{name:28s} busy {busy}: {r['useful_tokens_per_s']:7.1f} useful tok/s, "
                    f"{r['step_time_s']:.2f} s/step, load {r['loadavg_after']:.1f}",
                    file=sys.stderr,
                )
                runs.append(r)
                with (work / "runs.jsonl").open("a") as f:
                    f.write(json.dumps(r) + "\n")
    table = summarise(runs, busy_counts)
    for name, row in table.items():
        cells = ", ".join(f"{k} {v}" for k, v in row.items())
        print(f"{name:28s} {cells}", file=sys.stderr)
    print(json.dumps({
        "benchmark": "contention", "cpu": cpu_name(), "cpus": os.cpu_count(),
        "conversations": args.conversations, "max_tokens": args.max_tokens,
        "steps": args.steps, "precision": hf_precision, "results": table, "runs": runs,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
