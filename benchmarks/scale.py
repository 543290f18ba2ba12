"""The sizes people bring: plan, 3 training steps and export on random-weight models of real
shapes (Qwen2.5 0.5B, 1.5B, 7B), built from config on this machine (nothing is downloaded;
shapes decide memory and speed, not weights).

Each model is written once as bf16 safetensors shards of random weights (one tensor at a time,
so building a 7B never holds more than one shard), with the demo model's tokenizer (49k
vocabulary, so the shapes have 0.4B, 1.4B and 6.9B parameters). Then, per case, in fresh
processes: `leantune plan --json` (what the planner predicts and recommends), `leantune train`
for 3 steps on a 64-record chat file (peak RSS of the process by wait4, wall time, load time
and seconds per step from the run's log and metrics), and `leantune export --format hf` where
asked (its parity check included). Set-up time is the run's wall time less its training time
(loading, quantising, data preparation). Cases run one at a time: run nothing else meanwhile.

Usage:
    PYTHONPATH=src python benchmarks/scale.py [--cases 0.5b-full,0.5b-lora,...] [--keep]
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from leantune.bench import model_shapes
from leantune.layout import RunPaths
from leantune.models.demo_model import ensure_demo_model
from leantune.monitor.summary import read_summary

# name: (shape, method, extra overrides, export)
CASES: dict[str, tuple[str, str, tuple[str, ...], bool]] = {
    "0.5b-full": ("0.5b", "full", (), True),
    "0.5b-lora": ("0.5b", "lora", (), False),
    "1.5b-lora": ("1.5b", "lora", (), False),
    "7b-qlora": ("7b", "qlora", ("train.global_batch_size=2",), False),
    # On a GPU (--device cuda): the sizes a 24 GiB card takes with each method.
    "1.5b-full": ("1.5b", "full", (), False),
    "1.5b-qlora": ("1.5b", "qlora", (), False),
    "7b-lora-bf16": ("7b", "lora", ("model.dtype=bf16", "train.global_batch_size=2"), False),
}
CPU_CASES = ("0.5b-full", "0.5b-lora", "1.5b-lora", "7b-qlora")
CUDA_CASES = ("0.5b-full", "1.5b-full", "1.5b-lora", "7b-lora-bf16", "7b-qlora")


def build_model(shape: str, out: Path, tokenizer_dir: Path) -> Path:
    """The random-weight model of `shape` with the tokenizer's own vocabulary (this benchmark's
    recorded rows used the demo tokenizer's 49k, not the published 151,936)."""
    return model_shapes.build_model(shape, out, tokenizer_dir, real_vocab=False)


def chat_file(path: Path, n: int = 64) -> Path:
    """`n` support chats of 1-3 turns (short, as people's first data sets are)."""
    topics = ["refund", "delivery", "password", "invoice", "upgrade", "warranty", "address"]
    with path.open("w") as f:
        for i in range(n):
            t = topics[i % len(topics)]
            msgs = []
            for turn in range(1 + i % 3):
                msgs.append({"role": "user", "content": f"Question {i}.{turn} about my {t}?"})
                msgs.append({"role": "assistant", "content": f"Answer {i}.{turn}: your {t} is ok."})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def run(cmd: list[str], env: dict[str, str]) -> tuple[int, int, float, str]:
    """Exit code, peak RSS (bytes, wait4), wall seconds and output of one command."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    return (
        os.waitstatus_to_exitcode(status),
        usage.ru_maxrss * 1024,
        time.perf_counter() - started,
        output,
    )


def case(
    name: str, work: Path, tokenizer_dir: Path, data: Path, device: str = "cpu"
) -> dict[str, Any]:
    shape, method, extra, export = CASES[name]
    if device != "cpu":
        extra = (*extra, f"train.device={device}")
    model = build_model(shape, work / f"model-{shape}", tokenizer_dir)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    leantune = [sys.executable, "-m", "leantune"]
    common = [
        f"model.path={model}",
        f"data.train={data}",
        "data.max_seq_len=512",
        f"method.name={method}",
        *extra,
    ]
    code, _, _, out = run([*leantune, "plan", *common, "--json"], env)
    plan = json.loads(out[out.index("{") :]) if code == 0 else {"error": out[-1500:]}
    run_dir = work / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    train = [
        *leantune,
        "train",
        *common,
        "train.max_steps=3",
        "data.eval=null",
        "train.eval_exact_match=false",
        "run.progress=false",
        f"run.dir={run_dir}",
    ]
    code, rss, wall, out = run(train, env)
    row: dict[str, Any] = {
        "case": name,
        "shape": shape,
        "method": method,
        "exit": code,
        "peak_rss_gib": round(rss / 2**30, 2),
        "wall_s": round(wall, 1),
    }
    metrics = RunPaths(run_dir).metrics
    if metrics.is_file():
        steps = [json.loads(x) for x in metrics.read_text().splitlines()]
        steps = [s for s in steps if "step_time_s" in s]
        times = [s["step_time_s"] for s in steps]
        if times:
            row["s_per_step"] = round(sum(times[1:] or times) / len(times[1:] or times), 2)
        tokens = sum(s.get("tokens", 0) for s in steps)
        if times and tokens:
            row["tok_per_s"] = round(tokens / sum(times), 1)
    s = read_summary(run_dir)
    if s is not None:
        row["setup_s"] = round(s["wall_time_s"] - s["train_time_s"], 1)  # load + data
        # train resets the kernel's high-water mark when training starts (so that its metrics
        # are training's), which wait4 then reports: the load phase's peak is in the summary.
        for phase in ("load", "train"):
            if s.get(f"{phase}_peak_mem_bytes"):
                row[f"{phase}_peak_gib"] = round(s[f"{phase}_peak_mem_bytes"] / 2**30, 2)
        row["peak_rss_gib"] = max(row["peak_rss_gib"], row.get("load_peak_gib", 0.0))
        row["allocator"] = s.get("allocator")
    peak = row["peak_rss_gib"] * 2**30  # the whole process: load or training, the higher
    run_plan = run_dir / "memory_plan.json"
    if run_plan.is_file() and (planned := json.loads(run_plan.read_text()).get("peak_bytes")):
        # What train planned for the settings it chose (auto micro-batch resolved).
        row["run_planned_peak_gib"] = round(planned / 2**30, 2)
        trained = row.get("train_peak_gib", row["peak_rss_gib"]) * 2**30
        if device == "cuda" and metrics.is_file():
            rows_ = [json.loads(x) for x in metrics.read_text().splitlines()]
            trained = max(r.get("peak_mem_reserved_bytes", 0) for r in rows_)
        row["train_over_run_plan"] = round(trained / planned, 3)
    if device == "cuda" and metrics.is_file():
        # The budget is the GPU's: the caching allocator's peaks, allocated and reserved.
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        for key in ("peak_mem_bytes", "peak_mem_reserved_bytes"):
            row[f"cuda_{key[:-6]}_gib"] = round(max(r.get(key, 0) for r in rows) / 2**30, 2)
        peak = row["cuda_peak_mem_reserved_gib"] * 2**30
    configured = plan.get("configured", {}).get("breakdown", {})
    if configured:
        row["planned_peak_gib"] = round(configured["peak"] / 2**30, 2)
        row["rss_over_plan"] = round(peak / configured["peak"], 2)
        row["plan_fits"] = plan.get("fits")
        recommended = plan.get("recommended") or {}
        row["plan_recommends"] = {
            k: recommended.get(k) for k in ("method", "micro_batch", "gradient_checkpointing")
        }
        needed = configured.get("needed")
        if needed:
            row["planned_needed_gib"] = round(needed / 2**30, 2)
            row["rss_over_needed"] = round(peak / needed, 2)
    if code != 0:
        row["tail"] = out[-1500:]
    elif export:
        code, xrss, xwall, out = run(
            [
                *leantune,
                "export",
                str(run_dir),
                "--format",
                "hf",
                "--out",
                str(work / f"hf-{name}"),
            ],
            env,
        )
        row["export"] = {
            "exit": code,
            "peak_rss_gib": round(xrss / 2**30, 2),
            "wall_s": round(xwall, 1),
            "parity": "passed" in out,
        }
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma-separated names of CASES")
    ap.add_argument("--work", default=None, help="folder for models and runs (default: a temp one)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="train.device")
    ap.add_argument(
        "--tokenizer", default=None, help="a tokenizer folder (default: the demo model's)"
    )
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="leantune-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else ensure_demo_model()
    data = chat_file(work / "chat.jsonl")
    rows = []
    cases = args.cases or ",".join(CUDA_CASES if args.device == "cuda" else CPU_CASES)
    for name in cases.split(","):
        row = case(name, work, tokenizer_dir, data, args.device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = sorted({f for f in ("avx512_bf16", "amx_bf16") if f in cpu})
    print(f"\n{'case':12} {'exit':>4} {'plan GiB':>9} {'peak GiB':>9} {'ratio':>6} {'s/step':>7}")
    for r in rows:
        print(
            f"{r['case']:12} {r['exit']:>4} {r.get('planned_peak_gib', '-'):>9} "
            f"{r['peak_rss_gib']:>9} {r.get('rss_over_plan', '-'):>6} {r.get('s_per_step', '-'):>7}"
        )
    result: dict[str, Any] = {"benchmark": "scale", "cpu_flags": flags, "rows": rows}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
