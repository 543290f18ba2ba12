"""The flags of the commands that use a trained model, `eval`, `generate` and `export` (they run
in `cli.commands.inference` and `cli.commands.export`), and the checks of those flags that need
no model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from leantune.cli.args import (
    CHAT_TEMPLATE_HELP,
    DTYPES,
    MODEL_HELP,
    add_attention_argument,
    check_data_file,
    count,
    number,
    runs,
)
from leantune.config.limits import MAX_SEQ_LEN
from leantune.data.formats import FORMATS
from leantune.data.templates import template_text
from leantune.errors import UserError
from leantune.models.paths import check_model_path

EXPORT_FORMATS = ("hf", "adapter", "gguf", "torchscript", "int8")


def add_parsers(sub: Any) -> None:
    """`eval`, `generate` and `export`."""
    add_eval_parser(sub)
    add_generate_parser(sub)
    add_export_parser(sub)


def check_eval(args: argparse.Namespace) -> None:
    """eval's flags, before the libraries that load the model are imported."""
    if args.data is None and not args.lm_eval:
        raise UserError("eval needs --data FILE and/or --lm-eval TASKS")
    if args.data is not None:
        check_data_file(args.data, "--data")
    if args.lm_eval:
        lm_eval_tasks(args)
    check_model_path(args.model, "--model")
    check_chat_template(args.chat_template)


def check_generate(args: argparse.Namespace) -> None:
    """generate's flags, before the libraries that load the model are imported."""
    if args.prompt is None and not args.chat:
        raise UserError("generate needs --prompt TEXT, or --chat for a conversation on stdin")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt: empty; give the text to answer")
    check_model_path(args.model, "--model")
    check_chat_template(args.chat_template)


def check_chat_template(spec: str | None) -> None:
    """A --chat-template that is no built-in and no readable Jinja file: exit 2 before loading."""
    if spec is not None:
        template_text(spec)  # called for its UserError; the text is read again after loading


def lm_eval_tasks(args: argparse.Namespace) -> list[str]:
    """The --lm-eval task names, checked with --lm-eval-include before any model loads."""
    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    if not tasks:
        raise UserError(f"--lm-eval: no task names in {args.lm_eval!r}; e.g. --lm-eval hellaswag")
    # Task names themselves are only known to lm-eval, which loads with the model; the folder
    # can be checked now.
    include = args.lm_eval_include
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--lm-eval-include {include}: no such directory (of task YAML files)")
    return tasks


def add_eval_parser(sub: Any) -> None:
    """The `eval` subcommand."""
    e = sub.add_parser(
        "eval",
        help="loss, perplexity and exact match of a model on a JSONL file (preference pairs: "
        "accuracy and margin)",
    )
    e.add_argument("--model", required=True, help=MODEL_HELP)
    e.add_argument("--data", default=None, help=f"data file ({', '.join(FORMATS)})")
    e.add_argument("--format", choices=FORMATS, help="default: detected")
    e.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    e.add_argument(
        "--limit", type=count(1), default=None, help="evaluate the first N examples (default: all)"
    )
    e.add_argument("--batch-size", type=count(1), default=16, help="examples per forward pass")
    e.add_argument(
        "--max-new-tokens",
        type=count(1),
        default=None,
        help="longest answer for exact match (default: the longest reference answer's tokens "
        "+ max(16, 25%%))",
    )
    e.add_argument(
        "--max-seq-len", type=count(1, MAX_SEQ_LEN), default=4096, help="longest example, tokens"
    )
    e.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    add_attention_argument(e)
    add_quiet_argument(e)
    e.add_argument(
        "--lm-eval",
        default=None,
        metavar="TASKS",
        help="lm-eval tasks, comma-separated (default: none)",
    )
    e.add_argument(
        "--lm-eval-limit",
        type=count(1),
        default=None,
        help="first N documents per task (default: all)",
    )
    e.add_argument(
        "--lm-eval-include",
        default=None,
        help="directory of custom task YAML files (default: lm-eval's own tasks only)",
    )
    runs(e, "leantune.cli.commands.inference:cmd_eval", check_eval)


def add_generate_parser(sub: Any) -> None:
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
    g.add_argument("--max-new-tokens", type=count(1), default=None, help=from_model % "256")
    g.add_argument(
        "--temperature",
        type=number(lambda v: v >= 0, ">= 0"),
        default=None,
        help="0 = greedy; " + from_model % "greedy",
    )
    g.add_argument(
        "--top-p",
        type=number(lambda v: 0 < v <= 1, "in (0, 1]"),
        default=None,
        help="nucleus sampling; " + from_model % "1 (off)",
    )
    g.add_argument("--top-k", type=count(0), default=None, help="0 = off; " + from_model % "50")
    g.add_argument(
        "--repetition-penalty",
        type=number(lambda v: v > 0, "> 0"),
        default=None,
        help="1 = off; " + from_model % "1",
    )
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0, help="seeds sampling")
    g.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    add_attention_argument(g)
    add_quiet_argument(g)
    runs(g, "leantune.cli.commands.inference:cmd_generate", check_generate)


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """--quiet: no progress line (it shows only on a terminal anyway) and no notes on stderr."""
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress line or notes on stderr (the line shows only on a terminal)",
    )


def add_export_parser(sub: Any) -> None:
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
        "--samples", type=count(1), default=4, help="held-out samples for the parity check"
    )
    add_attention_argument(x)
    runs(x, "leantune.cli.commands.export:cmd_export")
