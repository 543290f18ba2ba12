"""Pack examples into rows of at most `seq_len` tokens without letting them see each other.

Each row carries position ids that restart at 0 for every example; with no attention mask and
no KV cache, transformers turns restarting positions into a block-diagonal causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leantune.data.tokenize import Example


@dataclass(frozen=True)
class Row:
    """One training row: tokens, shifted labels and per-example position ids."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    examples: tuple[int, ...] = ()
    """Indices of the examples packed into this row (to name skipped samples by source line)."""


def single_rows(examples: list[Example]) -> list[Row]:
    """One example per row (no packing)."""
    return [
        Row(e.input_ids, e.labels, list(range(len(e.input_ids))), (i,))
        for i, e in enumerate(examples)
    ]


def pack_examples(examples: list[Example], seq_len: int) -> list[Row]:
    """First-fit-decreasing packing into rows of at most `seq_len` tokens.

    Deterministic: ties in length keep input order. Examples longer than `seq_len` must have been
    rejected before (they are reported as bad lines).

    Raises:
        ValueError: an example is longer than `seq_len`.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(examples[i].input_ids)
        if n > seq_len:
            raise ValueError(f"example {i} has {n} tokens > seq_len={seq_len}")
        for b, space in enumerate(free):
            if n <= space:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(seq_len - n)
    return rows_from_groups(examples, bins)


def rows_from_groups(examples: Sequence[Example], groups: list[list[int]]) -> list[Row]:
    """One row per group of example indices: tokens concatenated, positions restarting at 0."""
    rows = []
    for members in groups:
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        for i in members:
            ex = examples[i]
            ids += ex.input_ids
            labels += ex.labels
            pos += range(len(ex.input_ids))
        rows.append(Row(ids, labels, pos, tuple(members)))
    return rows


def packing_efficiency(rows: list[Row], seq_len: int) -> float:
    """Share of row capacity filled with real tokens."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * seq_len)
