"""The flags of `leantune prepare` (it runs in `cli.commands.prepare`)."""

from __future__ import annotations

import argparse
from typing import Any

from leantune.cli.args import runs
from leantune.data.formats import FORMATS
from leantune.data.prepare.clean import RULES


def _default(field: str) -> str:
    """Help text of a flag that overrides a data field."""
    return f"default: CONFIG's data.{field}, else leantune's (`leantune validate --help-fields`)"


def add_parsers(sub: Any) -> None:
    """`prepare`."""
    add_arguments(
        sub.add_parser("prepare", help="clean, dedup, tokenise and pack data into shards")
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `leantune prepare`."""
    p.add_argument("config", nargs="?", default=None, help="CONFIG.yaml (its data + model)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of CONFIG")
    p.add_argument("--data", nargs="+", help="input files: .jsonl(.gz|.zst), .json, .parquet, .csv")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="required without CONFIG (default: CONFIG's data.format)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="chatml, zephyr, llama3 or a Jinja file: replaces the tokenizer's chat template "
        "(default: CONFIG's data.chat_template, else the tokenizer's own)",
    )
    p.add_argument(
        "--out", default=None, help="prepared directory (default <first input>.prepared)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model path or name, its tokenizer is used (default: CONFIG's model.path)",
    )
    p.add_argument("--max-seq-len", type=int, default=None, help=_default("max_seq_len"))
    p.add_argument("--no-pack", action="store_true", help="one example per row")
    p.add_argument(
        "--clean",
        default=None,
        help=f"comma-separated rules or 'none' (default: CONFIG's data.clean; without CONFIG: "
        f"all of {','.join(RULES)})",
    )
    p.add_argument(
        "--dedup",
        choices=["none", "exact", "near"],
        default=None,
        help="default: CONFIG's data.dedup; without CONFIG: near",
    )
    p.add_argument(
        "--near-dup-threshold", type=float, default=None, help=_default("near_dup_threshold")
    )
    p.add_argument("--min-tokens", type=int, default=None, help=_default("min_tokens"))
    p.add_argument("--truncate", action="store_true", help="cut over-long examples, do not drop")
    p.add_argument("--system-prompt", default=None, help=_default("system_prompt"))
    p.add_argument(
        "--system-message",
        choices=["auto", "keep", "fold", "drop"],
        default=None,
        help=_default("system_message"),
    )
    p.add_argument("--engine", choices=["local", "dask"], default=None, help=_default("engine"))
    p.add_argument(
        "--scheduler", default=None, help="Dask scheduler address (default LocalCluster)"
    )
    p.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    p.add_argument(
        "--partition-mb",
        type=float,
        default=None,
        help="partition size in MB (default 4 local, 64 dask)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even when the cache key matches")
    runs(p, "leantune.cli.commands.prepare:cmd_prepare")
