"""Deterministic micro-batches addressable by index, so resuming needs only one integer.

Micro-batch `k` of a run is a pure function of (rows, micro_batch_size, seed, k): epoch
`k // batches_per_epoch` uses its own seeded permutation.
"""

from __future__ import annotations

import torch

from leantune.data.packing import Row
from leantune.data.tokenize import IGNORE_INDEX


class BatchSchedule:
    """Maps a global micro-batch index to the row indices it contains."""

    def __init__(self, num_rows: int, micro_batch_size: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError("no training rows")
        self.num_rows = num_rows
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        # ceil: the last micro-batch of an epoch may be short rather than wrap into the next.
        self.batches_per_epoch = -(-num_rows // micro_batch_size)
        self._epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        # Only the current epoch's permutation is kept: memory stays one list of row indices.
        if epoch != self._epoch:
            if self.shuffle:
                # A private generator, seeded from (seed, epoch) alone: the order does not depend
                # on the global RNG or on how many batches came before, so a resume from `k`
                # alone reproduces it. 1_000_003 (a prime) keeps (seed, epoch) pairs apart.
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._perm = list(range(self.num_rows))
            self._epoch = epoch
        return self._perm

    def indices(self, k: int) -> list[int]:
        """Row indices of global micro-batch `k`."""
        epoch, j = divmod(k, self.batches_per_epoch)
        perm = self._permutation(epoch)
        return perm[j * self.micro_batch_size : (j + 1) * self.micro_batch_size]


class SampleStream:
    """The run's sample order: seeded per-epoch permutations of the rows, back to back.

    Position `p` of the stream is a pure function of (num_rows, seed, p), so a step's window of
    samples (`window`) can be split into micro-batches of any size without changing which
    samples it holds or their order, and a checkpoint needs only the position to resume exactly.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        # One "micro-batch" per epoch: the stream reuses BatchSchedule's seeded permutations,
        # so for micro-batch sizes that divide `num_rows` the two orders agree.
        self._order = BatchSchedule(num_rows, num_rows, seed, shuffle)

    @property
    def num_rows(self) -> int:
        return self._order.num_rows

    def window(self, start: int, size: int) -> list[int]:
        """The rows of the step that starts at stream position `start`: the next `size`
        positions, cut at the end of the epoch.
        """
        n = self._order.num_rows
        # Cut at the epoch's end so a step never holds a row twice: the last step of an epoch
        # takes the rows left, and with fewer rows than `size` every step is one full pass.
        end = min(start + size, (start // n + 1) * n)
        return self.rows(start, end - start)

    def rows(self, start: int, count: int) -> list[int]:
        """Row indices at stream positions `[start, start + count)` (may cross epochs)."""
        out: list[int] = []
        n = self._order.num_rows
        for epoch in range(start // n, (start + count - 1) // n + 1):
            perm = self._order._permutation(epoch)
            lo = max(start, epoch * n) - epoch * n
            hi = min(start + count, (epoch + 1) * n) - epoch * n
            out += perm[lo:hi]
        return out


def split_window(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of at most `micro_batch_size` (the last may be shorter)."""
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows into tensors. Padding gets its own restarting position ids and no labels."""
    # No attention mask: right padding is never attended by real tokens under a causal mask,
    # and restarting position ids keep packed examples apart (a mask would also stop
    # transformers from deriving the block-diagonal mask from the positions).
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        ids[b, :n] = torch.tensor(r.input_ids)
        labels[b, :n] = torch.tensor(r.labels)
        pos[b, :n] = torch.tensor(r.position_ids)
        # The padding restarts at 0: a segment of its own, which objectives.logps counts as an
        # empty sequence, and no real token's position run is extended by it.
        pos[b, n:] = torch.arange(width - n)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}
