"""`leantune eval`, `generate` and `export`: the commands that use a trained model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from leantune.cli.args import (
    CHAT_TEMPLATE_HELP,
    DTYPES,
    MODEL_HELP,
    add_attention_argument,
    check_data_file,
    check_model_path,
    count,
    number,
    quiet_libraries,
)


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
    path = check_data_file(args.data, "--data") if args.data is not None else None
    if args.lm_eval:
        _lm_eval_tasks(args)
    check_model_path(args.model, "--model")  # before the libraries that load it are imported
    _check_chat_template(args.chat_template)
    quiet_libraries()
    import torch

    from leantune.eval.run import evaluate_file
    from leantune.methods.artifacts import load_for_inference

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
    quiet_libraries()
    from leantune.eval.generation import generate_texts, render_prompt
    from leantune.methods.artifacts import load_for_inference

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
            text = render_prompt(tokenizer, history, args.chat_template)
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
    quiet_libraries()
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


def add_eval_parser(sub: Any) -> None:
    """The `eval` subcommand."""
    from leantune.config.limits import MAX_SEQ_LEN
    from leantune.data.formats import FORMATS

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
        "--max-new-tokens", type=count(1), default=128, help="longest answer for exact match"
    )
    e.add_argument(
        "--max-seq-len", type=count(1, MAX_SEQ_LEN), default=4096, help="longest example, tokens"
    )
    e.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    add_attention_argument(e)
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
    e.set_defaults(func=cmd_eval)


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
    g.set_defaults(func=cmd_generate)


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
    x.set_defaults(func=cmd_export)
