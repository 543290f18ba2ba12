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
message names the next levers); 130 SIGINT, 143 SIGTERM (during training after a checkpoint of
the last applied step: the same command resumes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantune.bench.cli import add_bench_parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; argparse names the flag in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    return parse


def _number(ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: a finite float for which `ok` holds (`rule` says which, e.g. ">= 0")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        # float() reads "nan" and "inf", and NaN would pass any range check.
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


def check_model_path(path: str, label: str) -> None:
    """`models.paths.check_model_path`: refuse a path that is not a model, importing no torch."""
    from leantune.models.paths import check_model_path as check

    check(path, label)


def _check_data_file(text: str, flag: str) -> Path:
    """The JSONL file given as `flag`, or a UserError naming the flag and the path."""
    from leantune.errors import UserError

    path = Path(text)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a JSONL file")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    return path


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
    from leantune.config import describe_base, load_config
    from leantune.methods.registry import METHODS
    from leantune.models import bnb_import
    from leantune.training.distributed.launch import exec_torchrun, rank_tag
    from leantune.training.events import TrainingHalted
    from leantune.training.signals import Interrupted

    config, overrides = _split_config_args(args.args)
    if args.metrics_port is not None:  # after the config's own overrides: the flag wins
        overrides.append(f"monitor.metrics_port={args.metrics_port}")
    cfg = load_config(config, overrides)  # validated before torchrun starts anything
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
    _quiet_libraries()
    try:
        train(cfg, log=lambda m: print(m, flush=True), config_file=Path(config) if config else None)
    except TrainingHalted as e:
        print(f"error: {tag}{e}" if e.exit_code != 3 else f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"{tag}{e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a traceback follows; it says which rank raised it
        if tag:
            e.add_note(f"leantune: raised on {tag.rstrip(': ')}")
        raise
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
    from leantune.config import config_base, load_config, validate

    if args.help_fields:
        _print_fields()
        return 0
    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    for w in validate(cfg):
        print(f"warning: {w}")
    if config is not None:
        print(f"ok: {config} is valid")
    elif config_base(config, overrides) == "demo":
        print("ok: built-in demo config is valid")
    else:
        print("ok: the library defaults with these overrides are valid")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from leantune.data.prepare.command import run, summary

    print(summary(run(args)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from leantune.config import load_config, parse_memory_size
    from leantune.memory.report import format_text, plan

    if args.budget is not None:
        parse_memory_size(args.budget, "--budget")  # names the flag; plan() parses it again
    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    _quiet_libraries()
    device = args.device or ("cpu" if cfg.train.device == "auto" else cfg.train.device)
    try:
        result = plan(cfg, device, args.budget)
    except (ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_text(result))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from leantune.config import load_config
    from leantune.data.dataset import check_usable
    from leantune.data.formats import BadLine
    from leantune.errors import UserError

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    _quiet_libraries()
    from dataclasses import replace

    from leantune.config import effective_pack
    from leantune.data.inspection import fit_rows, format_inspection, inspect_file
    from leantune.data.prepare.command import settings_from_config
    from leantune.data.templates import apply_chat_template
    from leantune.memory.report import format_text, plan
    from leantune.models.loading import load_tokenizer, resolve_model
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
        text = format_text(plan(cfg, device, None, row_stats=ins.row_stats()))
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
        "-n", "--examples", type=_count(0), default=3, help="examples to show (default 3)"
    )
    i.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the supervised tokens (auto: when stdout is a terminal and NO_COLOR is unset)",
    )
    i.set_defaults(func=cmd_inspect)


def _lm_eval_tasks(args: argparse.Namespace) -> list[str]:
    """The --lm-eval task names, checked with --lm-eval-include before any model loads."""
    from leantune.errors import UserError

    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    if not tasks:
        raise UserError(f"--lm-eval: no task names in {args.lm_eval!r}; e.g. --lm-eval hellaswag")
    include = args.lm_eval_include
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--lm-eval-include {include}: no such directory (of task YAML files)")
    return tasks


def _lm_eval(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, dict[str, float]]:
    from leantune.errors import UserError
    from leantune.eval.harness import run_lm_eval, summarize

    try:
        out = run_lm_eval(
            model,
            tokenizer,
            _lm_eval_tasks(args),
            limit=args.lm_eval_limit,
            include_path=args.lm_eval_include,
            batch_size=args.batch_size,
        )
    except ImportError as e:  # lm-eval is an optional extra; the message says how to install it
        raise UserError(str(e)) from e
    except KeyError as e:  # lm-eval's way of saying a task name is unknown
        raise UserError(f"--lm-eval {args.lm_eval}: {e.args[0] if e.args else e}") from e
    return summarize(out)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.data is None and not args.lm_eval:
        print("error: eval needs --data FILE and/or --lm-eval TASKS", file=sys.stderr)
        return 2
    path = _check_data_file(args.data, "--data") if args.data is not None else None
    if args.lm_eval:
        _lm_eval_tasks(args)
    check_model_path(args.model, "--model")  # before the libraries that load it are imported
    _check_chat_template(args.chat_template)
    _quiet_libraries()
    import torch

    from leantune.eval.run import evaluate_file
    from leantune.models.artifacts import load_for_inference

    torch.manual_seed(0)
    model, tokenizer = load_for_inference(
        args.model, args.dtype, attn_implementation=args.attn_implementation
    )
    _use_chat_template(tokenizer, args.chat_template)
    result: dict[str, object] = {"model": args.model}
    if path is not None:
        result |= evaluate_file(
            model,
            tokenizer,
            path,
            args.format,
            args.limit,
            args.batch_size,
            args.max_new_tokens,
            args.max_seq_len,
            on_bad_line=lambda bad: print(f"bad line skipped: {bad}", file=sys.stderr),
        )
    if args.lm_eval:
        result["lm_eval"] = _lm_eval(args, model, tokenizer)
    print(json.dumps(result, indent=2))
    return 0


def _check_chat_template(spec: str | None) -> None:
    """A --chat-template that is no built-in and no readable Jinja file: exit 2 before loading."""
    if spec is not None:
        from leantune.data.templates import template_text

        template_text(spec)


def _use_chat_template(tokenizer: Any, spec: str | None) -> None:
    """Give the loaded tokenizer --chat-template (for a model without one, or to override it)."""
    from leantune.data.templates import apply_chat_template

    for warning in apply_chat_template(tokenizer, spec):
        print(
            f"warning: {warning.replace('data.chat_template', '--chat-template')}", file=sys.stderr
        )


def _check_generate_args(args: argparse.Namespace) -> None:
    """The checks of `generate` that need no model: run before it loads."""
    from leantune.errors import UserError

    if args.prompt is None and not args.chat:
        raise UserError("generate needs --prompt TEXT, or --chat for a conversation on stdin")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt: empty; give the text to answer")


def _decoding(args: argparse.Namespace, model: Any) -> Any:
    """The model's generation_config (else greedy), with the sampling flags given applied."""
    from leantune.errors import UserError
    from leantune.eval.generation import model_sampling, with_overrides

    try:
        base = model_sampling(getattr(model, "generation_config", None))
    except ValueError as e:
        raise UserError(f"--model {args.model}: {e}; set the sampling flags instead") from None
    return with_overrides(
        base,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    _check_generate_args(args)
    check_model_path(args.model, "--model")  # before the libraries that load it are imported
    _check_chat_template(args.chat_template)
    _quiet_libraries()
    from leantune.eval.generation import generate_texts, render_prompt
    from leantune.models.artifacts import load_for_inference

    model, tokenizer = load_for_inference(
        args.model, args.dtype, attn_implementation=args.attn_implementation
    )
    _use_chat_template(tokenizer, args.chat_template)
    settings = _decoding(args, model)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    prompt = args.prompt
    while True:
        if prompt is None:  # --chat: the next turn from stdin
            try:
                prompt = input("you> ")
            except EOFError:
                return 0
            if prompt.strip() in ("/exit", "/quit"):
                return 0
            if not prompt.strip():
                prompt = None
                continue
        if has_template and not args.raw:
            history.append({"role": "user", "content": prompt})
            text = render_prompt(tokenizer, history)
        else:
            text = prompt
        (reply,) = generate_texts(model, tokenizer, [text], settings, batch_size=1, seed=args.seed)
        print(("assistant> " if args.chat else "") + reply, flush=True)
        if not args.chat:
            return 0
        history.append({"role": "assistant", "content": reply})
        prompt = None


EXPORT_FORMATS = ("hf", "adapter", "gguf", "torchscript", "int8")


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from leantune.export.parity import ParityError
    from leantune.export.run import export_model

    data = Path(args.data) if args.data else None
    try:
        report = export_model(
            args.model,
            args.format,
            Path(args.out),
            args.gguf_type,
            data,
            args.samples,
            args.attn_implementation,
        )
    except ParityError as e:  # the export was written but does not reproduce the source
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from leantune.monitor.dashboard.command import run

    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from leantune.monitor.report import write_report

    out = Path(args.out) if args.out else None
    print(f"report: {write_report(Path(args.run_dir), out=out)}")
    return 0


MODEL_HELP = "model dir, run dir (its final/), adapter dir, .gguf file, cached hub id or demo name"
DTYPES = ("fp32", "bf16", "fp16")


CHAT_TEMPLATE_HELP = (
    "chatml, zephyr, llama3 or a Jinja file: the chat template to use instead of the "
    "tokenizer's (default: the tokenizer's own, as saved with the model)"
)


def _add_eval_parser(sub: Any) -> None:
    """The `eval` subcommand."""
    from leantune.config_checks import MAX_SEQ_LEN
    from leantune.data.formats import FORMATS

    e = sub.add_parser("eval", help="loss, perplexity and exact match of a model on a JSONL file")
    e.add_argument("--model", required=True, help=MODEL_HELP)
    e.add_argument("--data", default=None, help=f"data file ({', '.join(FORMATS)})")
    e.add_argument("--format", choices=FORMATS, help="default: detected")
    e.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    e.add_argument(
        "--limit", type=_count(1), default=None, help="evaluate the first N examples (default: all)"
    )
    e.add_argument("--batch-size", type=_count(1), default=16, help="examples per forward pass")
    e.add_argument(
        "--max-new-tokens", type=_count(1), default=128, help="longest answer for exact match"
    )
    e.add_argument(
        "--max-seq-len", type=_count(1, MAX_SEQ_LEN), default=4096, help="longest example, tokens"
    )
    e.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    _add_attention_argument(e)
    e.add_argument(
        "--lm-eval",
        default=None,
        metavar="TASKS",
        help="lm-eval tasks, comma-separated (default: none)",
    )
    e.add_argument(
        "--lm-eval-limit",
        type=_count(1),
        default=None,
        help="first N documents per task (default: all)",
    )
    e.add_argument(
        "--lm-eval-include",
        default=None,
        help="directory of custom task YAML files (default: lm-eval's own tasks only)",
    )
    e.set_defaults(func=cmd_eval)


def _add_generate_parser(sub: Any) -> None:
    """The `generate` subcommand."""
    g = sub.add_parser(
        "generate",
        help="generate a reply (or chat with --chat)",
        description="Decoding follows the model's generation_config.json (do_sample, "
        "temperature, top_p, top_k, repetition_penalty, max_new_tokens) and is greedy without "
        "one; each flag given replaces that one value. --top-p or --top-k on a greedy model "
        "samples at temperature 1.",
    )
    g.add_argument("--model", required=True, help=MODEL_HELP)
    g.add_argument("--prompt", default=None, help="the user message (first turn with --chat)")
    g.add_argument("--chat", action="store_true", help="multi-turn conversation on stdin")
    g.add_argument("--system", default=None, help="system message (default: none)")
    g.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    from_model = "default: the model's generation_config, else %s"
    g.add_argument("--max-new-tokens", type=_count(1), default=None, help=from_model % "256")
    g.add_argument(
        "--temperature",
        type=_number(lambda v: v >= 0, ">= 0"),
        default=None,
        help="0 = greedy; " + from_model % "greedy",
    )
    g.add_argument(
        "--top-p",
        type=_number(lambda v: 0 < v <= 1, "in (0, 1]"),
        default=None,
        help="nucleus sampling; " + from_model % "1 (off)",
    )
    g.add_argument("--top-k", type=_count(0), default=None, help="0 = off; " + from_model % "50")
    g.add_argument(
        "--repetition-penalty",
        type=_number(lambda v: v > 0, "> 0"),
        default=None,
        help="1 = off; " + from_model % "1",
    )
    g.add_argument("--seed", type=_count(0, 2**63 - 1), default=0, help="seeds sampling")
    g.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    _add_attention_argument(g)
    g.set_defaults(func=cmd_generate)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Options show their default: the value, or the help's own words for one that is not a
    plain value (`default: ...` in the help, e.g. "detected"). On/off flags are off unless given.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0:
            return text
        if action.default is None or action.default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


class _RawEpilogHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the description and epilog kept as written (a table)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; subcommand parsers are made of it too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_export_parser(sub: Any) -> None:
    """The `export` subcommand."""
    x = sub.add_parser("export", help="export a model, then check parity with the source")
    x.add_argument("model", metavar="RUN_OR_MODEL", help="run dir (exports final/) or model dir")
    x.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="what to write")
    x.add_argument("--out", required=True, help="output directory (new or an earlier export)")
    x.add_argument(
        "--gguf-type", choices=["f16", "bf16", "q8_0"], default="f16", help="GGUF weight type"
    )
    x.add_argument(
        "--data",
        default=None,
        help="held-out JSONL for the parity check (default: built-in prompts)",
    )
    x.add_argument(
        "--samples", type=_count(1), default=4, help="held-out samples for the parity check"
    )
    _add_attention_argument(x)
    x.set_defaults(func=cmd_export)


def _add_attention_argument(p: argparse.ArgumentParser) -> None:
    """train's model.attn_implementation, for the commands that load a model to use it."""
    choices = ["auto", "segments", "sdpa", "eager"]
    about = "as train's model.attn_implementation; auto: sdpa, or eager where there is none"
    p.add_argument("--attn-implementation", choices=choices, default="auto", help=about)


def _add_train_parser(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="fine-tune (no CONFIG and no data.train=...: the built-in demo)",
        epilog=__doc__.split("\n\n")[2],
        formatter_class=_RawEpilogHelpFormatter,
    )
    t.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    t.add_argument(
        "--metrics-port",
        type=_count(0, 65535),
        default=None,
        metavar="N",
        help="serve Prometheus metrics on 127.0.0.1:N/metrics and /health while training "
        "(monitor.metrics_port; 0: any free port; default: off)",
    )
    t.add_argument(
        "--nproc",
        type=_count(1),
        default=None,
        metavar="N",
        help="run on N processes of this machine: execs `torchrun --standalone "
        "--nproc-per-node N -m leantune train ...` (dist.strategy: auto = ddp; default: this "
        "process alone)",
    )
    t.add_argument(
        "--max-restarts",
        type=_count(0),
        default=0,
        metavar="R",
        help="with --nproc: torchrun restarts all processes up to R times after one fails; "
        "each restart resumes from the newest checkpoint (default: 0)",
    )
    t.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    from leantune import __version__

    p = _Parser(
        prog="leantune",
        description="Fine-tune text-generation LLMs on the hardware you have. "
        "`leantune COMMAND --help` shows a command's flags and their defaults.",
    )
    p.add_argument("--version", action="version", version=f"leantune {__version__}")
    sub = p.add_subparsers(dest="command", required=True)  # parsers of the same class, _Parser
    _add_train_parser(sub)
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("args", nargs="*", help="CONFIG.yaml [section.key=value ...]")
    v.add_argument(
        "--help-fields",
        action="store_true",
        help="list every config field with its default and what it means, then exit",
    )
    v.set_defaults(func=cmd_validate)
    from leantune.data.prepare.command import add_arguments

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

    _add_eval_parser(sub)
    _add_generate_parser(sub)
    _add_inspect_parser(sub)

    add_bench_parser(sub, _count, _split_config_args)
    _add_export_parser(sub)
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
installed (`leantune.training.allocator`; LEANTUNE_ALLOCATOR=system keeps glibc's)."""


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
    args.own_process = argv is None  # the command line's own process, not a caller's
    try:
        if args.own_process and args.command in ALLOCATOR_COMMANDS:
            from leantune.training.allocator import reexec_with_allocator

            reexec_with_allocator()  # tcmalloc preloaded: returns only if already so, or not
        return int(args.func(args))
    except UserError as e:
        from leantune.training.distributed.launch import rank_tag

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


if __name__ == "__main__":
    sys.exit(main())
