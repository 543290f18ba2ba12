"""Default learning rates from two `leantune bench methods --sweep` runs (two tasks).

    python benchmarks/sweep_defaults.py SWEEP_A.json SWEEP_B.json [--tie 0.03] [--out FILE.md]

For each method swept on both tasks: a task's best rate is the highest rate whose held-out loss
is within `--tie` (relative) of that task's lowest, since one seed and a few dozen validation
examples do not separate closer losses; the default is the lower of the two tasks' best rates,
because a rate too low costs speed while one too high diverges (and larger models want lower
rates). Prints a Markdown table (each task's losses by rate, the rule's default and the
registry's `default_lr`) and one JSON line last; exits 1 where the registry disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def losses_by_rate(sweep: dict[str, Any]) -> dict[float, float]:
    """A method's finished points: rate -> held-out loss (failed points left out)."""
    return {p["lr"]: p["eval_loss"] for p in sweep["points"] if p["status"] == "ok"}


def best_rate(losses: dict[float, float], tie: float) -> float:
    """The highest rate whose loss is within `tie` (relative) of the lowest."""
    lowest = min(losses.values())
    return max(lr for lr, loss in losses.items() if loss <= lowest * (1 + tie))


def default_rate(a: dict[float, float], b: dict[float, float], tie: float) -> float:
    """The rule: the lower of the two tasks' best rates."""
    return min(best_rate(a, tie), best_rate(b, tie))


def _cell(losses: dict[float, float], best: float) -> str:
    return ", ".join(
        f"**{lr:g}: {loss:.3f}**" if lr == best else f"{lr:g}: {loss:.3f}"
        for lr, loss in sorted(losses.items())
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs=2, help="two sweep.json files (two tasks)")
    p.add_argument("--tie", type=float, default=0.03, help="relative loss gap counted as a tie")
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    args = p.parse_args()
    from leantune.methods.registry import DEFAULT_LR

    runs = [json.loads(Path(f).read_text()) for f in args.sweeps]
    # A config's own data is named by the config ("demo"), a generated task by the task.
    tasks = [r["config"] if r.get("task") == "config" else r["task"] for r in runs]
    by_task = [{s["method"]: losses_by_rate(s) for s in r["sweeps"]} for r in runs]
    head = f"| method | {tasks[0]}: held-out loss by rate | {tasks[1]}: held-out loss by rate "
    lines = [head + "| default (rule) | registry |", "|---|---|---|---|---|"]
    chosen: dict[str, float] = {}
    for method in [m for m in by_task[0] if m in by_task[1]]:
        a, b = by_task[0][method], by_task[1][method]
        best_a, best_b = best_rate(a, args.tie), best_rate(b, args.tie)
        chosen[method] = default_rate(a, b, args.tie)
        lines.append(
            f"| {method} | {_cell(a, best_a)} | {_cell(b, best_b)} | {chosen[method]:g} "
            f"| {DEFAULT_LR[method]:g} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    differ = {m: (lr, DEFAULT_LR[m]) for m, lr in chosen.items() if lr != DEFAULT_LR[m]}
    print(json.dumps({"benchmark": "sweep_defaults", "tie": args.tie, "tasks": tasks,
                      "defaults": chosen, "registry_differs": differ}))  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
