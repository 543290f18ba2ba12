"""Preference accuracy of a model on held-out pairs: how often it finds the chosen answer more
likely than the rejected one, and by how much.

A pair counts as right when the model's summed log-probability of the chosen answer (after the
shared prompt) exceeds the rejected one's; the margin is that difference in nats. A training
run's held-out evaluation (`evaluate_objective`) adds its objective's loss and reward metrics,
from the same scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config.preference import PreferenceConfig
from leantune.data.preference_dataset import preference_data
from leantune.data.preference_packing import pack_pairs
from leantune.objectives.batch import PreferenceStep
from leantune.objectives.logps import SequenceLogps
from leantune.objectives.preference import PreferenceBatch, kto_kl
from leantune.objectives.registry import OBJECTIVES, settings_for


@dataclass(frozen=True)
class Scores:
    """A model's summed log-probs of every sequence of a step's rows, in row order."""

    policy: SequenceLogps
    chosen: torch.Tensor
    """Indices into `policy` of the chosen answers (KTO: desirable completions)."""
    rejected: torch.Tensor
    reference: torch.Tensor | None = None
    """The reference's summed log-probs of the same sequences."""
    kl: tuple[torch.Tensor, torch.Tensor] | None = None
    """KTO: the policy's and the reference's sums of every example's KL sequence."""


@torch.no_grad()
def score_rows(
    model: nn.Module,
    step: PreferenceStep,
    pad_id: int,
    batch_size: int,
    reference: bool = False,
) -> Scores:
    """Every sequence of `step.rows` scored by `model` (in eval mode), `batch_size` rows per
    forward; with `reference`, the reference's too (precomputed in `step`, or the model with
    its adapters off)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("sums", "counts", "c", "r", "ref")}
    kl: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    try:
        for start in range(0, len(step.rows), batch_size):
            rows = list(range(start, min(start + batch_size, len(step.rows))))
            mb = step.collate(rows, pad_id).to(device)
            n = mb.num_sequences  # the padding's sequence after them is left out
            logps = step.policy_logps(model, mb)
            parts["sums"].append(logps.sums[:n].cpu())
            parts["counts"].append(logps.counts[:n].cpu())
            parts["c"].append(mb.chosen.cpu() + offset)
            parts["r"].append(mb.rejected.cpu() + offset)
            if reference:
                parts["ref"].append(step.reference_sums(model, mb)[:n].cpu())
                if mb.kl is not None:
                    policy_kl, reference_kl = step.kl_logps(model, mb)
                    kl.append((policy_kl.cpu(), reference_kl.cpu()))
            offset += n
    finally:
        model.train(was_training)

    def cat(key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(parts[key]) if parts[key] else torch.zeros(0, dtype=dtype)

    return Scores(
        SequenceLogps(cat("sums", torch.float32), cat("counts", torch.long)),
        cat("c", torch.long),
        cat("r", torch.long),
        cat("ref", torch.float32) if reference else None,
        (torch.cat([p for p, _ in kl]), torch.cat([r for _, r in kl])) if kl else None,
    )


def pair_scores(scores: Scores) -> dict[str, Any]:
    """`pairs`, `preference_accuracy` and `mean_margin` (nats) of paired `scores`."""
    # Only the model's own log-probs, no reference model: the margin is absolute, so a
    # base model and its DPO-tuned version compare on the same scale (a DPO run's
    # rewards/accuracies measure the change from the reference instead).
    margin = scores.policy.sums[scores.chosen] - scores.policy.sums[scores.rejected]
    # The mean of an empty tensor is nan, which JSON cannot hold: no pairs reports 0.0.
    return {
        "pairs": int(margin.numel()),
        # Counted, then divided in Python: the exact fraction, not float32's (0.79 -> 0.79000002).
        "preference_accuracy": int((margin > 0).sum()) / margin.numel() if margin.numel() else 0.0,
        "mean_margin": float(margin.mean()) if margin.numel() else 0.0,
    }


def evaluate_objective(
    model: nn.Module, step: PreferenceStep, pad_id: int, batch_size: int
) -> dict[str, Any]:
    """The objective's loss and reward metrics of `model` on `step.rows`, as one batch of all
    of them (KTO: one KL estimate over all examples), and for pairs `pair_scores`.

    `step` holds one example per row; its reference is precomputed (`with_reference`) or the
    model with its adapters off.
    """
    scores = score_rows(model, step, pad_id, batch_size, reference=step.spec.needs_reference)
    ref = scores.reference
    batch = PreferenceBatch(
        scores.policy.select(scores.chosen),
        scores.policy.select(scores.rejected),
        ref[scores.chosen] if ref is not None else None,
        ref[scores.rejected] if ref is not None else None,
        kto_kl(*scores.kl) if scores.kl is not None else None,
    )
    out = step.spec.loss(batch, step.settings)
    results: dict[str, Any] = {"loss": float(out.loss()), "examples": out.examples}
    results |= out.metrics()
    if step.spec.data == "paired":
        results |= pair_scores(scores)
    return results


def evaluate_preference(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    limit: int | None = None,
    batch_size: int = 16,
    max_seq_len: int = 4096,
    on_bad_line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`preference_accuracy` and `mean_margin` (nats) of `model` on the pairs of `path`, with
    `pairs` and `bad_lines`; one pair per row, `batch_size` rows per forward."""
    # max_bad_fraction=1.0: eval scores the pairs it can and reports the rest, never refuses.
    data = preference_data(
        path, fmt="preference", tokenizer=tokenizer, max_seq_len=max_seq_len, max_bad_fraction=1.0
    )
    for bad in data.bad:
        if on_bad_line is not None:
            on_bad_line(str(bad))
    pairs = data.pairs[:limit] if limit is not None else data.pairs
    spec = OBJECTIVES["dpo"]  # any paired objective: only its collation is used
    # seq_len None: one pair per row, no packing, so each row's margin is one pair's.
    step = PreferenceStep(spec, settings_for(spec, PreferenceConfig()), pack_pairs(pairs, None))
    scores = score_rows(model, step, int(tokenizer.pad_token_id), batch_size)
    return {
        "data": str(path),
        "format": "preference",
        **pair_scores(scores),
        "bad_lines": len(data.bad),
    }
