"""`leantune inspect`: what `train` would make of the data (examples with their supervised
tokens marked, lengths, packing, bad lines) and the memory plan; writes nothing."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.cli.args import split_config_args
from leantune.config import Config
from leantune.core.allocator import train_allocator
from leantune.data.dataset import check_usable
from leantune.data.formats import BadLine
from leantune.data.inspection import (
    fit_rows,
    format_inspection,
    format_preference_inspection,
    inspect_file,
)
from leantune.data.preference_dataset import preference_data
from leantune.data.prepare.settings import settings_from_config
from leantune.data.templates import apply_chat_template
from leantune.errors import UserError
from leantune.methods.checks import effective_pack
from leantune.models.loading import load_tokenizer
from leantune.models.quiet import quiet_libraries
from leantune.objectives.registry import SFT
from leantune.training import plan_report
from leantune.training.checks import load_config
from leantune.training.preference_setup import longest_sequence, preference_rows
from leantune.training.run_setup import auto_context, tokenise_limit, with_objective_format
from leantune.training.start_model import start_sources


def cmd_inspect(args: argparse.Namespace) -> int:
    config, overrides = split_config_args(args.args)
    # data.format=chat (the default) with a preference objective reads its pairs, as in train.
    cfg = with_objective_format(load_config(config, overrides))
    quiet_libraries()
    d = cfg.data
    assert d.train is not None  # load_config requires it
    # A prepared directory holds token ids, not records: there is nothing left to show marked.
    if Path(d.train).is_dir():
        raise UserError(
            f"data.train {d.train}: a prepared directory; inspect the file(s) it was prepared from"
        )
    # A run directory as model.path: the model and tokenizer train would start from.
    sources = start_sources(cfg.model.path, cfg.model.gguf_file)
    source = sources.model
    tokenizer = load_tokenizer(sources.tokenizer, cfg.model.trust_remote_code)
    print(
        f"leantune inspect: {d.train} as data.format={d.format}, the tokenizer of {cfg.model.path}"
    )
    for warning in apply_chat_template(tokenizer, d.chat_template):
        print(f"warning: {warning}")
    colour = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    )
    if cfg.train.objective != SFT:
        return _inspect_preference(cfg, tokenizer, auto_context(cfg, source), args, colour)
    # As train: tokenise at the length run_setup gives, then (auto) rows as long as the
    # longest example.
    settings = replace(
        settings_from_config(d),
        pack=effective_pack(d.pack, cfg.method.name),
        max_seq_len=tokenise_limit(d, auto_context(cfg, source)),
    )
    ins = inspect_file(d.train, settings, tokenizer)
    if d.max_seq_len == "auto":
        settings = fit_rows(ins, settings)
    print(format_inspection(ins, tokenizer, settings, args.examples, colour))
    _print_plan(cfg, ins.row_stats())
    # Data that train would refuse exits 2 with train's message (and the format to use).
    bad = [BadLine(r.source, r.line, r.reason) for r in ins.rejected]
    check_usable(d.train, ins.total, bad, ins.examples, d.max_bad_fraction, d.format)
    return 0


def _inspect_preference(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    context: int | None,
    args: argparse.Namespace,
    colour: bool,
) -> int:
    """`inspect` of a preference objective's data: each pair's prompt once and its answers with
    their supervised tokens marked, the rows as train packs them, and the memory plan."""
    d = cfg.data
    assert d.train is not None
    auto = d.max_seq_len == "auto"
    # Every line read (max_bad_fraction 1), so that the bad ones are shown; refused below as
    # train refuses them. No cache directory: inspect writes nothing.
    data = preference_data(
        d.train,
        fmt=d.format,
        tokenizer=tokenizer,
        max_seq_len=context if auto else int(d.max_seq_len),
        system_prompt=d.system_prompt,
        system_message=d.system_message,
        max_bad_fraction=1.0,
        log=print,
    )
    # auto as train resolves it: the longest prompt and answer (1 when none is kept).
    longest = longest_sequence(data) if data.examples else 1
    max_seq_len = longest if auto else int(d.max_seq_len)
    pack = effective_pack(d.pack, cfg.method.name)
    rows = preference_rows(data, max_seq_len, pack)
    print(
        format_preference_inspection(
            data, rows, tokenizer, max_seq_len, pack, args.examples, colour
        )
    )
    _print_plan(cfg, plan_report.preference_row_stats(rows))
    check_usable(d.train, data.total_lines, data.bad, data.examples, d.max_bad_fraction, d.format)
    return 0


def _print_plan(cfg: Config, row_stats: plan_report.RowStats) -> None:
    """The memory plan for the rows shown, as `leantune plan` predicts it."""
    # auto plans for the CPU, as `leantune plan` does without --device.
    device = "cpu" if cfg.train.device == "auto" else cfg.train.device
    try:
        result = plan_report.plan(cfg, device, None, row_stats, train_allocator())
        text = plan_report.format_text(result)
    except (ValueError, MemoryError, UserError) as e:
        # The plan is extra: the data report above stands without it.
        text = f"not available: {e}"
    print(f"\nmemory plan (as `leantune plan` predicts it):\n{text}")
    print("\nnothing was written and nothing was trained")
