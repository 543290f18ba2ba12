"""Where leantune's training step goes: torch.profiler buckets of one update's self CPU time.

Trains with leantune's own trainer (`leantune.api.train`, the defaults unless overridden): the
demo model, a random-weight `--model-shape tiny|0.5b` (`bench.model_shapes`, the demo
tokenizer), or `--model-path` with `--train`. The first `--warmup` updates run unprofiled (their
wall time is reported, to show the profiler's own overhead); the next `--steps` run under
torch.profiler (CPU, record_shapes). Each profiled update's events are bucketed by self CPU time:

- base matmuls: mm/addmm/bmm whose shape is a frozen (or, full, trained) weight's;
- LoRA matmuls: mm/addmm/bmm with a rank-r dimension (the adapters' skinny products);
- other matmuls: any other mm/addmm/bmm outside the buckets below;
- attention: the scaled-dot-product kernels (torch's and `models.short_attention`'s) and their
  backward;
- chunked loss: `core.chunked_ce` (its lm_head matmuls included; their FLOPs are counted);
- casts: dtype conversions (aten::_to_copy, under autocast mostly fp32 <-> bf16), counted;
- norms/rotary: RMSNorm modules and transformers' `apply_rotary_pos_emb`, forward and backward;
- optimizer: `Optimizer.step` and `zero_grad`;
- elementwise/other: every other op (residual adds, SiLU*mul, views, embedding, clipping);
- autograd engine: the engine's per-node work that is no op (evaluate_function, AccumulateGrad);
- outside any op: the update's wall time less everything above (Python, the record, sums).

A backward op belongs to the bucket of the forward op that created its autograd node (matched
by sequence number). FLOPs are 2*M*K*N per matmul from the recorded shapes; the matmul rate is
compared with `bench.throughput.matmul_peak`, probed in the same process before and after.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_profile.py --method lora \
        --precision bf16 --threads 1 --warmup 2 --steps 3

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BUCKETS = (
    "base matmuls",
    "LoRA matmuls",
    "other matmuls",
    "attention",
    "chunked loss",
    "casts",
    "norms/rotary",
    "optimizer",
    "elementwise/other",
    "autograd engine",
    "outside any op",
)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
STEP_SCOPE = "step_profile.update"
NORM_SCOPE = "step_profile.norm_or_rotary"


def matmul_flops(name: str, shapes: Sequence[Sequence[int]]) -> tuple[int, tuple[int, ...]]:
    """2*M*K*N of one matmul event and its (M, K, N); (0, ()) when the shapes are not recorded."""
    mats = [list(s) for s in shapes if len(s) >= 2]
    if name in ("aten::addmm", "aten::baddbmm"):
        mats = mats[-2:]  # the bias (or accumulator) comes first
    if len(mats) < 2:
        return 0, ()
    a, b = mats[0], mats[1]
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    return 2 * batch * m * k * n, (m, k, n)


def attention_flops(name: str, shapes: Sequence[Sequence[int]]) -> int:
    """A causal SDPA kernel's useful FLOPs from q's (batch, heads, len, dim): QK^T and AV, half
    the square each, 2*b*h*n*n*d forward; its backward, twice that (no recompute counted)."""
    if not shapes or len(shapes[0]) != 4:
        return 0
    b, h, n, d = shapes[0]
    forward = 2 * b * h * n * n * d
    return 2 * forward if "backward" in name else forward


def matmul_bucket(dims: tuple[int, ...], rank: int | None) -> str:
    """LoRA's when one dimension is the adapters' rank; otherwise a base weight's."""
    if rank is not None and rank in dims:
        return "LoRA matmuls"
    return "base matmuls" if dims else "other matmuls"


def _is_engine(name: str) -> bool:
    return (
        name.startswith("autograd::engine::")
        or name.endswith("Backward0")
        or name.endswith("Backward1")
        or "AccumulateGrad" in name
    )


def _scope_of(name: str) -> str | None:
    """The bucket that an event of this name claims for itself and everything under it."""
    if name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad"):
        return "optimizer"
    if "LinearCrossEntropy" in name or "LinearTokenLogps" in name:
        return "chunked loss"
    if "scaled_dot_product" in name or "ScaledDotProduct" in name:
        return "attention"
    if name == NORM_SCOPE:
        return "norms/rotary"
    if name in ("aten::_to_copy", "ToCopyBackward0"):
        return "casts"
    return None


def _bucket(chain: list[Any], forward_scope: dict[int, str], rank: int | None) -> str:
    """The bucket of `chain[0]`, an event under its ancestors `chain[1:]` (the update's scope
    excluded): the innermost scope that claims it, else its matmul's, else by its kind."""
    for p in chain:
        scope = _scope_of(p.name)
        if scope is None and p.name.startswith("autograd::engine::evaluate_function"):
            scope = forward_scope.get(p.sequence_nr)  # the node's forward op's scope
        if scope is not None:
            return scope
    mm = next((p for p in chain if p.name in MATMULS), None)
    if mm is not None:
        return matmul_bucket(matmul_flops(mm.name, mm.input_shapes)[1], rank)
    name = chain[0].name
    if _is_engine(name):
        return "autograd engine"
    if "::" in name:
        return "elementwise/other"
    return "outside any op"  # a Python-level scope's own time


def bucket_events(events: Sequence[Any], rank: int | None) -> dict[str, Any]:
    """Self CPU microseconds per bucket of the events under each `STEP_SCOPE`, matmul FLOPs,
    cast counts and the per-update wall times the scopes measured (see the module doc)."""
    forward_scope: dict[int, str] = {}  # sequence_nr of a forward op -> its scope's bucket
    totals = dict.fromkeys(BUCKETS, 0.0)
    flops = {"all": 0, "base matmuls": 0, "LoRA matmuls": 0, "other matmuls": 0, "loss": 0}
    # The flash kernels' own (not in "all": no mm events) and the short kernel's bmm (in "all").
    flops["attention"] = 0
    flops["attention matmuls"] = 0  # the short kernel's share of "attention", also in "all"
    mm_us = 0.0
    casts = 0
    steps: list[float] = []
    scoped = 0.0
    ops: dict[tuple[str, str, str], list[float]] = {}  # (bucket, op, shapes) -> [us, calls]
    # In start order, so that a forward op is seen before its backward node.
    for ev in sorted(events, key=lambda e: e.time_range.start):
        chain = [ev]
        while chain[-1].cpu_parent is not None:
            chain.append(chain[-1].cpu_parent)
        if chain[-1].name != STEP_SCOPE:
            continue  # outside the profiled updates (the loop's own work between them)
        if len(chain) == 1:
            steps.append(float(ev.cpu_time_total))
            continue
        self_us = float(ev.self_cpu_time_total)
        scoped += self_us
        bucket = _bucket(chain[:-1], forward_scope, rank)
        scoped_kinds = ("optimizer", "chunked loss", "attention", "norms/rotary", "casts")
        if bucket in scoped_kinds and ev.sequence_nr >= 0:
            forward_scope.setdefault(ev.sequence_nr, bucket)
        if ev.name in MATMULS:
            f, dims = matmul_flops(ev.name, ev.input_shapes)
            flops["all"] += f
            mm_us += self_us
            key = {"chunked loss": "loss", "attention": "attention"}.get(bucket)
            key = key or matmul_bucket(dims, rank)
            flops[key] += f
            flops["attention matmuls"] += f if key == "attention" else 0
        if ev.name.startswith("aten::_scaled_dot_product_flash_attention"):
            flops["attention"] += attention_flops(ev.name, ev.input_shapes)
        casts += ev.name == "aten::_to_copy"
        totals[bucket] += self_us
        op = ops.setdefault((bucket, ev.name, str(ev.input_shapes)), [0.0, 0])
        op[0] += self_us
        op[1] += 1
    return {
        "ops": ops,
        "totals_us": totals,
        "scoped_self_us": scoped,
        "step_us": steps,
        "flops": flops,
        "matmul_self_us": mm_us,
        "casts": casts,
    }


@contextlib.contextmanager
def labelled_norms(model: Any) -> Iterator[None]:
    """Every RMSNorm module's forward and transformers' `apply_rotary_pos_emb` inside
    `NORM_SCOPE`, so that their ops (and, by sequence number, their backward) are found; the
    short-segment attention kernel's forward inside an attention scope."""
    from torch.autograd.profiler import record_function

    handles = []
    for module in model.modules():
        if "RMSNorm" in type(module).__name__:
            scopes: list[Any] = []

            def pre(_m: Any, _a: Any, scopes: list[Any] = scopes) -> None:
                scopes.append(record_function(NORM_SCOPE))
                scopes[-1].__enter__()

            def post(_m: Any, _a: Any, _o: Any, scopes: list[Any] = scopes) -> None:
                scopes.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    patched = []
    # The short-segment attention kernel (`models.short_attention`): its forward as attention;
    # its backward node's name (`_ShortScaledDotProductBackward`) says so already.
    from leantune.models import attention

    short = attention.short_causal

    def labelled_short(*a: Any, _fn: Callable[..., Any] = short) -> Any:
        with record_function("short_scaled_dot_product"):
            return _fn(*a)

    attention.short_causal = labelled_short
    patched.append((attention, "short_causal", short))
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if name.startswith("transformers.models.") and callable(fn):

            def labelled(*a: Any, _fn: Callable[..., Any] = fn, **k: Any) -> Any:
                with record_function(NORM_SCOPE):
                    return _fn(*a, **k)

            patched.append((mod, "apply_rotary_pos_emb", fn))
            mod.apply_rotary_pos_emb = labelled
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, name, fn in patched:
            setattr(mod, name, fn)


def train_wrapped(
    overrides: list[str], steps: int, wrap: Callable[[Callable[[Any], Any], Any], Any]
) -> None:
    """`leantune train` in this process for `steps` updates, each one run as
    `wrap(train_step, trainer)` (timing, profiling, switching a cut around the real step)."""
    from leantune import api
    from leantune.training import recipe

    original = recipe.train_step
    recipe.train_step = lambda tr: wrap(original, tr)  # the loop calls it by this module's name
    try:
        api.train(None, [*overrides, f"train.max_steps={steps}"], log=None)
    finally:
        recipe.train_step = original


def profile_run(overrides: list[str], warmup: int, steps: int, rank: int | None) -> dict[str, Any]:
    """Train `warmup + steps` updates with `overrides`; the profiled updates' buckets."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    walls: list[float] = []
    records: list[dict[str, Any]] = []
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    norms: contextlib.ExitStack = contextlib.ExitStack()

    def step(train_step: Callable[[Any], Any], tr: Any) -> Any:
        i = len(walls)
        if i == warmup:
            norms.enter_context(labelled_norms(tr.model))
            prof.start()
        # The scope marks a profiled update's events (and its wall time, as the profiler saw it).
        scope = record_function(STEP_SCOPE) if warmup <= i else contextlib.nullcontext()
        with scope:
            start = time.perf_counter()
            result = train_step(tr)
            walls.append(time.perf_counter() - start)
        records.append(result.record)
        if len(walls) == warmup + steps:
            prof.stop()
            norms.close()
        return result

    try:
        train_wrapped(overrides, warmup + steps, step)
    finally:
        norms.close()
    out = bucket_events(prof.events(), rank)
    out["walls_s"] = walls
    out["losses"] = [r["loss"] for r in records]
    out["tokens"] = [r["tokens"] for r in records]
    out["threads"] = torch.get_num_threads()
    return out


def summarise(
    raw: dict[str, Any], warmup: int, peak_gflops: float, top: int = 15
) -> dict[str, Any]:
    """Per-update milliseconds and shares of each bucket, FLOPs, rates; the JSON's fields."""
    steps = len(raw["step_us"])
    walls = raw["walls_s"]
    wall_ms = 1e3 * sum(walls[warmup:]) / steps
    buckets = {k: v / 1e3 / steps for k, v in raw["totals_us"].items()}
    # The update's wall time less the ops' own times: Python, per-update fixed costs.
    buckets["outside any op"] += wall_ms - sum(buckets.values())
    mm_s = raw["matmul_self_us"] / 1e6 / steps
    mm_flops = raw["flops"]["all"] / steps
    rate = mm_flops / mm_s / 1e9 if mm_s else 0.0
    step_flops_rate = mm_flops / (wall_ms / 1e3) / 1e9
    return {
        "step_ms": round(wall_ms, 2),
        # The warm-up updates after the first (which pays for first-time allocations).
        "unprofiled_step_ms": round(1e3 * statistics.median(walls[1:warmup]), 2)
        if warmup > 1
        else None,
        "buckets_ms": {k: round(v, 3) for k, v in buckets.items()},
        "buckets_pct": {k: round(100 * v / wall_ms, 2) for k, v in buckets.items()},
        "casts_per_step": raw["casts"] / steps,
        "matmul_gflop_per_step": round(mm_flops / 1e9, 3),
        "matmul_gflop_by_bucket": {k: round(v / steps / 1e9, 3) for k, v in raw["flops"].items()},
        "matmul_ms": round(1e3 * mm_s, 2),
        "matmul_gflops": round(rate, 1),
        "peak_gflops": round(peak_gflops, 1),
        "matmul_fraction_of_peak": round(rate / peak_gflops, 3) if peak_gflops else None,
        "step_mfu": round(step_flops_rate / peak_gflops, 3) if peak_gflops else None,
        "losses": raw["losses"],
        "tokens": raw["tokens"],
        # The ops (by bucket, name and input shapes) that took the most time, per update.
        "top_ops": [
            {
                "bucket": b,
                "op": n,
                "shapes": sh,
                "ms": round(us / 1e3 / steps, 2),
                "calls": c / steps,
            }
            for (b, n, sh), (us, c) in sorted(raw["ops"].items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def print_table(s: dict[str, Any]) -> None:
    print(f"\n{'bucket':20} {'ms/step':>9} {'%':>6}")
    by = s["matmul_gflop_by_bucket"]
    for k in BUCKETS:
        ms = s["buckets_ms"][k]
        gflop = by.get({"chunked loss": "loss"}.get(k, k), 0.0)
        rate = f"{gflop:8.1f} GFLOP {gflop / ms * 1e3:6.1f} GFLOP/s" if gflop and ms else ""
        print(f"{k:20} {ms:9.1f} {s['buckets_pct'][k]:6.1f} {rate}")
    print(f"{'step (profiled)':20} {s['step_ms']:9.1f} {100.0:6.1f}")
    if s["unprofiled_step_ms"] is not None:
        print(f"{'step (unprofiled)':20} {s['unprofiled_step_ms']:9.1f}")
    print(f"\n{'top ops':60} {'ms/step':>9} {'calls':>6}")
    for op in s["top_ops"]:
        what = f"{op['bucket']}: {op['op']} {op['shapes']}"[:60]
        print(f"{what:60} {op['ms']:9.1f} {op['calls']:6.0f}")
    print(
        f"casts per step {s['casts_per_step']:.0f}; matmuls {s['matmul_gflop_per_step']:.1f} "
        f"GFLOP in {s['matmul_ms']:.0f} ms = {s['matmul_gflops']:.0f} GFLOP/s against a peak of "
        f"{s['peak_gflops']:.0f} ({s['matmul_fraction_of_peak']}); step MFU {s['step_mfu']}"
    )


def run_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """The run's overrides: the model and data asked for, no evaluation, report or saves."""
    out = [
        f"run.dir={work / 'run'}",
        "run.resume=never",
        "run.progress=false",
        "monitor.report=false",
        "data.eval=null",
        "train.eval_exact_match=false",
        f"method.name={args.method}",
    ]
    if args.precision != "auto":
        out.append(f"train.precision={args.precision}")
    if args.model_shape:
        from leantune.bench.model_shapes import build_model
        from leantune.models.demo_model import ensure_demo_model

        root = Path(args.shape_dir or tempfile.gettempdir())
        model = build_model(
            args.model_shape, root / f"model-{args.model_shape}", ensure_demo_model()
        )
        out.append(f"model.path={model}")
    elif args.model_path:
        out.append(f"model.path={args.model_path}")
    if args.train:
        out += [f"data.train={args.train}", "data.format=chat"]
    return [*out, *args.override]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="lora", choices=["lora", "full"])
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--model-shape", choices=["tiny", "0.5b"])
    ap.add_argument("--shape-dir", help="where --model-shape builds its model (default: tmp)")
    ap.add_argument("--model-path", help="a model directory instead of the demo model")
    ap.add_argument("--train", help="a chat JSONL instead of the demo data")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="unprofiled updates first")
    ap.add_argument("--steps", type=int, default=3, help="profiled updates")
    ap.add_argument("--peak-seconds", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=15, help="ops listed, the slowest first")
    ap.add_argument("override", nargs="*", help="more section.key=value overrides")
    args = ap.parse_args(argv)

    import torch

    from leantune.bench.throughput import matmul_peak

    torch.set_num_threads(args.threads)
    peak_dtype = "fp32" if args.precision == "fp32" else "bf16"
    peaks = [matmul_peak(peak_dtype, args.threads, seconds=args.peak_seconds)]
    rank = None if args.method == "full" else 16
    rank = next((int(o.split("=")[1]) for o in args.override if o.startswith("method.r=")), rank)
    with tempfile.TemporaryDirectory() as tmp:
        raw = profile_run(run_overrides(args, Path(tmp)), args.warmup, args.steps, rank)
    peaks.append(matmul_peak(peak_dtype, args.threads, seconds=args.peak_seconds))
    s = summarise(raw, args.warmup, max(peaks), args.top)
    print_table(s)
    line = {
        "benchmark": "step_profile",
        "method": args.method,
        "precision": args.precision,
        "model": args.model_shape or args.model_path or "demo",
        "threads": raw["threads"],
        "warmup": args.warmup,
        "steps": args.steps,
        "peak_dtype": peak_dtype,
        "peaks_gflops": [round(p, 1) for p in peaks],
        **s,
    }
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
