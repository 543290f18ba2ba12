"""Command line: a thin layer over the library.

leantune train [CONFIG.yaml] [section.key=value ...]
leantune validate CONFIG.yaml [section.key=value ...]
leantune plan [CONFIG.yaml] [--budget 24GiB] [--device cpu|cuda] [--json] [section.key=value ...]
leantune eval --model PATH --data FILE [--limit N]
leantune generate --model PATH --prompt TEXT [--chat] [sampling options]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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
    from leantune.config import load_config
    from leantune.training.recipe import train

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    _quiet_libraries()
    train(cfg, log=lambda m: print(m, flush=True))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from leantune.config import load_config, validate

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    for w in validate(cfg):
        print(f"warning: {w}")
    print(f"ok: {config or 'built-in demo config'} is valid")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from leantune.config import load_config
    from leantune.memory.report import format_text, plan

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


def _detect_format(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break
                if isinstance(obj, dict):
                    if "messages" in obj:
                        return "chat"
                    if "instruction" in obj:
                        return "alpaca"
                return "text"
    return "text"


def cmd_eval(args: argparse.Namespace) -> int:
    _quiet_libraries()
    import torch

    from leantune.data.dataset import prepare_file
    from leantune.eval.exact_match import evaluate_exact_match
    from leantune.eval.loss import evaluate_loss
    from leantune.models.artifacts import load_for_inference

    torch.manual_seed(0)
    model, tokenizer = load_for_inference(args.model, args.dtype)
    path = Path(args.data)
    fmt = args.format or _detect_format(path)
    data = prepare_file(path, fmt, tokenizer, args.max_seq_len, pack=False, max_bad_fraction=1.0)
    for bad in data.bad:
        print(f"bad line skipped: {bad}", file=sys.stderr)
    if args.limit:
        data.rows, data.records = data.rows[: args.limit], data.records[: args.limit]
    pad = int(tokenizer.pad_token_id)
    result: dict[str, object] = {"model": args.model, "data": str(path), "format": fmt}
    result.update(evaluate_loss(model, data.rows, pad, args.batch_size))
    result["examples"] = len(data.rows)
    result["bad_lines"] = len(data.bad)
    if fmt in ("chat", "alpaca"):
        convs = [list(r.messages) for r in data.records if r.messages is not None]
        score, _ = evaluate_exact_match(
            model, tokenizer, convs, args.batch_size, args.max_new_tokens
        )
        result["exact_match"] = score
    print(json.dumps(result, indent=2))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from leantune.eval.generation import SamplingSettings, generate_texts, render_prompt
    from leantune.models.artifacts import load_for_inference

    model, tokenizer = load_for_inference(args.model, args.dtype)
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )
    has_template = getattr(tokenizer, "chat_template", None) is not None
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    prompt = args.prompt
    while True:
        if prompt is None:
            if not args.chat:
                print("error: --prompt is required without --chat", file=sys.stderr)
                return 2
            try:
                prompt = input("you> ")
            except EOFError:
                return 0
            if prompt.strip() in ("/exit", "/quit"):
                return 0
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leantune", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune (no CONFIG: the built-in demo)")
    t.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    t.set_defaults(func=cmd_train)
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("args", nargs="*", help="CONFIG.yaml [section.key=value ...]")
    v.set_defaults(func=cmd_validate)
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

    e = sub.add_parser("eval", help="loss, perplexity and exact match of a model on a JSONL file")
    e.add_argument("--model", required=True, help="model dir, run final/ dir, .gguf or demo name")
    e.add_argument("--data", required=True, help="JSONL file (alpaca, chat or text)")
    e.add_argument("--format", choices=["alpaca", "chat", "text"], help="default: detected")
    e.add_argument("--limit", type=int, default=None, help="evaluate the first N examples")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-seq-len", type=int, default=4096)
    e.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="generate a reply (or chat with --chat)")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", default=None, help="the user message (first turn with --chat)")
    g.add_argument("--chat", action="store_true", help="multi-turn conversation on stdin")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `leantune` console script."""
    from leantune.config import ConfigError
    from leantune.data.dataset import DataError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
