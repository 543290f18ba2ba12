"""`leantune prepare`: config or flags -> the pipeline's settings -> a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from leantune.config import Config, ConfigError, DataConfig, set_field
from leantune.data.errors import DataError
from leantune.data.formats import format_hint
from leantune.data.prepare.clean import RULES
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.settings import engine_options, settings_from_config
from leantune.data.templates import apply_chat_template
from leantune.layout import PreparedPaths
from leantune.methods.checks import effective_pack
from leantune.models.loading import load_tokenizer, resolve_model
from leantune.models.quiet import quiet_libraries
from leantune.training.checks import check_config, load_config


def cmd_prepare(args: argparse.Namespace) -> int:
    quiet_libraries()
    print(summary(run(args)))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run `leantune prepare`; returns the report.

    With CONFIG, the data section and model.path fill every setting a flag leaves unset; without
    it, `--data`, `--format` and `--model` are required and prepare cleans with every rule and
    removes near duplicates unless told otherwise.
    """
    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
        model_path, trust = cfg.model.path, cfg.model.trust_remote_code
        files = args.data or [cfg.data.train]
    else:
        if args.overrides:
            raise ConfigError("prepare: overrides need a CONFIG file")
        if not args.data or not args.format or not args.model:
            raise ConfigError("prepare: give CONFIG, or --data FILE... --format F --model PATH")
        # Every rule and near dedup, unlike train's defaults: without a config, cleaning is what
        # the command is run for.
        data = DataConfig(format=args.format, clean=list(RULES), dedup="near")  # type: ignore[arg-type]
        cfg = Config(data=data)
        model_path, trust, files = args.model, False, args.data
    if not files or files[0] is None:
        raise ConfigError("prepare: no input; set data.train or --data")
    data = _apply_flags(cfg, args, str(files[0]))
    # --model over CONFIG's model.path: the tokenizer decides the token counts and packing.
    if args.model:
        model_path = args.model
    settings = settings_from_config(data)
    tokenizer = load_tokenizer(resolve_model(model_path), trust)
    for warning in apply_chat_template(tokenizer, data.chat_template):
        print(f"warning: {warning}")
    out = args.out or str(Path(files[0]).with_suffix("")) + ".prepared"
    opts = engine_options(data)
    report = prepare_dataset(
        [str(f) for f in files],
        settings,
        tokenizer,
        out,
        engine=opts["engine"],
        scheduler=opts["scheduler"],
        workers=args.workers,
        partition_mb=opts["partition_mb"],
        force=args.force,
        log=print,
    )
    check_kept(report, out)
    return report


_FLAGS = {
    "format": "format",
    "max_seq_len": "max-seq-len",
    "dedup": "dedup",
    "near_dup_threshold": "near-dup-threshold",
    "min_tokens": "min-tokens",
    "system_prompt": "system-prompt",
    "system_message": "system-message",
    "engine": "engine",
    "scheduler": "scheduler",
    "partition_mb": "partition-mb",
    "chat_template": "chat-template",
}


def _apply_flags(cfg: Any, args: argparse.Namespace, first_file: str) -> Any:
    """Put the flags into `cfg.data`, checked like config values, and validate the result.

    Raises:
        ConfigError: a flag's value is out of range or of the wrong kind, naming the flag.
    """
    for name, flag in _FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            # Through set_field, so a flag's value is type-checked and named like an override.
            set_field(cfg, f"data.{name}", value, f"--{flag}: ")
    if args.clean is not None:
        rules = [] if args.clean == "none" else [r for r in args.clean.split(",") if r]
        set_field(cfg, "data.clean", rules, "--clean: ")
    # Resolved here, as train resolves it: the prepared rows must be the ones training reads.
    cfg.data.pack = effective_pack(cfg.data.pack, cfg.method.name) and not args.no_pack
    cfg.data.truncate = cfg.data.truncate or args.truncate
    if args.workers < 1:
        raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
    train = cfg.data.train
    cfg.data.train = first_file  # validated like data.train: it must exist
    try:
        check_config(cfg)
    finally:
        cfg.data.train = train
    return cfg.data


def check_kept(report: dict[str, Any], out: str | Path) -> None:
    """Refuse a preparation that kept nothing: exit 2 with the drops by reason and where
    they are listed (the directory stays, for its rejected.jsonl).

    Raises:
        DataError: no record was kept.
    """
    if report["rows_out"] > 0:
        return
    dropped = ", ".join(f"{k} {n}" for k, n in sorted(report["dropped"].items())) or "none"
    files = ", ".join(report["files"])
    hint = None
    # Most records lacking the format's fields: the likely cause is the wrong --format.
    if 2 * report["dropped"].get("missing_field", 0) > report["rows_in"]:
        hint = format_hint(report["files"][0], report["settings"]["format"])
    raise DataError(
        f"prepare: kept 0 of {report['rows_in']} records of {files}; dropped: {dropped}; "
        "each rejected record, with its file, line and reason, is in "
        f"{PreparedPaths(Path(out)).rejected}" + (f"\n{hint}" if hint else "")
    )


def summary(report: dict[str, Any]) -> str:
    """The report's headline numbers as one JSON line."""
    keys = ("rows_in", "rows_out", "packed_rows", "dropped", "packing_efficiency", "cache_hit")
    return json.dumps({k: report[k] for k in keys})
