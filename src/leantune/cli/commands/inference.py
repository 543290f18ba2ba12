"""`leantune eval` and `generate`: a trained model's scores on a file, and its replies."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from leantune.cli.inference import lm_eval_tasks
from leantune.data.templates import apply_chat_template
from leantune.errors import UserError
from leantune.eval import generation
from leantune.eval.harness import run_lm_eval, summarize
from leantune.eval.run import evaluate_file
from leantune.methods.artifacts import load_for_inference
from leantune.models.quiet import quiet_libraries
from leantune.monitor.metrics import GenerationBar


def _lm_eval(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, dict[str, float]]:
    try:
        out = run_lm_eval(
            model,
            tokenizer,
            lm_eval_tasks(args),
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
    """eval; its flags were checked (`cli.inference.check_eval`)."""
    path = Path(args.data) if args.data is not None else None
    quiet_libraries()
    torch.manual_seed(0)
    model, tokenizer = load_for_inference(
        args.model, args.dtype, attn_implementation=args.attn_implementation
    )
    _use_chat_template(tokenizer, args.chat_template)
    result: dict[str, object] = {"model": args.model}
    if path is not None:
        bar = GenerationBar("eval", enabled=not args.quiet)
        try:
            result |= evaluate_file(
                model,
                tokenizer,
                path,
                args.format,
                args.limit,
                args.batch_size,
                args.max_new_tokens,
                args.max_seq_len,
                # stderr: stdout holds only the JSON result, for a script to parse.
                on_bad_line=lambda bad: print(f"bad line skipped: {bad}", file=sys.stderr),
                on_progress=bar,
                log=None if args.quiet else lambda note: print(note, file=sys.stderr),
            )
        finally:
            bar.close()
    if args.lm_eval:
        result["lm_eval"] = _lm_eval(args, model, tokenizer)
    print(json.dumps(result, indent=2))
    return 0


def _use_chat_template(tokenizer: Any, spec: str | None) -> None:
    """Give the loaded tokenizer --chat-template (for a model without one, or to override it)."""
    for warning in apply_chat_template(tokenizer, spec):
        # The library's warnings name the config field; here the user gave the flag.
        print(
            f"warning: {warning.replace('data.chat_template', '--chat-template')}", file=sys.stderr
        )


def _decoding(args: argparse.Namespace, model: Any) -> Any:
    """The model's generation_config (else greedy), with the sampling flags given applied."""
    try:
        base = generation.model_sampling(getattr(model, "generation_config", None))
    except ValueError as e:
        raise UserError(f"--model {args.model}: {e}; set the sampling flags instead") from None
    return generation.with_overrides(
        base,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """generate; its flags were checked (`cli.inference.check_generate`)."""
    quiet_libraries()
    model, tokenizer = load_for_inference(
        args.model, args.dtype, attn_implementation=args.attn_implementation
    )
    _use_chat_template(tokenizer, args.chat_template)
    settings = _decoding(args, model)
    # Without a chat template the prompt goes in as plain text, as with --raw.
    has_template = getattr(tokenizer, "chat_template", None) is not None
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    prompt = args.prompt
    # Cleared once the reply is there: in --chat the reply takes its place.
    bar = GenerationBar("generate", enabled=not args.quiet, leave=False)
    while True:
        if prompt is None:  # --chat: the next turn from stdin
            try:
                prompt = input("you> ")
            except EOFError:
                return 0
            if prompt.strip() in ("/exit", "/quit"):
                return 0
            if not prompt.strip():  # an empty turn is not sent: ask again
                prompt = None
                continue
        if has_template and not args.raw:
            history.append({"role": "user", "content": prompt})
            text = generation.render_prompt(tokenizer, history, args.chat_template)
        else:
            text = prompt
        try:
            replies = generation.generate_texts(
                model, tokenizer, [text], settings, batch_size=1, seed=args.seed, on_progress=bar
            )
        finally:
            bar.close()
        (reply,) = replies
        print(("assistant> " if args.chat else "") + reply, flush=True)
        if not args.chat:
            return 0
        # Each turn renders the whole conversation, so the model sees its own earlier replies.
        history.append({"role": "assistant", "content": reply})
        prompt = None
