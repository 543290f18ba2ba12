"""What one finished `leantune train` run did, checked: `benchmarks/gpu_check.sh`'s verdict on
its training stages (it runs on CPU too, on any run directory).

    PYTHONPATH=src python benchmarks/run_check.py RUN_DIR [--precision fp16] [--scaler]

Prints the resolved device and precision, the steps applied and skipped, the first and last
loss, the median tokens/s after the first step and the peak memory (CUDA reserved, or RSS on
CPU), then one JSON line. Exits 1 when the run did not train: no metrics, a non-finite loss,
no applied step, another precision than `--precision`, or (`--scaler`) a final checkpoint
without the fp16 GradScaler's state.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from leantune.layout import RunPaths
from leantune.monitor.metrics import read_metrics
from leantune.training.state.checkpoint import latest_checkpoint, load_checkpoint


def check(run_dir: Path, precision: str | None, scaler: bool) -> tuple[dict[str, Any], list[str]]:
    """The run's figures and what is wrong with it (empty: it trained)."""
    paths = RunPaths(run_dir)
    problems: list[str] = []
    if not paths.metrics.is_file():
        return {"run_dir": str(run_dir)}, [f"{paths.metrics} is missing: the run did not train"]
    metrics = read_metrics(paths.metrics)
    train = yaml.safe_load(paths.config.read_text()).get("train", {})
    stepped = [bool(m.get("optimizer_stepped", True)) for m in metrics]
    rates = [float(m["tokens_per_s"]) for m in metrics[1:]] or [0.0]
    peak = max(int(m.get("peak_mem_reserved_bytes", m.get("peak_mem_bytes", 0))) for m in metrics)
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "device": train.get("device"),
        "precision": train.get("precision"),
        "steps": len(metrics),
        "applied": sum(stepped),
        "skipped": len(stepped) - sum(stepped),
        "first_loss": metrics[0]["loss"] if metrics else None,
        "last_loss": metrics[-1]["loss"] if metrics else None,
        "median_tokens_per_s": statistics.median(rates),
        "peak_mem_gib": round(peak / 2**30, 3),
    }
    if not metrics:
        problems.append("no step was recorded")
    if not all(math.isfinite(float(m["loss"])) for m in metrics):
        problems.append("a loss is not finite")
    if metrics and not any(stepped):
        problems.append("no optimizer step was applied")
    if precision is not None and out["precision"] != precision:
        problems.append(f"trained in {out['precision']}, not {precision}")
    if scaler:
        ckpt = latest_checkpoint(paths.checkpoints)
        state = load_checkpoint(ckpt).scaler if ckpt is not None else None
        if state is None:
            problems.append("the final checkpoint holds no GradScaler state")
        else:
            out["loss_scale"] = float(state["scale"])
    return out, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--precision", default=None, help="the precision the run must have used")
    ap.add_argument("--scaler", action="store_true", help="require the fp16 GradScaler's state")
    args = ap.parse_args()
    out, problems = check(args.run_dir, args.precision, args.scaler)
    for key, value in out.items():
        print(f"{key:20} {value}")
    for problem in problems:
        print(f"FAILED: {problem}")
    print(json.dumps({"benchmark": "run_check", "ok": not problems, **out, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
