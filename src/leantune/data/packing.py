"""Pack examples into rows of at most `seq_len` tokens without letting them see each other."""

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


def rows_for(examples: list[Example], pack: bool, seq_len: int) -> list[Row]:
    """Training rows: examples packed into rows of at most `seq_len` tokens, or one per row."""
    return pack_examples(examples, seq_len) if pack else single_rows(examples)


def longest_example(examples: Sequence[Example]) -> int:
    """Tokens in the longest example (0 for none)."""
    return max((len(e.input_ids) for e in examples), default=0)


def pack_examples(examples: list[Example], seq_len: int) -> list[Row]:
    """Best-fit-decreasing packing into rows of at most `seq_len` tokens (see
    `best_fit_decreasing`; the same packer writes prepared shards).

    Raises:
        ValueError: an example is longer than `seq_len` (such examples are rejected as bad
            lines before packing).
    """
    groups = best_fit_decreasing([len(e.input_ids) for e in examples], seq_len)
    return rows_from_groups(examples, groups)


def best_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Pack items into bins of `seq_len`: longest first, each into the fullest bin it fits.

    A segment tree over free capacities finds that bin in O(log seq_len). Deterministic: ties
    in length keep input order, and bins of equal free space are reused last-opened first.

    Raises:
        ValueError: an item is longer than `seq_len`.
    """
    # Leaves are free capacities 0..seq_len, padded to a power of two for a complete tree.
    size = 1
    while size < seq_len + 1:
        size *= 2
    tree = [0] * (2 * size)  # number of open bins per free capacity (leaves) and per range
    by_cap: list[list[int]] = [[] for _ in range(seq_len + 1)]
    bins: list[list[int]] = []

    def update(cap: int, delta: int) -> None:
        node = cap + size
        while node:
            tree[node] += delta
            node //= 2

    # The smallest free capacity >= n that has an open bin: the fullest bin the item fits.
    def smallest_at_least(n: int, node: int = 1, lo: int = 0, hi: int = size - 1) -> int:
        if hi < n or tree[node] == 0:
            return -1
        if lo == hi:
            return lo
        mid = (lo + hi) // 2
        found = smallest_at_least(n, 2 * node, lo, mid)
        return found if found >= 0 else smallest_at_least(n, 2 * node + 1, mid + 1, hi)

    # Longest first, ties by index: the same input always gives the same rows (the prepared
    # shards and a resumed run must agree).
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > seq_len:
            raise ValueError(f"item {i} has {n} tokens > seq_len={seq_len}")
        cap = smallest_at_least(n)
        if cap < 0:
            b, cap = len(bins), seq_len
            bins.append([])
        else:
            b = by_cap[cap].pop()  # the last-opened bin of that capacity
            update(cap, -1)
        bins[b].append(i)
        # A full bin leaves the tree: it can take nothing more.
        if cap - n > 0:
            by_cap[cap - n].append(b)
            update(cap - n, 1)
    return bins


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
            # Positions restart at 0 per example: with no attention mask and no KV cache,
            # transformers turns them into a block-diagonal causal mask (sdpa, eager), and the
            # segment attention cuts the row there (`models.attention`). They are also what
            # objectives.logps reads as sequence boundaries.
            pos += range(len(ex.input_ids))
        rows.append(Row(ids, labels, pos, tuple(members)))
    return rows


def packing_efficiency(rows: list[Row], seq_len: int) -> float:
    """Share of row capacity filled with real tokens."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * seq_len)
