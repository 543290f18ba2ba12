"""Per-sequence log-probs: what every preference objective is a function of.

Per-token log p(label) at the supervised positions (`models.loss.supervised_token_logps`) are
summed per row or per packed segment, with the token counts next to the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leantune.data.tokenize import IGNORE_INDEX


@dataclass(frozen=True)
class SequenceLogps:
    """Summed log-probs of each sequence's supervised tokens, and how many tokens there are."""

    sums: torch.Tensor
    """(n,) fp32: sum of log p(label) over each sequence's supervised tokens."""
    counts: torch.Tensor
    """(n,) int64: the supervised tokens of each sequence."""

    def means(self) -> torch.Tensor:
        """Per-token mean log-probs (length-normalised); 0 for a sequence without tokens."""
        # Used by the length-normalised objectives (SimPO, ORPO, IPO); the clamp keeps an
        # all-padding segment at 0/1 = 0 instead of NaN.
        return self.sums / self.counts.clamp(min=1)

    def __len__(self) -> int:
        return int(self.sums.shape[0])

    def select(self, index: torch.Tensor) -> SequenceLogps:
        """The sequences at `index` (a long or bool tensor), in its order."""
        return SequenceLogps(self.sums[index], self.counts[index])


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) sequence ids for packed rows, numbered 0.. in row-major order.

    A new sequence starts wherever the position ids restart at 0. Right padding is a sequence
    of its own, without supervised tokens.
    """
    # `data.packing` restarts position ids at 0 for every packed segment and for the padding
    # tail, so a 0 is the only boundary marker needed (no separate cu_seqlens).
    starts = (position_ids == 0).flatten().long()
    starts[0] = 1  # a row that does not start at position 0 still starts a sequence
    return (starts.cumsum(0) - 1).view_as(position_ids)


def sequence_logps(
    token_logps: torch.Tensor,
    labels: torch.Tensor,
    segments: torch.Tensor | None = None,
    num_sequences: int | None = None,
) -> SequenceLogps:
    """Sum per-token log-probs per sequence.

    Args:
        token_logps: (n_supervised,) log p(label) at the positions where `labels != -100`, in
            row-major order (what `supervised_token_logps` returns).
        labels: (B, T) shifted labels, -100 where nothing is supervised.
        segments: (B, T) sequence id of each position (`segments_from_positions` for packed
            rows); None: each row is one sequence.
        num_sequences: how many sequences there are (default: the largest id + 1, or B).

    Returns:
        Sums and token counts per sequence; a sequence without supervised tokens has 0 and 0.
    """
    # Boolean indexing walks (B, T) in row-major order, the same order in which
    # supervised_token_logps emits its values, so `at[i]` is the sequence of token_logps[i].
    mask = labels != IGNORE_INDEX
    if segments is None:
        index = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
        n = labels.shape[0] if num_sequences is None else num_sequences
    else:
        index = segments
        n = int(segments.max()) + 1 if num_sequences is None else num_sequences
    at = index[mask]
    if token_logps.shape != at.shape:
        raise ValueError(
            f"token_logps has {tuple(token_logps.shape)} values, labels supervise {at.numel()}"
        )
    # Sums in fp32 whatever the model dtype: a long answer's sum of many small bf16 values
    # loses the small differences between chosen and rejected that the losses compare.
    sums = torch.zeros(n, dtype=torch.float32, device=token_logps.device)
    sums = sums.index_add(0, at, token_logps.float())
    counts = torch.zeros(n, dtype=torch.long, device=labels.device).index_add_(
        0, at, torch.ones_like(at)
    )
    return SequenceLogps(sums, counts)


def logits_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at the supervised positions from full (B, T, V) logits.

    The labels are already shifted. For models whose logits exist anyway, and as the reference
    the chunked path is tested against.
    """
    mask = labels != IGNORE_INDEX
    # Select the supervised rows before upcasting, so only those rows are copied to fp32;
    # logsumexp in fp32 keeps the normaliser accurate over a large vocabulary.
    picked = logits[mask].float()
    targets = labels[mask]
    return picked.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(picked, dim=-1)
