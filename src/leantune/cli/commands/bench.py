"""`leantune bench methods`: every fine-tuning method trained on the same data and compared,
or each one's learning rate swept (`bench throughput` runs `leantune.bench.throughput.report`)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from leantune.bench import methods as method_bench
from leantune.bench.instructions import write_task
from leantune.bench.sweep import (
    JSON_FILE,
    TABLE_FILE,
    lr_grid,
    parse_grids,
    run_sweep,
    sweep_refusals,
    write_sweep,
)
from leantune.cli.args import split_config_args
from leantune.config import DEMO_CONFIG, Config, ConfigError
from leantune.core.writes import write_file
from leantune.methods.registry import DEFAULT_LR, METHODS
from leantune.training.checks import load_config


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


def _task_overrides(
    task: str | None, out: Path, config: str | None, sweep: bool
) -> tuple[str | None, list[str]]:
    """`--task instructions`: write the generated instruction task under `out` and point the
    data at it (the demo config otherwise, when no CONFIG is given). A sweep is scored on its
    validation split, the benchmark on its held-out one."""
    if task is None:
        return config, []
    train, held_out, valid = write_task(out / "task-data")
    # A sweep picks its rate by this score, so it must not see the split the benchmark reports:
    # choosing on the held-out split would overstate the chosen rate's result.
    scored = valid if sweep else held_out
    data = [f"data.train={train}", f"data.eval={scored}", "data.format=alpaca"]
    # Without a CONFIG, the demo's model and settings: data.train alone would start from the
    # library defaults (config_base), not from the demo.
    return config or str(DEMO_CONFIG), data


def _base_loss(cfg: Config, out: Path, reuse: bool) -> float | None:
    """The base model's held-out loss (for the loss retention), kept in `out`/base_loss.json
    for --reuse; None without held-out data or when the evaluation failed."""
    saved = out / "base_loss.json"
    if reuse and saved.is_file():  # the base model is the same for every method: evaluate once
        loss = json.loads(saved.read_text()).get("loss")
        return float(loss) if isinstance(loss, (int, float)) else None
    if cfg.data.eval is None:
        return None
    print("base model: held-out loss before training", flush=True)
    fmt, limit, width = cfg.data.format, cfg.train.eval_limit, cfg.data.max_seq_len
    # In a child process, like every method's run: a crash or the memory it holds stays there.
    cmd = method_bench.base_loss_command(cfg.model.path, str(cfg.data.eval), fmt, limit, width)
    loss = method_bench.base_eval_loss(cmd, out / "base_loss.log")
    out.mkdir(parents=True, exist_ok=True)
    write_file(saved, json.dumps({"loss": loss}) + "\n")
    return loss


def _selected(args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    return methods


def cmd_bench(args: argparse.Namespace) -> int:
    config, overrides = split_config_args(args.args)
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
    # Rates given for methods that are not selected are accepted and ignored.
    lrs.update({m: v for m, v in given.items() if m in lrs})
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
        "machine": method_bench.machine_info(),
    }
    if args.sweep:
        return _sweep(args, config, overrides, methods, lrs, out, meta)
    log = lambda m: print(m, flush=True)  # noqa: E731
    # Before any work: a missing extra is said first, not after minutes of other methods' runs.
    refused = method_bench.refusals(config, methods, lrs, out, overrides, args.reuse)
    for r in refused.values():
        log(f"{r.method}: {'skipped' if r.status == 'skipped' else 'refused'}, not run: {r.error}")
    base_loss = _base_loss(cfg, out, args.reuse) if method_bench.BASELINE in methods else None
    results, base = method_bench.run_methods(
        config, methods, lrs, out, overrides, log, args.reuse, refused
    )
    method_bench.add_retention(results, base_loss)
    payload = method_bench.write_outputs(results, base, meta, out, base_loss)
    print((out / method_bench.TABLE_FILE).read_text())
    written = (method_bench.TABLE_FILE, method_bench.JSON_FILE, method_bench.PLOT_FILE)
    print(f"wrote {', '.join(str(out / name) for name in written)}")
    print(json.dumps(payload))
    # A method that failed: its run's exit code (2 when train refused its settings or data).
    # A skipped one (its optional package is missing) is not a failure: 0 when every method
    # that could run ran, and 2 when none could (nothing was measured).
    failed = [r.exit_code or 1 for r in results if r.status == "failed"]
    if failed:
        return failed[0]
    return 0 if any(r.status == "ok" for r in results) else 2


def _sweep(
    args: argparse.Namespace,
    config: str | None,
    overrides: list[str],
    methods: list[str],
    centers: dict[str, float],
    out: Path,
    meta: dict[str, Any],
) -> int:
    # A factor of 1 or less makes the grid's rates equal or reversed; argparse's float takes nan.
    if not (math.isfinite(args.factor) and args.factor > 1):
        raise ConfigError(f"--factor {args.factor}: must be a finite number above 1")
    try:
        given = parse_grids(args.grid, list(METHODS))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grids = {m: given.get(m) or lr_grid(centers[m], args.points, args.factor) for m in methods}
    log = lambda m: print(m, flush=True)  # noqa: E731
    # Before any run, as `bench methods` does: a missing extra is said first, with its install
    # line, not as one failed run per rate.
    refused = sweep_refusals(config, grids, DEFAULT_LR, out, overrides)
    for r in refused.values():
        log(f"{r.method}: {'skipped' if r.status == 'skipped' else 'refused'}, not run: {r.error}")
    sweeps = run_sweep(config, grids, DEFAULT_LR, out, overrides, log, args.reuse, refused=refused)
    payload = write_sweep(sweeps, meta, out)
    print((out / TABLE_FILE).read_text())
    print(f"wrote {out / TABLE_FILE}, {out / JSON_FILE}")
    print(json.dumps(payload))
    ran = [s for s in sweeps if s.status == "ok"]
    # 2: a refused setting is the user's to fix, or nothing could run (nothing was measured).
    if not ran or any(s.status == "refused" for s in sweeps):
        return 2
    # 1 when no run of some method gave a finite held-out loss: no rate to recommend for it.
    # A skipped method (its optional package is missing) is not a failure.
    return 0 if all(s.chosen_lr is not None for s in ran) else 1
