"""`leantune inspect`: what a run would train on, computed as training does, without writing.

The report shows the first examples with their supervised tokens marked (bright green on a
terminal, `[[` `]]` elsewhere), token counts, the length histogram, packing efficiency and the
bad lines by kind; the memory plan is added by the command (`leantune.training.plan_report`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.dataset import NOT_BAD
from leantune.data.packing import best_fit_decreasing
from leantune.data.preference_dataset import PreferenceData
from leantune.data.preference_packing import PreferenceRow
from leantune.data.preference_tokenize import PreferencePair, UnpairedExample
from leantune.data.prepare.dedup import DedupIndex
from leantune.data.prepare.engines import run_local
from leantune.data.prepare.records import PrepareSettings, Rejection
from leantune.data.tokenize import IGNORE_INDEX

OPEN, CLOSE = "[[", "]]"
COLOUR_ON, COLOUR_OFF = "\x1b[1;32m", "\x1b[0m"
SHOWN_BAD = 5


@dataclass(frozen=True)
class Inspected:
    """One kept example: where it came from, its token ids and shifted labels."""

    source: str
    line: int
    input_ids: np.ndarray
    labels: np.ndarray

    @property
    def supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    num_supervised = supervised  # as `Example` calls it, for `dataset.check_usable`


@dataclass
class Inspection:
    """Everything `inspect` reports about one data file."""

    examples: list[Inspected] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    """Records that count as bad lines (duplicates and blank lines are dropped, not bad)."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Every dropped record by kind, duplicates included."""
    rows_in: int = 0
    groups: list[list[int]] = field(default_factory=list)
    """The training rows: indices into `examples`."""

    @property
    def total(self) -> int:
        """Records that count: kept or bad (as training counts them against max_bad_fraction)."""
        return len(self.examples) + len(self.rejected)

    @property
    def tokens(self) -> int:
        return sum(int(e.input_ids.size) for e in self.examples)

    def row_stats(self) -> tuple[int | None, int | None, int, int]:
        """(most supervised tokens in one row, longest row, rows, examples), what the planner
        needs."""
        if not self.groups:
            return None, None, 0, len(self.examples)
        supervised = [sum(self.examples[i].supervised for i in g) for g in self.groups]
        longest = [sum(int(self.examples[i].input_ids.size) for i in g) for g in self.groups]
        return max(supervised), max(longest), len(self.groups), len(self.examples)


def inspect_file(
    path: str | Path, settings: PrepareSettings, tokenizer: PreTrainedTokenizerBase
) -> Inspection:
    """Validate, clean, tokenise, filter, dedup and pack `path` in memory, as training does.

    Raises:
        FileNotFoundError: no such file. DataError: a file that cannot be read as its kind.
    """
    result = Inspection()
    # The same per-record work as `leantune prepare` (run_local) and the same dedup index, so
    # what is shown is what training would keep; only nothing is written.
    index = DedupIndex(settings.dedup, settings.near_dup_threshold, settings.num_perm)
    for chunk in run_local([str(path)], settings, tokenizer):
        result.rows_in += len(chunk.order)
        # chunk.order interleaves kept and rejected records in file order, so the dedup index
        # sees the same first occurrence that prepare keeps.
        kept, rejected = iter(chunk.kept), iter(chunk.rejected)
        for is_kept in chunk.order:
            if not is_kept:
                _drop(result, next(rejected))
                continue
            k = next(kept)
            verdict = index.check(len(result.examples), k.digest, k.signature)
            if verdict is not None:
                of = result.examples[verdict.of]
                reason = f"{verdict.kind.replace('_', ' ')} of {of.source}:{of.line}"
                _drop(result, Rejection(k.source, k.line, verdict.kind, reason))
                continue
            result.examples.append(Inspected(k.source, k.line, k.input_ids, k.labels))
    lengths = [int(e.input_ids.size) for e in result.examples]
    if settings.pack:
        result.groups = best_fit_decreasing(lengths, settings.max_seq_len)
    else:
        result.groups = [[i] for i in range(len(lengths))]
    return result


def fit_rows(ins: Inspection, settings: PrepareSettings) -> PrepareSettings:
    """data.max_seq_len=auto, as `train` resolves it: rows as long as the longest kept example.

    Re-packs `ins`; returns the settings with the resolved length.
    """
    # The examples were already filtered at the model's context, so the longest fits it.
    longest = max((int(e.input_ids.size) for e in ins.examples), default=1)
    resolved = replace(settings, max_seq_len=longest)
    if settings.pack:
        lengths = [int(e.input_ids.size) for e in ins.examples]
        ins.groups = best_fit_decreasing(lengths, longest)
    return resolved


def _drop(result: Inspection, r: Rejection) -> None:
    result.dropped[r.kind] += 1
    if r.kind not in NOT_BAD:
        result.rejected.append(r)


def render_example(
    tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, labels: np.ndarray, colour: bool
) -> str:
    """The example's text with its supervised tokens marked (colour, or `[[` `]]`)."""
    # Labels are shifted (`labels[i]` is the target of position `i`, token `i + 1`), so token
    # `t` is supervised when `labels[t - 1]` is set; the first token never is.
    supervised = np.zeros(ids.size, dtype=bool)
    supervised[1:] = labels[:-1] != IGNORE_INDEX
    return _marked(tokenizer, ids, supervised, colour)


def _marked(
    tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, supervised: np.ndarray, colour: bool
) -> str:
    """The text of `ids` with the tokens flagged in `supervised` marked."""
    opening, closing = (COLOUR_ON, COLOUR_OFF) if colour else (OPEN, CLOSE)
    pieces: list[str] = []
    start = 0
    # Runs of tokens with the same flag are decoded whole: a character split over tokens
    # (byte-level BPE) decodes only with its neighbours.
    for end in [*np.flatnonzero(supervised[1:] != supervised[:-1]) + 1, ids.size]:
        text = str(
            tokenizer.decode(
                ids[start:end].tolist(),
                # Show exactly what the model sees: end-of-turn tokens are supervised too,
                # and no spaces are tidied away.
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
        )
        pieces.append(f"{opening}{text}{closing}" if supervised[start] else text)
        start = int(end)
    return "".join(pieces)


def render_pair(
    tokenizer: PreTrainedTokenizerBase, pair: PreferencePair, colour: bool = False
) -> str:
    """A tokenised pair as `inspect` shows it: the shared prompt once, then each answer with
    its supervised tokens marked (colour, or `[[` `]]`)."""
    lines = [
        f"prompt ({len(pair.prompt_ids)} tokens):",
        _marked_answer(tokenizer, pair.prompt_ids, [], colour),
    ]
    for name, ids, labels in (
        ("chosen", pair.chosen_ids, pair.chosen_labels),
        ("rejected", pair.rejected_ids, pair.rejected_labels),
    ):
        n = sum(t != IGNORE_INDEX for t in labels)
        lines += [
            f"{name} ({len(ids)} tokens, {n} supervised):",
            _marked_answer(tokenizer, ids, labels, colour),
        ]
    return "\n".join(lines)


def render_unpaired(
    tokenizer: PreTrainedTokenizerBase, example: UnpairedExample, colour: bool = False
) -> str:
    """An unpaired (KTO) example as `inspect` shows it: the prompt, then the completion with
    its label and its supervised tokens marked."""
    label = "desirable" if example.label else "undesirable"
    return "\n".join(
        [
            f"prompt ({len(example.prompt_ids)} tokens):",
            _marked_answer(tokenizer, example.prompt_ids, [], colour),
            f"completion, label {str(example.label).lower()} ({label}; "
            f"{len(example.completion_ids)} tokens, {example.num_supervised} supervised):",
            _marked_answer(tokenizer, example.completion_ids, example.completion_labels, colour),
        ]
    )


def format_preference_inspection(
    data: PreferenceData,
    rows: list[PreferenceRow],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    pack: bool,
    shown: int,
    colour: bool,
) -> str:
    """The report for preference (or KTO) data: `shown` pairs (examples) with each answer's
    supervised tokens marked, the sequences' lengths, the rows and the bad lines."""
    marks = "in bright green" if colour else f"between {OPEN} and {CLOSE}"
    lines = [f"supervised tokens (the loss is trained on them) are shown {marks}", ""]
    paired = data.format == "preference"
    what = "pair" if paired else "example"
    total = len(data.examples)
    for n, example in enumerate(data.examples[:shown], start=1):
        where = f"{Path(example.source).name}:{example.line}" if example.source else ""
        lines.append(f"--- {what} {n} of {total}" + (f" ({where})" if where else ""))
        if isinstance(example, PreferencePair):
            lines += [render_pair(tokenizer, example, colour), ""]
        else:
            lines += [render_unpaired(tokenizer, example, colour), ""]
    sequences = [r.segments for r in rows]
    lengths = sorted(s.end - s.start for segments in sequences for s in segments)
    supervised = sum(t != IGNORE_INDEX for r in rows for t in r.labels)
    if lengths:
        lines.append(
            f"lengths: {len(lengths)} sequences (a prompt and one answer), {sum(lengths)} "
            f"tokens ({supervised} supervised); min {lengths[0]}, median "
            f"{lengths[len(lengths) // 2]}, max {lengths[-1]}"
        )
        lines += histogram(lengths)
    else:
        lines.append("lengths: no example kept")
    longest = max((len(r.input_ids) for r in rows), default=0)
    plural = "s" if len(rows) != 1 else ""
    if pack:
        limit = (
            f"2 x data.max_seq_len={max_seq_len}" if paired else f"data.max_seq_len={max_seq_len}"
        )
        # A pair is the packing unit: its loss compares the two answers within one row.
        unit = "a pair's two sequences are never split; " if paired else ""
        lines.append(
            f"packing: data.pack=true: {total} {what}s in {len(rows)} row{plural} of up to "
            f"{limit} tokens ({unit}the longest row {longest})"
        )
    else:
        lines.append(
            f"packing: data.pack=false: one {what} per row, {len(rows)} row{plural}, the longest "
            f"{longest} tokens; rows are padded to the longest of their micro-batch"
        )
    lines.append(f"bad lines: {len(data.bad)} of {data.total_lines}")
    lines += [f"  {Path(b.file).name}:{b.line}: {b.reason}" for b in data.bad[:SHOWN_BAD]]
    if len(data.bad) > SHOWN_BAD:
        lines.append(f"  ... and {len(data.bad) - SHOWN_BAD} more")
    return "\n".join(lines)


def _marked_answer(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int], colour: bool
) -> str:
    """Labels aligned with `ids` (not shifted): a token is supervised where its label is set."""
    # The prompt passes no labels: all of its tokens stay unmarked.
    flags = np.zeros(len(ids), dtype=bool)
    flags[: len(labels)] = np.asarray(labels, dtype=np.int64) != IGNORE_INDEX
    return _marked(tokenizer, np.asarray(ids, dtype=np.int64), flags, colour) if ids else ""


def histogram(lengths: list[int], bins: int = 8, width: int = 40) -> list[str]:
    """A text histogram of `lengths`, one line per bin: `  lo-hi |#### count`."""
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    step = max(1, -(-(hi - lo + 1) // bins))  # ceil: `bins` bins cover lo..hi inclusive
    counts = Counter((n - lo) // step for n in lengths)
    top = max(counts.values())
    lines = []
    for b in range(-(-(hi - lo + 1) // step)):
        a, z = lo + b * step, min(hi, lo + (b + 1) * step - 1)
        label = str(a) if a == z else f"{a}-{z}"
        # A non-empty bin gets at least one '#', so a rare length stays visible next to a large one.
        bar = "#" * max(1 if counts[b] else 0, round(width * counts[b] / top))
        lines.append(f"  {label:>13} |{bar} {counts[b]}")
    return lines


def format_inspection(
    ins: Inspection,
    tokenizer: PreTrainedTokenizerBase,
    settings: PrepareSettings,
    shown: int,
    colour: bool,
) -> str:
    """The report: `shown` examples, the lengths, packing and the bad lines."""
    marks = "in bright green" if colour else f"between {OPEN} and {CLOSE}"
    lines = [f"supervised tokens (the loss is trained on them) are shown {marks}", ""]
    total = len(ins.examples)
    for n, e in enumerate(ins.examples[:shown], start=1):
        lines.append(
            f"--- example {n} of {total} ({Path(e.source).name}:{e.line}): "
            f"{e.input_ids.size} tokens, {e.supervised} supervised"
        )
        lines += [render_example(tokenizer, e.input_ids, e.labels, colour), ""]
    lines += _lengths(ins)
    lines.append(_packing(ins, settings))
    lines += _bad_lines(ins)
    return "\n".join(lines)


def _lengths(ins: Inspection) -> list[str]:
    lengths = sorted(int(e.input_ids.size) for e in ins.examples)
    if not lengths:
        return ["lengths: no example kept"]
    supervised = sum(e.supervised for e in ins.examples)
    head = (
        f"lengths: {len(lengths)} examples, {sum(lengths)} tokens ({supervised} supervised); "
        f"min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}"
    )
    return [head, *histogram(lengths)]


def _packing(ins: Inspection, settings: PrepareSettings) -> str:
    rows, seq = len(ins.groups), settings.max_seq_len
    # max(1, ...): no rows at all reads as 0%, not a ZeroDivisionError.
    efficiency = ins.tokens / max(1, rows * seq)
    if settings.pack:
        return (
            f"packing: data.pack=true: {len(ins.examples)} examples in {rows} "
            f"row{'s' if rows != 1 else ''} of data.max_seq_len={seq}; packing efficiency "
            f"{efficiency:.1%} (tokens / (rows x max_seq_len))"
        )
    return (
        f"packing: data.pack=false: one example per row, {rows} rows; rows are padded to the "
        f"longest of their micro-batch (they would fill {efficiency:.1%} of max_seq_len rows)"
    )


def _bad_lines(ins: Inspection) -> list[str]:
    kinds = Counter(r.kind for r in ins.rejected)
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    head = f"bad lines: {len(ins.rejected)} of {ins.total}"
    lines = [head + (f" ({by_kind})" if kinds else "")]
    lines += [f"  {Path(r.source).name}:{r.line}: {r.reason}" for r in ins.rejected[:SHOWN_BAD]]
    if len(ins.rejected) > SHOWN_BAD:
        lines.append(f"  ... and {len(ins.rejected) - SHOWN_BAD} more")
    dropped = {k: n for k, n in ins.dropped.items() if k in NOT_BAD}
    if dropped:
        lines.append(
            "dropped, not bad: " + ", ".join(f"{k} {n}" for k, n in sorted(dropped.items()))
        )
    return lines
