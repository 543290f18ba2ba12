"""QLoRA's adapter initialisations side by side at equal steps (`method.init`), against full.

    python benchmarks/lora_inits.py [--inits default,loftq] [--steps 40] [--task instructions]
        [--out runs/bench-inits] [--no-full] [-- section.key=value ...]

Runs `leantune bench methods --methods qlora` once per initialisation (each into its own
--out/qlora-<init>, with the same config, data, steps, learning rate and seed), and once
`--methods full` into --out/full as the baseline (skipped with --no-full, or read back when it
finished before: `--reuse`). Prints a Markdown table (exact match, held-out loss, retention of
full's exact match, the loss at the first logged step) and one JSON line last. Exits 1 when a run
failed. The numbers are the bench's own (summary.json, metrics.jsonl of each run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def bench(out: Path, methods: str, steps: int, task: str | None, extra: list[str]) -> int:
    """One `leantune bench methods` run; its exit code."""
    cmd = [sys.executable, "-m", "leantune", "bench", "methods", "--methods", methods]
    cmd += ["--steps", str(steps), "--out", str(out), "--reuse"]
    cmd += ["--task", task] if task else []
    return subprocess.run([*cmd, *extra], check=False).returncode


def row(out: Path) -> dict[str, Any] | None:
    """The one method's result of a finished bench folder, with its first logged loss."""
    path = out / "methods.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())["results"][0]
    metrics = out / result["method"] / "metrics.jsonl"
    if metrics.is_file():
        first = next((json.loads(x) for x in metrics.read_text().splitlines() if x.strip()), {})
        result["first_loss"] = first.get("loss")
    return dict(result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inits", default="default,loftq", help="comma-separated method.init values")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--task", choices=["instructions"], default=None)
    p.add_argument("--out", default="runs/bench-inits")
    p.add_argument("--no-full", action="store_true", help="skip the full fine-tuning baseline")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run (after --)")
    args = p.parse_args()
    out = Path(args.out)
    rows: dict[str, dict[str, Any] | None] = {}
    failed = False
    if not args.no_full:
        failed |= bench(out / "full", "full", args.steps, args.task, args.overrides) != 0
        rows["full"] = row(out / "full")
    for init in args.inits.split(","):
        # method.name too: the bench validates its overrides once, with the config's method.
        extra = [*args.overrides, "method.name=qlora", f"method.init={init}"]
        # The base model's exact match is the same for every run: measured once, by the first.
        extra += ["train.eval_base=false"] if rows else []
        folder = out / f"qlora-{init}"
        failed |= bench(folder, "qlora", args.steps, args.task, extra) != 0
        rows[f"qlora init={init}"] = row(folder)
    full_em = (rows.get("full") or {}).get("exact_match")
    print(f"\n{args.steps} steps each; task: {args.task or 'the config data'}\n")
    print("| run | exact match | held-out loss | vs full | first loss |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        r = r or {}
        em, loss, first = r.get("exact_match"), r.get("eval_loss"), r.get("first_loss")
        vs = f"{em / full_em:.2f}x" if em is not None and full_em else "-"
        print(
            f"| {name} | {'-' if em is None else f'{em:.0%}'} | "
            f"{'-' if loss is None else f'{loss:.4f}'} | {vs} | "
            f"{'-' if first is None else f'{first:.4f}'} |"
        )
    print(json.dumps({"benchmark": "lora-inits", "steps": args.steps, "rows": rows}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
