"""The demo's training time, eager against `train.compile=true` (cold and warm compile cache).

    PYTHONPATH=src python benchmarks/demo_time.py [--reps 2] [--other-src DIR] [--out FILE]

Each repetition runs the whole demo (`leantune train`: the base model's exact match, 120 LoRA
steps, the final exact match) three times, each in its own process, in turn:

- `eager`: the demo as shipped;
- `compile_cold`: `train.compile=true` with an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR a
  new folder): the first run on a machine;
- `compile_warm`: the same again, reusing the cache the cold run filled: every later run.

`--arms` picks the runs (default `eager,compile_cold,compile_warm`); `glibc` is the demo as
shipped with `LEANTUNE_ALLOCATOR=system`: glibc's malloc instead of the tcmalloc the command
preloads (`leantune.core.allocator`). `--other-src DIR` adds another run per repetition,
the demo of another source tree (an earlier commit's `src/`, with its own demo config) run
eagerly with the same environment: whether a change of step time came from the code or from
the machine, measured side by side.

Reported per run: the training time (summary.json's train_time_s: the sum of the steps' wall
times), the first step's time (where the compile happens), the median step time after it, the
whole process's wall time, its peak RSS (wait4), and the final exact match; per arm the medians
over the repetitions, and for the compiled arms the time saved against `eager` (negative: lost).
One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from leantune.bench.throughput import run_child
from leantune.layout import RunPaths
from leantune.monitor.summary import finished_summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cpu_name

SETTINGS = ["run.progress=false"]


def one_run(name: str, work: Path, env: dict[str, str], overrides: list[str]) -> dict[str, Any]:
    """Run the demo once in its own process; what it measured."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "leantune", "train", f"run.dir={run_dir}", *SETTINGS, *overrides]
    code, peak, wall, tail = run_child(cmd, os.cpu_count() or 1, extra_env=env)
    if code != 0:
        raise SystemExit(f"{name} failed ({code}):\n{tail}")
    summary = finished_summary(run_dir)
    rows = [json.loads(line) for line in RunPaths(run_dir).metrics.read_text().splitlines()]
    steps = [float(r["step_time_s"]) for r in rows if "step_time_s" in r]
    return {
        "arm": name.split("-", 1)[1],
        "steps": len(steps),
        "train_time_s": float(summary["train_time_s"]),
        "first_step_s": steps[0],
        "step_s_after_first": statistics.median(steps[1:]),
        "step3_s": steps[2] if len(steps) > 2 else None,
        "wall_s": round(wall, 2),
        "peak_rss_bytes": peak,
        "eval_exact_match": summary.get("eval_exact_match"),
    }


def arms(args: argparse.Namespace, work: Path, rep: int) -> list[tuple[str, dict, list[str]]]:
    """This repetition's runs: (name, environment, overrides), in the order they run."""
    cache = str(work / f"inductor-{rep}")
    every = {
        "eager": ({}, []),
        "glibc": ({"LEANTUNE_ALLOCATOR": "system"}, []),
        "compile_cold": ({"TORCHINDUCTOR_CACHE_DIR": cache}, ["train.compile=true"]),
        "compile_warm": ({"TORCHINDUCTOR_CACHE_DIR": cache}, ["train.compile=true"]),
    }
    out = [(f"{rep}-{arm}", *every[arm]) for arm in args.arms.split(",")]
    if args.other_src:
        out.append((f"{rep}-other", {"PYTHONPATH": str(Path(args.other_src).resolve())}, []))
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("train_time_s", "first_step_s", "step_s_after_first", "wall_s")
        }
        out[arm]["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in mine)
        out[arm]["eval_exact_match"] = [r["eval_exact_match"] for r in mine]
        out[arm]["steps"] = mine[0]["steps"]
    eager = out["eager"]["train_time_s"]
    for arm in (a for a in ("glibc", "compile_cold", "compile_warm") if a in out):
        out[arm]["saved_vs_eager_s"] = round(eager - out[arm]["train_time_s"], 2)
        out[arm]["train_time_ratio"] = round(out[arm]["train_time_s"] / eager, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--arms", default="eager,compile_cold,compile_warm", help="eager first")
    p.add_argument("--other-src", default=None, help="another tree's src/ to run its demo too")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, env, overrides in arms(args, Path(tmp), rep):
                runs.append(one_run(name, Path(tmp), env, overrides))
                r = runs[-1]
                print(
                    f"{name}: train {r['train_time_s']:.1f} s ({r['steps']} steps, first "
                    f"{r['first_step_s']:.1f} s, then {r['step_s_after_first']:.3f} s/step), "
                    f"whole run {r['wall_s']:.0f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} "
                    f"GiB, exact match {r['eval_exact_match']}",
                    flush=True,
                )
    result = {
        "benchmark": "demo_time",
        "cpu": cpu_name(),
        "threads": os.cpu_count(),
        "started": started,
        "other_src": args.other_src,
        "arms_run": args.arms,
        "arms": summarise(runs),
        "runs": runs,
    }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
