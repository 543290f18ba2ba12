"""A preference run's data and objective, from its config: what `run_setup` and the recipe's
set-up build instead of the SFT rows when `train.objective` is not sft.

`data.max_seq_len` bounds one sequence (a prompt and one answer), as TRL's `max_length` does;
`auto` is the longest sequence of the data, within the model's context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import Config
from leantune.data.dataset import PreparedData
from leantune.data.preference_dataset import PreferenceData, preference_data
from leantune.data.preference_packing import PreferenceRow, pack_pairs, pack_unpaired
from leantune.layout import RunPaths
from leantune.methods.checks import effective_pack
from leantune.objectives.batch import PreferenceStep, as_row
from leantune.objectives.registry import OBJECTIVES, settings_for

Log = Callable[[str], None]


@dataclass
class PreferenceRun:
    """The tokenised preference data and its packed rows."""

    data: PreferenceData
    rows: list[PreferenceRow]

    def step(self, cfg: Config) -> PreferenceStep:
        """The objective as the loop runs it on these rows."""
        spec = OBJECTIVES[cfg.train.objective]
        return PreferenceStep(
            spec, settings_for(spec, cfg.preference), self.rows, self.data.unpaired
        )


def longest_sequence(data: PreferenceData) -> int:
    """The tokens of the data's longest sequence (a prompt and one of its answers)."""
    if data.format == "preference":
        return max(
            len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in data.pairs
        )
    return max(len(e.prompt_ids) + len(e.completion_ids) for e in data.unpaired)


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
    data = preference_data(
        d.train,
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
        log(f"... {len(data.bad) - 20} more bad lines in {d.train}")
    max_seq_len = longest_sequence(data) if auto else int(d.max_seq_len)
    if auto:
        log(f"data.max_seq_len=auto: {max_seq_len} tokens, the longest prompt and answer")
    rows = preference_rows(data, max_seq_len, effective_pack(d.pack, cfg.method.name))
    sequences = [s for p in data.pairs for s in (p.sequence("chosen"), p.sequence("rejected"))]
    sequences += [e.sequence() for e in data.unpaired]
    prepared = PreparedData([as_row(r) for r in rows], sequences, [], data.bad, data.total_lines)
    what = "pairs" if data.format == "preference" else "completions"
    log(
        f"data {Path(d.train).name}: {len(data.examples)} {what}, {len(rows)} rows, "
        f"{prepared.supervised_tokens} supervised tokens, {len(data.bad)} bad lines"
    )
    return prepared, PreferenceRun(data, rows), max_seq_len
