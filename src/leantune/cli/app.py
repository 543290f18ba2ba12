"""Command line: a thin layer over the library.

leantune train [CONFIG.yaml] [--metrics-port N] [section.key=value ...]
leantune validate CONFIG.yaml [section.key=value ...] | --help-fields
leantune prepare CONFIG.yaml | --data FILE... --format F --model PATH [--out DIR] [--engine dask]
leantune plan [CONFIG.yaml] [--budget 24GiB] [--device cpu|cuda] [--json] [section.key=value ...]
leantune inspect [CONFIG.yaml] [section.key=value ...] [-n N] [--color auto|always|never]
leantune eval --model MODEL_OR_RUN --data FILE [--limit N] [--lm-eval TASKS [--lm-eval-limit N]]
leantune generate --model MODEL_OR_RUN --prompt TEXT [--chat] [sampling options]
leantune bench methods [CONFIG.yaml] [--methods a,b] [--out DIR] [section.key=value ...]
leantune bench throughput [--conversations N] [--reps N] [--methods lora,full]
leantune export RUN_OR_MODEL --format hf|adapter|gguf|torchscript|int8 --out DIR
leantune dashboard [RUNS_DIR] [--port N] [--host 127.0.0.1]
leantune report RUN_DIR [--out FILE]

Exit codes of `leantune train`: 0 done; 2 invalid config or data, or a run directory that is
not this run's (another process holds it, it is not a leantune run, or it holds a run with other
settings: the message lists them); 3 paused by the stability guard (a PAUSED marker in the run
dir; run the same command again to resume); 4 stopped by the guard (too many consecutive skipped
steps or rollbacks; a checkpoint was saved); 5 out of memory even at micro-batch size 1 (the
message names the next levers); 130 SIGINT, 143 SIGTERM, 129 SIGHUP (during training after a
checkpoint of the last applied step: the same command resumes). Every command: 70 an internal
error (a bug: one line names the log file that holds the traceback; `leantune.cli.crash`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from leantune.bench.cli import add_bench_parser
from leantune.cli.args import (
    Parser,
    RawEpilogHelpFormatter,
    count,
    quiet_libraries,
)
from leantune.cli.crash import report_internal_error
from leantune.cli.inference import (
    add_eval_parser,
    add_export_parser,
    add_generate_parser,
)
from leantune.testing.faults import install_env_faults


class _CpuAcceleratorNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" warning (CPU is what leantune runs on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def _quiet_import_noise() -> None:
    """peft imports torchao when it is installed; on a CPU build torchao logs a warning per
    CUDA-only extension it cannot load, and torch one per pytree registration: nothing a user
    can act on. peft and transformers import bitsandbytes, whose CPU backend logs a notice about
    an optional kernel on AVX512-BF16 CPUs: held back, and explained only when a 4-bit model
    loads (`models.bnb_notice`), and imported with the Hugging Face Hub offline (its optional
    kernel's lookup asks the Hub when `kernels` is installed) unless HF_HUB_OFFLINE=0. Set
    before any command imports peft."""
    from leantune.models.bnb_notice import hold_back_kernel_notice, import_offline

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hold_back_kernel_notice()
    import_offline()
    # With DeepSpeed installed (dist.strategy=deepspeed), transformers imports it inside every
    # save_pretrained, and on a machine without CUDA its accelerator detection prints a warning
    # (on stdout) that it picked the CPU. Its logger keeps this filter when DeepSpeed sets it up.
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _CpuAcceleratorNotice) for f in deepspeed.filters):
        deepspeed.addFilter(_CpuAcceleratorNotice())


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for a in args:
        if "=" not in a and config is None:
            config = a
        else:
            overrides.append(a)
    return config, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from leantune.config import AUTO_RUN_NAME, describe_base
    from leantune.core.signals import Interrupted
    from leantune.methods.registry import METHODS
    from leantune.models import bnb_import
    from leantune.monitor.events import TrainingHalted
    from leantune.training.checks import load_config
    from leantune.training.parallel.launch import exec_torchrun, rank_tag

    config, overrides = _split_config_args(args.args)
    if args.metrics_port is not None:  # after the config's own overrides: the flag wins
        overrides.append(f"monitor.metrics_port={args.metrics_port}")
    cfg = load_config(config, overrides)  # validated before torchrun starts anything
    # Where an internal error's log goes (`crash`); run.name=auto names it only at the start.
    args.run_dir = cfg.run.dir or (None if cfg.run.name == AUTO_RUN_NAME else cfg.run_dir)
    if args.nproc is not None:
        port = [] if args.metrics_port is None else [f"--metrics-port={args.metrics_port}"]
        exec_torchrun(args.nproc, args.max_restarts, ["train", *args.args, *port])
    if args.own_process:  # a caller of main() may import bitsandbytes after the run
        quantized = METHODS[cfg.method.name].base_quantization is not None
        bnb_import.hold_back(bnb_import.needed(quantized, cfg.train.optimizer, cfg.model.path))
    from leantune.training.recipe import train  # peft, transformers: after the hold-back

    tag = rank_tag()
    if not tag or tag.startswith("rank 0 "):
        print(describe_base(config, overrides), flush=True)
    quiet_libraries()
    try:
        train(cfg, log=lambda m: print(m, flush=True), config_file=Path(config) if config else None)
    except TrainingHalted as e:
        print(f"error: {tag}{e}" if e.exit_code != 3 else f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    return 0


def _print_fields() -> None:
    """Every config field as `section.key=default` (an override that sets the library default)
    with its one-line docstring."""
    import dataclasses

    from leantune.config import Config, field_docs

    cfg, docs = Config(), field_docs()
    for section in dataclasses.fields(Config):
        print(f"{section.name}:")
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            default = json.dumps(getattr(getattr(cfg, section.name), f.name), default=str)
            print(f"  {key}={default}\n      {docs.get(key, '')}")


def cmd_validate(args: argparse.Namespace) -> int:
    from leantune.config import config_base
    from leantune.training.checks import check_config, load_config

    if args.help_fields:
        _print_fields()
        return 0
    config, overrides = _split_config_args(args.args)
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


def cmd_prepare(args: argparse.Namespace) -> int:
    quiet_libraries()
    from leantune.cli.prepare import run, summary

    print(summary(run(args)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from leantune.config import parse_memory_size
    from leantune.core.allocator import train_allocator
    from leantune.training.checks import load_config
    from leantune.training.plan_report import format_text, plan

    if args.budget is not None:
        parse_memory_size(args.budget, "--budget")  # names the flag; plan() parses it again
    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    quiet_libraries()
    device = args.device or ("cpu" if cfg.train.device == "auto" else cfg.train.device)
    try:
        result = plan(cfg, device, args.budget, allocator=train_allocator())
    except (ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_text(result))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from leantune.data.dataset import check_usable
    from leantune.data.formats import BadLine
    from leantune.errors import UserError
    from leantune.training.checks import load_config

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    quiet_libraries()
    from dataclasses import replace

    from leantune.core.allocator import train_allocator
    from leantune.data.inspection import fit_rows, format_inspection, inspect_file
    from leantune.data.prepare.settings import settings_from_config
    from leantune.data.templates import apply_chat_template
    from leantune.methods.checks import effective_pack
    from leantune.models.loading import load_tokenizer, resolve_model
    from leantune.training.plan_report import format_text, plan
    from leantune.training.run_setup import FALLBACK_CONTEXT, model_context

    d = cfg.data
    assert d.train is not None  # load_config requires it
    if Path(d.train).is_dir():
        raise UserError(
            f"data.train {d.train}: a prepared directory; inspect the file(s) it was prepared from"
        )
    tokenizer = load_tokenizer(
        resolve_model(cfg.model.path, cfg.model.gguf_file), cfg.model.trust_remote_code
    )
    print(
        f"leantune inspect: {d.train} as data.format={d.format}, the tokenizer of {cfg.model.path}"
    )
    for warning in apply_chat_template(tokenizer, d.chat_template):
        print(f"warning: {warning}")
    settings = replace(settings_from_config(d), pack=effective_pack(d.pack, cfg.method.name))
    auto = d.max_seq_len == "auto"
    if auto:  # as train: filter at the model's context, then rows as long as the longest example
        source = resolve_model(cfg.model.path, cfg.model.gguf_file)
        context = model_context(source.location, source.gguf_file, cfg.model)
        settings = replace(settings, max_seq_len=context or FALLBACK_CONTEXT)
    ins = inspect_file(d.train, settings, tokenizer)
    if auto:
        settings = fit_rows(ins, settings)
    colour = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    )
    print(format_inspection(ins, tokenizer, settings, args.examples, colour))
    device = "cpu" if cfg.train.device == "auto" else cfg.train.device
    try:
        result = plan(cfg, device, None, ins.row_stats(), train_allocator())
        text = format_text(result)
    except (ValueError, MemoryError, UserError) as e:
        text = f"not available: {e}"
    print(f"\nmemory plan (as `leantune plan` predicts it):\n{text}")
    print("\nnothing was written and nothing was trained")
    # Data that train would refuse exits 2 with train's message (and the format to use).
    bad = [BadLine(r.source, r.line, r.reason) for r in ins.rejected]
    check_usable(d.train, ins.total, bad, ins.examples, d.max_bad_fraction, d.format)
    return 0


def _add_inspect_parser(sub: Any) -> None:
    """The `inspect` subcommand."""
    i = sub.add_parser(
        "inspect",
        help="show what would be trained: examples with supervised tokens marked, lengths, "
        "packing, bad lines and the memory plan (writes nothing)",
        description="Reads the data and tokenizer only (and the model's config for the memory "
        "plan); writes nothing. Supervised tokens are bright green on a terminal and between "
        "[[ and ]] otherwise. Exits 2 when train would refuse the data.",
    )
    i.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    i.add_argument(
        "-n", "--examples", type=count(0), default=3, help="examples to show (default 3)"
    )
    i.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the supervised tokens (auto: when stdout is a terminal and NO_COLOR is unset)",
    )
    i.set_defaults(func=cmd_inspect)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from leantune.monitor.dashboard.command import run

    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from leantune.monitor.report import write_report

    out = Path(args.out) if args.out else None
    print(f"report: {write_report(Path(args.run_dir), out=out)}")
    return 0


def _add_train_parser(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="fine-tune (no CONFIG and no data.train=...: the built-in demo)",
        epilog=__doc__.split("\n\n")[2],
        formatter_class=RawEpilogHelpFormatter,
    )
    t.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    t.add_argument(
        "--metrics-port",
        type=count(0, 65535),
        default=None,
        metavar="N",
        help="serve Prometheus metrics on 127.0.0.1:N/metrics and /health while training "
        "(monitor.metrics_port; 0: any free port; default: off)",
    )
    t.add_argument(
        "--nproc",
        type=count(1),
        default=None,
        metavar="N",
        help="run on N processes of this machine: execs `torchrun --standalone "
        "--nproc-per-node N -m leantune train ...` (dist.strategy: auto = ddp; default: this "
        "process alone)",
    )
    t.add_argument(
        "--max-restarts",
        type=count(0),
        default=0,
        metavar="R",
        help="with --nproc: torchrun restarts all processes up to R times after one fails; "
        "each restart resumes from the newest checkpoint (default: 0)",
    )
    t.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    from leantune import __version__

    p = Parser(
        prog="leantune",
        description="Fine-tune text-generation LLMs on the hardware you have. "
        "`leantune COMMAND --help` shows a command's flags and their defaults.",
    )
    p.add_argument("--version", action="version", version=f"leantune {__version__}")
    sub = p.add_subparsers(dest="command", required=True)  # parsers of the same class, Parser
    _add_train_parser(sub)
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("args", nargs="*", help="CONFIG.yaml [section.key=value ...]")
    v.add_argument(
        "--help-fields",
        action="store_true",
        help="list every config field with its default and what it means, then exit",
    )
    v.set_defaults(func=cmd_validate)
    from leantune.cli.prepare import add_arguments

    pr = sub.add_parser("prepare", help="clean, dedup, tokenise and pack data into shards")
    add_arguments(pr)
    pr.set_defaults(func=cmd_prepare)

    pl = sub.add_parser("plan", help="predict peak memory and the fastest settings that fit")
    pl.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    pl.add_argument(
        "--budget",
        default=None,
        help="e.g. 24GiB (default: train.memory_budget, else 90%% of available memory)",
    )
    pl.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cpu, or train.device when set",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    pl.set_defaults(func=cmd_plan)

    add_eval_parser(sub)
    add_generate_parser(sub)
    _add_inspect_parser(sub)

    add_bench_parser(sub, count, _split_config_args)
    add_export_parser(sub)
    from leantune.monitor.dashboard.command import add_arguments as dashboard_arguments

    d = sub.add_parser("dashboard", help="serve live charts of the runs in a folder (local only)")
    dashboard_arguments(d)
    d.set_defaults(func=cmd_dashboard)
    r = sub.add_parser("report", help="(re)build a run's report.html from its run directory")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (finished or not)")
    r.add_argument("--out", default=None, help="where to write it (default: RUN_DIR/report.html)")
    r.set_defaults(func=cmd_report)
    return p


ALLOCATOR_COMMANDS = frozenset({"train", "eval", "generate", "export", "bench"})
"""The commands that run a model: their own process re-executes itself with tcmalloc when it is
installed (`leantune.core.allocator`; LEANTUNE_ALLOCATOR=system keeps glibc's)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `leantune` console script."""
    from leantune.errors import UserError

    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # argparse ends a nargs="*" positional at the first flag: `train cfg.yaml --metrics-port
        # 9100 train.lr=1e-4` leaves the override over; it belongs to the CONFIG/overrides list.
        if extra and (
            not isinstance(getattr(args, "args", None), list)
            or any(x.startswith("-") for x in extra)
        ):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if extra:
            args.args += extra
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    _quiet_import_noise()
    install_env_faults()  # LEANTUNE_* test faults: runs started here only, never the library's
    args.own_process = argv is None  # the command line's own process, not a caller's
    try:
        if args.own_process and args.command in ALLOCATOR_COMMANDS:
            from leantune.core.allocator import reexec_with_allocator

            reexec_with_allocator()  # tcmalloc preloaded: returns only if already so, or not
        return int(args.func(args))
    except UserError as e:
        from leantune.training.parallel.launch import rank_tag

        print(f"error: {rank_tag()}{e}", file=sys.stderr)
        return e.exit_code
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside `train`, which handles its own signals
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `leantune ... | head`: the reader has all it wanted
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # leantune's bug: one labelled line, the traceback in a log file
        from leantune.training.parallel.launch import rank_tag

        run_dir = getattr(args, "run_dir", None)
        where = Path(run_dir) if run_dir else None
        return report_internal_error(e, sys.argv[1:] if argv is None else argv, where, rank_tag())


if __name__ == "__main__":
    sys.exit(main())
