"""Command line: a thin layer over the library.

leantune train [CONFIG.yaml] [section.key=value ...]
leantune validate CONFIG.yaml [section.key=value ...]
leantune prepare CONFIG.yaml | --data FILE... --format F --model PATH [--out DIR] [--engine dask]
leantune plan [CONFIG.yaml] [--budget 24GiB] [--device cpu|cuda] [--json] [section.key=value ...]
leantune eval --model PATH --data FILE [--limit N] [--lm-eval TASKS [--lm-eval-limit N]]
leantune generate --model PATH --prompt TEXT [--chat] [sampling options]
leantune bench methods [CONFIG.yaml] [--methods a,b] [--out DIR] [section.key=value ...]
leantune export RUN_OR_MODEL --format hf|adapter|gguf|torchscript|int8 --out DIR

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


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _quiet_import_noise() -> None:
    """peft imports torchao when it is installed; on a CPU build torchao logs a warning per
    CUDA-only extension it cannot load, and torch one per pytree registration: nothing a user
    can act on. peft and transformers import bitsandbytes, whose CPU backend logs a notice about
    an optional kernel on AVX512-BF16 CPUs: held back, and explained only when a 4-bit model
    loads (`models.bnb_notice`). Set before any command imports peft."""
    from leantune.models.bnb_notice import hold_back_kernel_notice

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hold_back_kernel_notice()


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
    from leantune.config import load_config
    from leantune.training.events import TrainingHalted
    from leantune.training.recipe import train
    from leantune.training.signals import Interrupted

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    _quiet_libraries()
    try:
        train(cfg, log=lambda m: print(m, flush=True), config_file=Path(config) if config else None)
    except TrainingHalted as e:
        print(f"error: {e}" if e.exit_code != 3 else str(e), file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from leantune.config import load_config, validate

    config, overrides = _split_config_args(args.args)
    cfg = load_config(config, overrides)
    for w in validate(cfg):
        print(f"warning: {w}")
    print(f"ok: {config or 'built-in demo config'} is valid")
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


def _detect_format(path: Path) -> str:
    from leantune.data.formats import detect_format

    return detect_format(path)


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
    _quiet_libraries()
    import torch

    from leantune.data.dataset import prepare_file
    from leantune.eval.exact_match import evaluate_exact_match
    from leantune.eval.loss import evaluate_loss
    from leantune.models.artifacts import check_model_path, load_for_inference

    check_model_path(args.model, "--model")
    torch.manual_seed(0)
    model, tokenizer = load_for_inference(args.model, args.dtype)
    if path is None:
        lm_eval = _lm_eval(args, model, tokenizer)
        print(json.dumps({"model": args.model, "lm_eval": lm_eval}, indent=2))
        return 0
    fmt = args.format or _detect_format(path)
    data = prepare_file(path, fmt, tokenizer, args.max_seq_len, pack=False, max_bad_fraction=1.0)
    for bad in data.bad:
        print(f"bad line skipped: {bad}", file=sys.stderr)
    if args.limit is not None:  # >= 1 (checked by argparse)
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
    if args.lm_eval:
        result["lm_eval"] = _lm_eval(args, model, tokenizer)
    print(json.dumps(result, indent=2))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from leantune.eval.generation import SamplingSettings, generate_texts, render_prompt
    from leantune.models.artifacts import check_model_path, load_for_inference

    check_model_path(args.model, "--model")
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


def cmd_bench(args: argparse.Namespace) -> int:
    from leantune.bench.methods import machine_info, run_methods, write_outputs
    from leantune.config import ConfigError, load_config
    from leantune.methods.registry import DEFAULT_LR, METHODS

    config, overrides = _split_config_args(args.args)
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


EXPORT_FORMATS = ("hf", "adapter", "gguf", "torchscript", "int8")


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from leantune.export.parity import ParityError
    from leantune.export.run import export_model

    data = Path(args.data) if args.data else None
    try:
        report = export_model(
            args.model, args.format, Path(args.out), args.gguf_type, data, args.samples
        )
    except ParityError as e:  # the export was written but does not reproduce the source
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


def _add_eval_parsers(sub: Any) -> None:
    """The `eval` and `generate` subcommands."""
    from leantune.config import MAX_SEQ_LEN

    e = sub.add_parser("eval", help="loss, perplexity and exact match of a model on a JSONL file")
    e.add_argument("--model", required=True, help="model dir, run final/ dir, .gguf or demo name")
    e.add_argument("--data", default=None, help="JSONL file (alpaca, chat or text)")
    e.add_argument("--format", choices=["alpaca", "chat", "text"], help="default: detected")
    e.add_argument("--limit", type=_count(1), default=None, help="evaluate the first N examples")
    e.add_argument("--batch-size", type=_count(1), default=16)
    e.add_argument("--max-new-tokens", type=_count(1), default=128)
    e.add_argument("--max-seq-len", type=_count(1, MAX_SEQ_LEN), default=4096)
    e.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    e.add_argument(
        "--lm-eval", default=None, metavar="TASKS", help="lm-eval tasks, comma-separated"
    )
    e.add_argument(
        "--lm-eval-limit", type=_count(1), default=None, help="first N documents per task"
    )
    e.add_argument("--lm-eval-include", default=None, help="directory of custom task YAML files")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="generate a reply (or chat with --chat)")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", default=None, help="the user message (first turn with --chat)")
    g.add_argument("--chat", action="store_true", help="multi-turn conversation on stdin")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-new-tokens", type=_count(1), default=256)
    g.add_argument(
        "--temperature", type=_number(lambda v: v >= 0, ">= 0"), default=0.7, help="0 = greedy"
    )
    g.add_argument("--top-p", type=_number(lambda v: 0 < v <= 1, "in (0, 1]"), default=0.9)
    g.add_argument("--top-k", type=_count(0), default=0, help="0 = off")
    g.add_argument(
        "--repetition-penalty", type=_number(lambda v: v > 0, "> 0"), default=1.2, help="1 = off"
    )
    g.add_argument("--seed", type=_count(0, 2**63 - 1), default=0)
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    g.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leantune", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="fine-tune (no CONFIG: the built-in demo)",
        epilog=__doc__.split("\n\n")[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    t.set_defaults(func=cmd_train)
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("args", nargs="*", help="CONFIG.yaml [section.key=value ...]")
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

    _add_eval_parsers(sub)

    b = sub.add_parser("bench", help="benchmarks: `bench methods` compares fine-tuning methods")
    bsub = b.add_subparsers(dest="bench", required=True)
    bm = bsub.add_parser("methods", help="train each method on the same data and compare")
    bm.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    bm.add_argument("--methods", default=None, help="comma-separated (default: all)")
    bm.add_argument("--steps", type=_count(1), default=None, help="override train.max_steps")
    bm.add_argument("--lr", default=None, help="per-method rates, e.g. lora=2e-3,full=5e-5")
    bm.add_argument("--out", default="runs/bench-methods", help="output folder")
    bm.add_argument(
        "--reuse",
        action="store_true",
        help="read back methods whose run in --out already finished instead of training again",
    )
    bm.set_defaults(func=cmd_bench)
    x = sub.add_parser("export", help="export a model, then check parity with the source")
    x.add_argument("model", metavar="RUN_OR_MODEL", help="run dir (exports final/) or model dir")
    x.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    x.add_argument("--out", required=True, help="output directory (new or an earlier export)")
    x.add_argument("--gguf-type", choices=["f16", "bf16", "q8_0"], default="f16")
    x.add_argument("--data", default=None, help="held-out JSONL for the parity check")
    x.add_argument(
        "--samples", type=_count(1), default=4, help="held-out samples for the parity check"
    )
    x.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `leantune` console script."""
    from leantune.errors import UserError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    _quiet_import_noise()
    try:
        return int(args.func(args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside `train`, which handles its own signals
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
