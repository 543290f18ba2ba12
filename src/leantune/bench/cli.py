"""The `leantune bench` subcommands: `methods` (every method on the same data) and
`throughput` (leantune against HF Trainer + PEFT)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantune.bench.throughput import add_arguments as throughput_arguments

SplitArgs = Callable[[list[str]], tuple[str | None, list[str]]]
"""`leantune.cli`'s split of positional arguments into a config file and overrides."""


def _parse_lrs(text: str | None, methods: list[str]) -> dict[str, float]:
    """`--lr lora=2e-3,full=5e-5`: a finite rate in (0, 1) for each named method."""
    lrs: dict[str, float] = {}
    for item in (text or "").split(","):
        if item.strip():
            name, _, value = item.partition("=")
            name = name.strip()
            try:
                rate = float(value)
            except ValueError:
                raise ValueError(f"--lr {item!r}: expected method=rate, e.g. lora=2e-4") from None
            if name not in methods:
                raise ValueError(
                    f"--lr {item!r}: unknown method {name!r}; choose from {', '.join(methods)}"
                )
            # NaN passes a range check, and train.lr must be in (0, 1).
            if not (math.isfinite(rate) and 0 < rate < 1):
                raise ValueError(f"--lr {item!r}: the rate must be a finite number in (0, 1)")
            lrs[name] = rate
    return lrs


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from leantune.bench.throughput import report

    return report(args)


def cmd_bench(args: argparse.Namespace, split_args: SplitArgs) -> int:
    from leantune.bench.methods import machine_info, run_methods, write_outputs
    from leantune.config import ConfigError, load_config
    from leantune.methods.registry import DEFAULT_LR, METHODS

    config, overrides = split_args(args.args)
    overrides = [*overrides, f"train.max_steps={args.steps}"] if args.steps else overrides
    cfg = load_config(config, overrides)  # validate once, before any run starts
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    lrs = {m: DEFAULT_LR[m] for m in methods}
    try:
        given = _parse_lrs(args.lr, list(METHODS))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lrs.update({m: v for m, v in given.items() if m in lrs})  # rates of unselected methods
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; give a directory for the benchmark's runs")
    log = lambda m: print(m, flush=True)  # noqa: E731
    results, base = run_methods(config, methods, lrs, out, overrides, log, args.reuse)
    meta = {
        "benchmark": "methods",
        "config": config or "demo",
        "model": cfg.model.path,
        "max_steps": cfg.train.max_steps,
        "micro_batch_size": cfg.train.micro_batch_size,
        "max_seq_len": cfg.data.max_seq_len,
        "machine": machine_info(),
    }
    payload = write_outputs(results, base, meta, out)
    print((out / "methods.md").read_text())
    print(f"wrote {out / 'methods.md'}, {out / 'methods.json'}, {out / 'methods.png'}")
    print(json.dumps(payload))
    return 0 if all(r.status == "ok" for r in results) else 1


def add_bench_parser(
    sub: Any, count: Callable[[int], Callable[[str], int]], split_args: SplitArgs
) -> None:
    """The `bench` subcommands."""
    b = sub.add_parser(
        "bench",
        help="benchmarks: `bench methods` (fine-tuning methods), `bench throughput` (vs HF)",
    )
    bsub = b.add_subparsers(dest="bench", required=True)
    bm = bsub.add_parser("methods", help="train each method on the same data and compare")
    bm.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    bm.add_argument("--methods", default=None, help="comma-separated (default: all)")
    bm.add_argument(
        "--steps", type=count(1), default=None, help="override train.max_steps (default: config's)"
    )
    bm.add_argument(
        "--lr",
        default=None,
        help="per-method rates, e.g. lora=2e-3,full=5e-5 (default: each method's default lr)",
    )
    bm.add_argument("--out", default="runs/bench-methods", help="output folder")
    bm.add_argument(
        "--reuse",
        action="store_true",
        help="read back methods whose run in --out already finished instead of training again",
    )
    bm.set_defaults(func=lambda args: cmd_bench(args, split_args))
    bt = bsub.add_parser("throughput", help="leantune against HF Trainer + PEFT on the same work")
    throughput_arguments(bt)
    bt.set_defaults(func=cmd_bench_throughput)
