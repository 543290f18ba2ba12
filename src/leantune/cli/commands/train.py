"""`leantune train`, `validate` and `plan`: a config (a file, overrides, or the demo) in, the
run, the checks or the memory plan out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from leantune.cli.args import split_config_args
from leantune.config import (
    AUTO_RUN_NAME,
    Config,
    config_base,
    describe_base,
    field_docs,
    parse_memory_size,
)
from leantune.core.allocator import train_allocator
from leantune.core.signals import Interrupted
from leantune.methods.registry import METHODS
from leantune.models import bnb_import
from leantune.models.quiet import quiet_libraries
from leantune.monitor.events import TrainingHalted
from leantune.training.checks import check_config, load_config
from leantune.training.parallel.launch import exec_torchrun, rank_tag


def cmd_train(args: argparse.Namespace) -> int:
    config, overrides = split_config_args(args.args)
    if args.metrics_port is not None:  # after the config's own overrides: the flag wins
        overrides.append(f"monitor.metrics_port={args.metrics_port}")
    cfg = load_config(config, overrides)  # validated before torchrun starts anything
    # Where an internal error's log goes (`crash`); run.name=auto names it only at the start.
    args.run_dir = cfg.run.dir or (None if cfg.run.name == AUTO_RUN_NAME else cfg.run_dir)
    if args.nproc is not None:
        # The command line as given (not the resolved config): every rank loads it itself.
        port = [] if args.metrics_port is None else [f"--metrics-port={args.metrics_port}"]
        exec_torchrun(args.nproc, args.max_restarts, ["train", *args.args, *port])
    if args.own_process:  # a caller of main() may import bitsandbytes after the run
        quantized = METHODS[cfg.method.name].base_quantization is not None
        bnb_import.hold_back(bnb_import.needed(quantized, cfg.train.optimizer, cfg.model.path))
    # peft and transformers import bitsandbytes: only after the hold-back above.
    from leantune.training import recipe

    tag = rank_tag()
    if not tag or tag.startswith("rank 0 "):  # once per run, not once per process
        print(describe_base(config, overrides), flush=True)
    quiet_libraries()
    try:
        log = lambda m: print(m, flush=True)  # noqa: E731
        recipe.train(cfg, log=log, config_file=Path(config) if config else None)
    except TrainingHalted as e:
        # 3 is a pause the same command resumes, not an error.
        print(f"error: {tag}{e}" if e.exit_code != 3 else f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    return 0


def print_fields() -> None:
    """Every config field as `section.key=default` (an override that sets the library default)
    with its one-line docstring."""
    cfg, docs = Config(), field_docs()
    for section in dataclasses.fields(Config):
        print(f"{section.name}:")
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            # JSON is also valid YAML, so the line works as an override as printed.
            default = json.dumps(getattr(getattr(cfg, section.name), f.name), default=str)
            print(f"  {key}={default}\n      {docs.get(key, '')}")


def cmd_validate(args: argparse.Namespace) -> int:
    if args.help_fields:
        print_fields()
        return 0
    config, overrides = split_config_args(args.args)
    cfg = load_config(config, overrides)
    for w in check_config(cfg):
        print(f"warning: {w}")
    if config is not None:
        print(f"ok: {config} is valid")
    elif config_base(config, overrides) == "demo":
        print("ok: built-in demo config is valid")
    else:
        print("ok: the library defaults with these overrides are valid")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    # Imported here, not at the top: it reaches peft, which imports bitsandbytes, and this
    # module's `cmd_train` must hold bitsandbytes back before anything imports peft.
    from leantune.training import plan_report

    if args.budget is not None:
        parse_memory_size(args.budget, "--budget")  # names the flag; plan() parses it again
    config, overrides = split_config_args(args.args)
    cfg = load_config(config, overrides)
    quiet_libraries()
    device = args.device or ("cpu" if cfg.train.device == "auto" else cfg.train.device)
    try:
        result = plan_report.plan(cfg, device, args.budget, allocator=train_allocator())
    except (ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Loads the model (twice, one copy at a time): only a base quantised while it loads has
    # such a cost, and the line is what a user weighs before choosing the method.
    # Local: it imports peft, which this module must not import before cmd_train's hold-back.
    from leantune.training.quant_cost import plan_cost

    cost = plan_cost(cfg)
    if cost is not None:
        result["quantization_cost"] = cost
    text = plan_report.format_text(result)
    print(json.dumps(result) if args.json else text + (f"\n{cost['line']}" if cost else ""))
    return 0
