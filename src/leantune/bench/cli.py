"""The `leantune bench` subcommands: `methods` (every method on the same data) and
`throughput` (leantune against HF Trainer + PEFT)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leantune.bench.throughput import add_arguments as throughput_arguments
from leantune.core.writes import write_file

if TYPE_CHECKING:
    from leantune.config import Config

SplitArgs = Callable[[list[str]], tuple[str | None, list[str]]]
"""`leantune.cli.app`'s split of positional arguments into a config file and overrides."""


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


def _task_overrides(
    task: str | None, out: Path, config: str | None, sweep: bool
) -> tuple[str | None, list[str]]:
    """`--task instructions`: write the generated instruction task under `out` and point the
    data at it (the demo config otherwise, when no CONFIG is given). A sweep is scored on its
    validation split, the benchmark on its held-out one."""
    if task is None:
        return config, []
    from leantune.bench.instructions import write_task
    from leantune.config import DEMO_CONFIG

    train, held_out, valid = write_task(out / "task-data")
    scored = valid if sweep else held_out
    data = [f"data.train={train}", f"data.eval={scored}", "data.format=alpaca"]
    return config or str(DEMO_CONFIG), data


def _base_loss(cfg: Config, out: Path, reuse: bool) -> float | None:
    """The base model's held-out loss (for the loss retention), kept in `out`/base_loss.json
    for --reuse; None without held-out data or when the evaluation failed."""
    from leantune.bench.methods import base_eval_loss, base_loss_command

    saved = out / "base_loss.json"
    if reuse and saved.is_file():
        loss = json.loads(saved.read_text()).get("loss")
        return float(loss) if isinstance(loss, (int, float)) else None
    if cfg.data.eval is None:
        return None
    print("base model: held-out loss before training", flush=True)
    fmt, limit, width = cfg.data.format, cfg.train.eval_limit, cfg.data.max_seq_len
    cmd = base_loss_command(cfg.model.path, str(cfg.data.eval), fmt, limit, width)
    loss = base_eval_loss(cmd, out / "base_loss.log")
    out.mkdir(parents=True, exist_ok=True)
    write_file(saved, json.dumps({"loss": loss}) + "\n")
    return loss


def _selected(args: argparse.Namespace) -> list[str]:
    from leantune.config import ConfigError
    from leantune.methods.registry import METHODS

    methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    return methods


def cmd_bench(args: argparse.Namespace, split_args: SplitArgs) -> int:
    from leantune.bench.methods import (
        BASELINE,
        JSON_FILE,
        PLOT_FILE,
        TABLE_FILE,
        add_retention,
        machine_info,
        run_methods,
        write_outputs,
    )
    from leantune.config import ConfigError
    from leantune.methods.registry import DEFAULT_LR, METHODS
    from leantune.training.checks import load_config

    config, overrides = split_args(args.args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; give a directory for the benchmark's runs")
    config, data = _task_overrides(args.task, out, config, args.sweep)
    overrides = [*overrides, *data]
    overrides = [*overrides, f"train.max_steps={args.steps}"] if args.steps else overrides
    cfg = load_config(config, overrides)  # validate once, before any run starts
    methods = _selected(args)
    lrs = {m: DEFAULT_LR[m] for m in methods}
    try:
        given = _parse_lrs(args.lr, list(METHODS))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lrs.update({m: v for m, v in given.items() if m in lrs})  # rates of unselected methods
    meta = {
        "benchmark": "methods-sweep" if args.sweep else "methods",
        "config": config or "demo",
        "task": args.task or "config",
        "model": cfg.model.path,
        "train_data": str(cfg.data.train),
        "scored_on": str(cfg.data.eval),
        "max_steps": cfg.train.max_steps,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.grad_accum,
        "max_seq_len": cfg.data.max_seq_len,
        "eval_limit": cfg.train.eval_limit,
        "machine": machine_info(),
    }
    if args.sweep:
        return _sweep(args, config, overrides, methods, lrs, out, meta)
    log = lambda m: print(m, flush=True)  # noqa: E731
    base_loss = _base_loss(cfg, out, args.reuse) if BASELINE in methods else None
    results, base = run_methods(config, methods, lrs, out, overrides, log, args.reuse)
    add_retention(results, base_loss)
    payload = write_outputs(results, base, meta, out, base_loss)
    print((out / TABLE_FILE).read_text())
    print(f"wrote {out / TABLE_FILE}, {out / JSON_FILE}, {out / PLOT_FILE}")
    print(json.dumps(payload))
    # A method that failed: its run's exit code (2 when train refused its settings or data).
    failed = [r.exit_code or 1 for r in results if r.status != "ok"]
    return failed[0] if failed else 0


def _sweep(
    args: argparse.Namespace,
    config: str | None,
    overrides: list[str],
    methods: list[str],
    centers: dict[str, float],
    out: Path,
    meta: dict[str, Any],
) -> int:
    from leantune.bench.sweep import (
        JSON_FILE,
        TABLE_FILE,
        lr_grid,
        parse_grids,
        run_sweep,
        write_sweep,
    )
    from leantune.config import ConfigError
    from leantune.methods.registry import DEFAULT_LR, METHODS

    if not (math.isfinite(args.factor) and args.factor > 1):
        raise ConfigError(f"--factor {args.factor}: must be a finite number above 1")
    try:
        given = parse_grids(args.grid, list(METHODS))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grids = {m: given.get(m) or lr_grid(centers[m], args.points, args.factor) for m in methods}
    log = lambda m: print(m, flush=True)  # noqa: E731
    sweeps = run_sweep(config, grids, DEFAULT_LR, out, overrides, log, args.reuse)
    payload = write_sweep(sweeps, meta, out)
    print((out / TABLE_FILE).read_text())
    print(f"wrote {out / TABLE_FILE}, {out / JSON_FILE}")
    print(json.dumps(payload))
    return 0 if all(s.chosen_lr is not None for s in sweeps) else 1


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
    bm.add_argument(
        "--task",
        choices=["instructions"],
        default=None,
        help="train on a generated task: instructions = alpaca-style instructions with free-text "
        "answers (bench/instructions.py; default: the config's data)",
    )
    bm.add_argument(
        "--sweep",
        action="store_true",
        help="sweep each method's learning rate instead (short runs, picked by held-out loss)",
    )
    bm.add_argument(
        "--grid",
        default=None,
        help="--sweep: rates per method, e.g. ia3=1e-2:3e-2:1e-1 (default: --points rates "
        "--factor apart around --lr or the method's default)",
    )
    bm.add_argument("--points", type=count(1), default=3, help="--sweep: rates per method")
    bm.add_argument(
        "--factor",
        type=float,
        default=3.16,
        help="--sweep: ratio of neighbouring rates (default: 3.16, half a decade)",
    )
    bm.set_defaults(func=lambda args: cmd_bench(args, split_args))
    bt = bsub.add_parser("throughput", help="leantune against HF Trainer + PEFT on the same work")
    throughput_arguments(bt)
    bt.set_defaults(func=cmd_bench_throughput)
