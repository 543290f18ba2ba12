"""Pack preference pairs padding-free: a pair's chosen and rejected sequences (and several pairs)
in one row, each sequence its own segment.

A sequence is the prompt followed by one answer, so the prompt is written once per answer.
`segment_ids` numbers the sequences of a row per token and `segments` says which sequence each
is (which answer of which pair), so the per-sequence log-probs the objectives need are sums of
the row's per-token log-probs over each segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from leantune.data.packing import best_fit_decreasing
from leantune.data.preference_tokenize import PreferencePair, UnpairedExample
from leantune.data.tokenize import Example

__all__ = [
    "PreferenceRow",
    "Segment",
    "pack_pairs",
    "pack_unpaired",
    "pair_length",
    "unpack",
]

AnswerName = Literal["chosen", "rejected", "completion"]


@dataclass(frozen=True)
class Segment:
    """One sequence of a packed row: tokens [start, end) are the prompt + `answer` of example
    `example` (an index into the list that was packed)."""

    example: int
    answer: AnswerName
    start: int
    end: int


@dataclass(frozen=True)
class PreferenceRow:
    """A packed row: tokens, labels shifted per sequence, position ids restarting per sequence,
    the sequence index of every token and what each sequence is."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    segment_ids: list[int]
    segments: tuple[Segment, ...]


def pair_length(pair: PreferencePair) -> int:
    """Tokens a pair takes in a row: the prompt once per answer, and both answers."""
    return 2 * len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)


def _row(sequences: Sequence[tuple[int, AnswerName, Example]]) -> PreferenceRow:
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    segments = []
    for k, (example, answer, seq) in enumerate(sequences):
        start = len(ids)
        ids += seq.input_ids
        # Labels are shifted within each sequence (`PreferencePair.sequence`), so no position
        # learns the next sequence's first token.
        labels += seq.labels
        # Restarting positions are how the segment attention (`models.attention`) and
        # transformers' masked attention keep a sequence from seeing the others in the row.
        pos += range(len(seq.input_ids))
        seg += [k] * len(seq.input_ids)
        segments.append(Segment(example, answer, start, len(ids)))
    return PreferenceRow(ids, labels, pos, seg, tuple(segments))


def pack_pairs(pairs: Sequence[PreferencePair], seq_len: int | None) -> list[PreferenceRow]:
    """Rows of at most `seq_len` tokens, each holding whole pairs (chosen then rejected), filled
    best-fit-decreasing; `seq_len` None puts one pair per row.

    Raises:
        ValueError: a pair is longer than `seq_len`.
    """
    # Whole pairs are the packing unit: a pair never straddles two rows, because its two
    # answers are compared with each other in one step.
    groups = (
        [[i] for i in range(len(pairs))]
        if seq_len is None
        else best_fit_decreasing([pair_length(p) for p in pairs], seq_len)
    )
    return [
        _row(
            [
                (i, answer, pairs[i].sequence(answer))
                for i in members
                for answer in ("chosen", "rejected")
            ]
        )
        for members in groups
    ]


def pack_unpaired(examples: Sequence[UnpairedExample], seq_len: int | None) -> list[PreferenceRow]:
    """Rows of at most `seq_len` tokens of unpaired (KTO) examples, one segment each; `seq_len`
    None puts one example per row.

    Raises:
        ValueError: an example is longer than `seq_len`.
    """
    lengths = [len(e.prompt_ids) + len(e.completion_ids) for e in examples]
    groups = (
        [[i] for i in range(len(examples))]
        if seq_len is None
        else best_fit_decreasing(lengths, seq_len)
    )
    return [_row([(i, "completion", examples[i].sequence()) for i in g]) for g in groups]


def unpack(row: PreferenceRow) -> dict[tuple[int, AnswerName], Example]:
    """Each sequence of a packed row, keyed by (example index, answer): the inverse of packing."""
    return {
        (s.example, s.answer): Example(row.input_ids[s.start : s.end], row.labels[s.start : s.end])
        for s in row.segments
    }
