"""A preference run's data and objective, from its config: what `run_setup` and the recipe's
set-up build instead of the SFT rows when `train.objective` is not sft.

`data.max_seq_len` bounds one sequence (a prompt and one answer), as TRL's `max_length` does;
`auto` is the longest sequence of the data, within the model's context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import Config
from leantune.data.dataset import PreparedData
from leantune.data.formats import Record
from leantune.data.packing import Row
from leantune.data.preference_dataset import PreferenceData, preference_data
from leantune.data.preference_packing import PreferenceRow, pack_pairs, pack_unpaired
from leantune.layout import RunPaths
from leantune.methods.checks import effective_pack
from leantune.objectives.batch import (
    PreferenceStep,
    as_row,
    kl_partners,
    with_kl_reference,
    with_live_reference,
    with_reference,
)
from leantune.objectives.reference import read_reference, reference_key, write_reference
from leantune.objectives.registry import OBJECTIVES, REFERENCE_PASS_ROWS, settings_for

Log = Callable[[str], None]


@dataclass
class PreferenceRun:
    """The tokenised preference data and its packed rows."""

    data: PreferenceData
    rows: list[PreferenceRow]
    eval_data: PreferenceData | None = None
    """data.eval, tokenised as the train file (the same cache)."""

    def step(self, cfg: Config) -> PreferenceStep:
        """The objective as the loop runs it on these rows."""
        return _step(cfg, self.rows, self.data)

    def eval_step(self, cfg: Config) -> PreferenceStep | None:
        """The objective on data.eval, one example per row (None without data.eval)."""
        data = self.eval_data
        if data is None:
            return None
        # Unpacked: the held-out figures do not depend on how rows happen to fill.
        rows = pack_pairs(data.pairs, None) if data.pairs else pack_unpaired(data.unpaired, None)
        return _step(cfg, rows, data)


def _step(cfg: Config, rows: list[PreferenceRow], data: PreferenceData) -> PreferenceStep:
    spec = OBJECTIVES[cfg.train.objective]
    n = len(data.unpaired) if spec.needs_kl_pairs else 0
    return PreferenceStep(
        spec,
        settings_for(spec, cfg.preference),
        rows,
        data.unpaired,
        kl_partners=kl_partners(n, cfg.train.seed),
    )


def longest_sequence(data: PreferenceData) -> int:
    """The tokens of the data's longest sequence (a prompt and one of its answers)."""
    if data.format == "preference":
        return max(
            len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in data.pairs
        )
    return max(len(e.prompt_ids) + len(e.completion_ids) for e in data.unpaired)


def _loop_row(row: PreferenceRow) -> Row:
    """`row` as the loop's `Row`, naming its sequences by their index in `sequences` above
    (a pair's chosen then rejected answer: 2k and 2k + 1; an unpaired example k: k)."""
    offset = {"chosen": 0, "rejected": 1}
    names = tuple(
        2 * s.example + offset[s.answer] if s.answer in offset else s.example for s in row.segments
    )
    return replace(as_row(row), examples=names)


def preference_rows(data: PreferenceData, max_seq_len: int, pack: bool) -> list[PreferenceRow]:
    """The training rows of `data`: packed up to the sequence limit (pairs: twice it), or one
    example per row."""
    if data.format == "preference":
        # Rows of twice the sequence limit: a pair's two sequences always fit one row, so a
        # pair is never split between rows (its loss compares them).
        return pack_pairs(data.pairs, 2 * max_seq_len if pack else None)
    return pack_unpaired(data.unpaired, max_seq_len if pack else None)


def load_preference_data(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, context: int | None, log: Log
) -> tuple[PreparedData, PreferenceRun, int]:
    """Tokenise the train file once (cached) and pack it; returns the rows as the loop's
    `PreparedData`, the preference data with its packed rows, and data.max_seq_len resolved.

    Raises:
        DataError: the file is mostly bad lines or has nothing to learn from.
    """
    d = cfg.data
    assert d.train is not None
    auto = d.max_seq_len == "auto"

    def read(path: str) -> PreferenceData:
        data = preference_data(
            path,
            fmt=d.format,
            tokenizer=tokenizer,
            max_seq_len=context if auto else int(d.max_seq_len),
            system_prompt=d.system_prompt,
            system_message=d.system_message,
            max_bad_fraction=d.max_bad_fraction,
            cache_dir=d.cache_dir or RunPaths(cfg.run_dir).prepared,
            log=log,
        )
        for bad in data.bad[:20]:  # the first 20: a wrong format makes every line a bad one
            log(f"bad line skipped: {bad}")
        if len(data.bad) > 20:
            log(f"... {len(data.bad) - 20} more bad lines in {path}")
        return data

    data = read(d.train)
    held_out = read(d.eval) if d.eval is not None else None
    if held_out is not None and cfg.train.eval_limit is not None:
        limit = cfg.train.eval_limit
        held_out.pairs, held_out.unpaired = held_out.pairs[:limit], held_out.unpaired[:limit]
    max_seq_len = longest_sequence(data) if auto else int(d.max_seq_len)
    if auto:
        log(f"data.max_seq_len=auto: {max_seq_len} tokens, the longest prompt and answer")
    rows = preference_rows(data, max_seq_len, effective_pack(d.pack, cfg.method.name))
    sequences = [s for p in data.pairs for s in (p.sequence("chosen"), p.sequence("rejected"))]
    sequences += [e.sequence() for e in data.unpaired]
    # A record per sequence, as the SFT data has one per example: the guard's events and the
    # vocabulary check name a sequence's source line through them.
    records = [Record(p.source, p.line) for p in data.pairs for _ in range(2)]
    records += [Record(e.source, e.line) for e in data.unpaired]
    loop_rows = [_loop_row(r) for r in rows]
    prepared = PreparedData(loop_rows, sequences, records, data.bad, data.total_lines)
    what = "pairs" if data.format == "preference" else "completions"
    log(
        f"data {Path(d.train).name}: {len(data.examples)} {what}, {len(rows)} rows, "
        f"{prepared.supervised_tokens} supervised tokens, {len(data.bad)} bad lines"
    )
    if held_out is not None:
        log(f"data.eval {Path(str(d.eval)).name}: {len(held_out.examples)} {what}")
    return prepared, PreferenceRun(data, rows, held_out), max_seq_len


def reference_for(
    cfg: Config,
    fingerprint: Mapping[str, Any],
    step: PreferenceStep,
    model: nn.Module,
    device: torch.device,
    pad_id: int,
    log: Log,
) -> PreferenceStep:
    """`step` with the reference of full and freeze, from `model` as it is now: a frozen copy
    (train.reference=live), or its log-probs of every sequence, read from the data cache when
    an earlier start computed them for this model, data and settings, else computed now and
    kept there.

    Call it before a resume restores the trained weights: the model is then its reference.
    `fingerprint` is the run's (its model.* fields say which model, as loaded).
    """
    if cfg.train.reference == "live":
        log(
            "reference: a frozen copy of the model, run on every micro-batch "
            f"(train.reference=live; method.name={cfg.method.name})"
        )
        return with_live_reference(step, model)
    sequences = sum(len(r.segments) for r in step.rows)
    file, key = None, ""
    # A hub id not yet downloaded when the fingerprint was taken has no content digest to
    # key on: computed, not kept (the next run, with the files local, keeps them).
    if not str(fingerprint["model.files"]).startswith("hub:"):
        model_facts = {k: v for k, v in fingerprint.items() if k.startswith("model.")}
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        settings = {
            "precision": cfg.train.precision,
            "device": where,  # other kernels, other bits
            "batch": REFERENCE_PASS_ROWS,  # the padding of each forward
            "compile": cfg.train.compile,
        }
        key = reference_key(model_facts, settings, step.rows)
        cache_dir = Path(cfg.data.cache_dir or RunPaths(cfg.run_dir).prepared)
        file = cache_dir / f"reference-{key[:24]}.safetensors"
        sums = read_reference(file, key, step.rows)
        if sums is not None:
            log(f"reference: log-probs of {sequences} sequences loaded from {file}")
            # KTO's KL sequences are not kept (their pairing follows train.seed): the model
            # before the restore computes them now, as on the first start.
            return with_kl_reference(
                replace(step, reference=sums), model, device, cfg.train.precision, pad_id
            )
    step = with_reference(step, model, device, cfg.train.precision, pad_id)
    kept = ""
    if file is not None:
        assert step.reference is not None
        write_reference(file, key, step.reference)
        kept = f", kept in {file}"
    log(
        f"reference: the log-probs of {sequences} sequences, computed once by the model "
        f"before training (method.name={cfg.method.name} keeps no second copy){kept}"
    )
    return step
