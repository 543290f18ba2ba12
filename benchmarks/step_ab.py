"""A/B of leantune's whole training step: a change against the code without it, alternating
update by update in one run (the only comparison that holds on a loaded machine).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_ab.py --cut short_attention \
        --method lora --steps 25

One training run with leantune's own trainer (`leantune.api.train`, the demo model, the
defaults with bf16 autocast, no evaluation: `step_profile.run_overrides`) on rows that are all
the same: the demo's first conversation repeated (`--data demo`: the demo's own mix instead,
whose rows differ from update to update). A cut is a switch of leantune (`CUTS`) turned on or off
before each update, in the order ABBA BAAB ..., so that a slow spell of the machine falls on
both sides alike; the first `--skip` updates are not timed (first-time allocations).
With `--data same` every update does the same work, so adjacent updates compare directly. Reported:
each side's median update time, their ratio (with/without), and the ratio of each adjacent
pair's times (its median). The cuts change rounding only; the loss of every update is listed.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# benchmarks/step_profile.py, beside this script
from step_profile import run_overrides, train_wrapped


def _short_attention(_tr: Any, on: bool) -> None:
    """Short bf16 segments on `models.short_attention` (on) or on torch's flash kernel."""
    import leantune.models.attention as attention
    import leantune.models.short_attention as short

    attention.SHORT_SEGMENT = short.SHORT_SEGMENT if on else 0


_ORIGINAL: dict[str, Any] = {}


def _qkv_cast_once(_tr: Any, on: bool) -> None:
    """Segment attention's q, k and v cast to bf16 once per layer (on), or by autocast at
    every segment's kernel call (off)."""
    import leantune.models.attention as attention

    if not _ORIGINAL:
        _ORIGINAL.update(cast=attention._autocast_once, kernel=attention._segment_kernel)
    cast, kernel = _ORIGINAL["cast"], _ORIGINAL["kernel"]

    def per_segment(*args: Any) -> Any:
        inner = kernel(*args)
        return lambda q, k, v: inner(*cast(q, k, v))

    attention._autocast_once = cast if on else (lambda *t: t)
    attention._segment_kernel = kernel if on else per_segment


def _fused_adamw(tr: Any, on: bool) -> None:
    """AdamW's fused CPU kernel (on) or torch's per-tensor loop, its CPU default (off); the
    state is the same either way."""
    for group in tr.optimizer.param_groups:
        group["fused"] = True if on else None


CUTS: dict[str, Callable[[Any, bool], None]] = {
    "short_attention": _short_attention,
    "qkv_cast_once": _qkv_cast_once,
    "fused_adamw": _fused_adamw,
}
"""cut -> switch(trainer, on)."""


def side_of(i: int) -> bool:
    """Whether update `i` runs with the cut: ABBA BAAB ABBA ..."""
    return (i % 4 in (0, 3)) != bool((i // 4) % 2)


def timed_run(overrides: list[str], steps: int, cut: str) -> list[dict[str, Any]]:
    """Train `steps` updates, the cut switched per `side_of`; each update's side, time, loss."""
    out: list[dict[str, Any]] = []

    def step(train_step: Callable[[Any], Any], tr: Any) -> Any:
        on = side_of(len(out))
        CUTS[cut](tr, on)
        start = time.perf_counter()
        result = train_step(tr)
        ms = 1e3 * (time.perf_counter() - start)
        out.append({"with": on, "ms": round(ms, 1), "loss": float(result.record["loss"])})
        print(f"update {len(out):3} {'with' if on else 'without':8} {ms:9.1f} ms", flush=True)
        return result

    try:
        train_wrapped(overrides, steps, step)
    finally:
        if cut != "fused_adamw":  # the patched modules back as they were
            CUTS[cut](None, True)
    return out


def same_rows(path: Path, n: int = 64) -> Path:
    """A chat JSONL of the demo's first conversation `n` times: every packed row the same."""
    import leantune

    demo = Path(leantune.__file__).parent / "demo" / "data" / "support_train.jsonl"
    first = demo.read_text().splitlines()[0]
    path.write_text("\n".join([first] * n) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut", required=True, choices=sorted(CUTS))
    ap.add_argument("--method", default="lora", choices=["lora", "full"])
    ap.add_argument("--precision", default="bf16", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--data", default="same", choices=["same", "demo"])
    ap.add_argument("--steps", type=int, default=25, help="updates (the first --skip untimed)")
    ap.add_argument("--skip", type=int, default=2, help="even: the pairs stay A/B pairs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("override", nargs="*", help="more section.key=value overrides")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        args.model_shape = args.model_path = args.shape_dir = None
        args.train = str(same_rows(Path(tmp) / "same.jsonl")) if args.data == "same" else None
        runs = timed_run(run_overrides(args, Path(tmp)), args.steps, args.cut)
    timed = runs[args.skip :]
    with_ms = [r["ms"] for r in timed if r["with"]]
    without_ms = [r["ms"] for r in timed if not r["with"]]
    # Adjacent updates on opposite sides (ABBA: updates 1-2, 3-4, ...): one ratio per pair.
    pairs = [
        (a["ms"] / b["ms"]) if a["with"] else (b["ms"] / a["ms"])
        for a, b in zip(timed[::2], timed[1::2], strict=False)
        if a["with"] != b["with"]
    ]
    line = {
        "benchmark": "step_ab",
        "cut": args.cut,
        "method": args.method,
        "precision": args.precision,
        "data": args.data,
        "threads": args.threads,
        "steps": args.steps,
        "skip": args.skip,
        "with_median_ms": round(statistics.median(with_ms), 1),
        "without_median_ms": round(statistics.median(without_ms), 1),
        "ratio_of_medians": round(statistics.median(with_ms) / statistics.median(without_ms), 3),
        "pair_ratios": [round(p, 3) for p in pairs],
        "pair_ratio_median": round(statistics.median(pairs), 3),
        "updates": runs,
    }
    print(
        f"{args.cut}, {args.method}: with {line['with_median_ms']} ms, without "
        f"{line['without_median_ms']} ms (medians): ratio {line['ratio_of_medians']}; median "
        f"of {len(pairs)} adjacent pairs {line['pair_ratio_median']} (< 1: the cut is faster)"
    )
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
