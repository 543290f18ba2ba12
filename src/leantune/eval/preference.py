"""Preference accuracy of a model on held-out pairs: how often it finds the chosen answer more
likely than the rejected one, and by how much.

A pair counts as right when the model's summed log-probability of the chosen answer (after the
shared prompt) exceeds the rejected one's; the margin is that difference in nats.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config.preference import PreferenceConfig
from leantune.data.preference_dataset import preference_data
from leantune.data.preference_packing import pack_pairs
from leantune.models.loss import supervised_token_logps
from leantune.objectives.batch import MODEL_INPUTS, PreferenceStep
from leantune.objectives.logps import sequence_logps
from leantune.objectives.registry import OBJECTIVES, settings_for


@torch.no_grad()
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
    device = next(model.parameters()).device
    pad_id = int(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    margins: list[torch.Tensor] = []
    for start in range(0, len(step.rows), batch_size):
        rows = list(range(start, min(start + batch_size, len(step.rows))))
        mb = step.collate(rows, pad_id).to(device)
        batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
        # Only the model's own log-probs, no reference model: the margin is absolute, so a
        # base model and its DPO-tuned version compare on the same scale (a DPO run's
        # rewards/accuracies measure the change from the reference instead).
        token_logps = supervised_token_logps(model, batch)
        # + 1: the padding is a sequence of its own (id num_sequences), with no tokens.
        logps = sequence_logps(
            token_logps, batch["labels"], mb.tensors["segments"], mb.num_sequences + 1
        )
        margins.append((logps.sums[mb.chosen] - logps.sums[mb.rejected]).cpu())
    model.train(was_training)
    margin = torch.cat(margins) if margins else torch.zeros(0)
    # The mean of an empty tensor is nan, which JSON cannot hold: no pairs reports 0.0.
    return {
        "data": str(path),
        "format": "preference",
        "pairs": int(margin.numel()),
        "preference_accuracy": float((margin > 0).float().mean()) if margin.numel() else 0.0,
        "mean_margin": float(margin.mean()) if margin.numel() else 0.0,
        "bad_lines": len(data.bad),
    }
