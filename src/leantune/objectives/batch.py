"""What a preference objective's micro-batch is, and its loss from the model's log-probs.

The rows are packed pairs (or unpaired KTO examples, `data.preference_packing`): every sequence
of a row is a prompt and one answer, its own segment. The window's arithmetic (each micro-batch's
loss over the whole accumulation window) is `trainer.preference_window`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from leantune.core.precision import autocast
from leantune.data.loader import collate
from leantune.data.packing import Row
from leantune.data.preference_packing import PreferenceRow, pack_unpaired
from leantune.data.preference_tokenize import UnpairedExample
from leantune.models.loss import reference_token_logps, supervised_token_logps
from leantune.objectives.logps import sequence_logps
from leantune.objectives.preference import ObjectiveOutput, PreferenceBatch, kto_kl
from leantune.objectives.registry import REFERENCE_PASS_ROWS
from leantune.objectives.spec import ObjectiveSettings, ObjectiveSpec

MODEL_INPUTS = ("input_ids", "labels", "position_ids")


@dataclass(frozen=True)
class PreferenceMicroBatch:
    """The tensors of one micro-batch and which of its sequences are which."""

    tensors: dict[str, torch.Tensor]
    """input_ids, labels, position_ids and segments (B, T): each token's sequence number in
    the micro-batch; padding is sequence `num_sequences`, which has no supervised tokens."""
    chosen: torch.Tensor
    """Sequence numbers of the chosen answers (KTO: the desirable completions), in pair order."""
    rejected: torch.Tensor
    num_sequences: int
    examples: int
    """Pairs (KTO: completions): what the objective's loss is a sum over."""
    nll_tokens: int
    """Supervised tokens of the chosen answers (the SFT part of RPO, ORPO)."""
    kl: dict[str, torch.Tensor] | None = None
    """KTO: the mismatched (prompt, completion) sequences that estimate the KL term."""
    reference: torch.Tensor | None = None
    """(num_sequences,) the reference's summed log-probs, when computed before training."""

    def to(self, device: torch.device) -> PreferenceMicroBatch:
        kl = None if self.kl is None else {k: v.to(device) for k, v in self.kl.items()}
        return replace(
            self,
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            chosen=self.chosen.to(device),
            rejected=self.rejected.to(device),
            kl=kl,
            reference=None if self.reference is None else self.reference.to(device),
        )


def as_row(row: PreferenceRow) -> Row:
    """The packed row as the loop's `Row` (token counts, the planner, the id check read it)."""
    examples = tuple(dict.fromkeys(s.example for s in row.segments))
    return Row(row.input_ids, row.labels, row.position_ids, examples)


@dataclass(frozen=True)
class PreferenceStep:
    """A preference objective as the loop runs it: its spec, settings and packed rows."""

    spec: ObjectiveSpec
    settings: ObjectiveSettings
    rows: Sequence[PreferenceRow]
    unpaired: Sequence[UnpairedExample] = ()
    """KTO: the examples the rows' segments index (their labels; the KL sequences)."""
    reference: Sequence[torch.Tensor] | None = None
    """Per row, the reference's summed log-probs of its sequences, computed once before
    training (`with_reference`: full and freeze, whose reference is the model before its first
    update); None: each step's forward with the adapters off."""

    def collate(self, indices: list[int], pad_id: int) -> PreferenceMicroBatch:
        """The rows at `indices`, right-padded, with their sequences numbered in order."""
        rows = [self.rows[i] for i in indices]
        tensors = collate([as_row(r) for r in rows], pad_id)
        # Sequences are numbered across the whole micro-batch, so one forward of the policy
        # gives every answer's summed log-probs in one `sequence_logps` call.
        segments = torch.zeros_like(tensors["input_ids"])
        chosen: list[int] = []
        rejected: list[int] = []
        nll_tokens = 0
        n = 0
        for b, row in enumerate(rows):
            segments[b, len(row.input_ids) :] = -1  # padding, numbered below
            for s in row.segments:
                segments[b, s.start : s.end] = n
                good = s.answer == "chosen" or (
                    s.answer == "completion" and self.unpaired[s.example].label
                )
                (chosen if good else rejected).append(n)
                if s.answer == "chosen":
                    nll_tokens += sum(t != -100 for t in row.labels[s.start : s.end])
                n += 1
        # All padding becomes one extra sequence numbered after the real ones: the real ids
        # stay 0..n-1, which `chosen` and `rejected` index, and padding has no labels.
        segments[segments < 0] = n
        tensors["segments"] = segments
        paired = self.spec.data == "paired"
        reference = self.reference
        return PreferenceMicroBatch(
            tensors,
            torch.tensor(chosen, dtype=torch.long),
            torch.tensor(rejected, dtype=torch.long),
            n,
            len(chosen) if paired else n,
            nll_tokens,
            self._kl_sequences(rows, pad_id) if self.spec.needs_kl_pairs else None,
            torch.cat([reference[i] for i in indices]) if reference is not None else None,
        )

    def _kl_sequences(self, rows: list[PreferenceRow], pad_id: int) -> dict[str, torch.Tensor]:
        """KTO's mismatched pairs, as TRL makes them, one sequence per row."""
        # Each prompt with the next example's completion (rotated by one within the
        # micro-batch): the pairs are deliberately unrelated, to estimate the KL baseline.
        members = [self.unpaired[s.example] for r in rows for s in r.segments]
        shifted = [*members[1:], *members[:1]]
        mismatched = [
            UnpairedExample(a.prompt_ids, b.completion_ids, b.completion_labels, b.label)
            for a, b in zip(members, shifted, strict=True)
        ]
        return collate([as_row(r) for r in pack_unpaired(mismatched, None)], pad_id)

    def output(self, model: nn.Module, mb: PreferenceMicroBatch) -> ObjectiveOutput:
        """The objective's loss and metrics for `mb`.

        The policy's per-sequence log-probs come from one forward, the reference's (adapters
        off) from another when the objective needs it.
        """
        batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
        labels, segments = batch["labels"], mb.tensors["segments"]
        count = mb.num_sequences + 1  # the padding's sequence, empty
        policy = sequence_logps(supervised_token_logps(model, batch), labels, segments, count)
        ref_chosen = ref_rejected = kl = None
        if self.spec.needs_reference:
            ref = mb.reference
            # Precomputed for full and freeze (`with_reference`); adapter methods get the
            # reference from the same model with its adapters switched off.
            if ref is None:
                off = reference_token_logps(model, batch)
                ref = sequence_logps(off, labels, segments, count).sums
            ref_chosen, ref_rejected = ref[mb.chosen], ref[mb.rejected]
        if mb.kl is not None:
            kl = _kl_estimate(model, mb.kl)
        return self.spec.loss(
            PreferenceBatch(
                policy.select(mb.chosen), policy.select(mb.rejected), ref_chosen, ref_rejected, kl
            ),
            self.settings,
        )


def with_reference(
    step: PreferenceStep,
    model: nn.Module,
    device: torch.device,
    precision: str,
    pad_id: int,
    batch_size: int = REFERENCE_PASS_ROWS,
) -> PreferenceStep:
    """`step` with the reference's log-probs of every sequence, computed now by `model`.

    Call it before training and before a resume restores the trained weights: the model as it
    is now is the reference. It runs again, the same way, on every start.
    """
    # Full fine-tuning and freeze have no adapters to switch off; keeping the reference's
    # per-sequence sums spares a second copy of the weights.
    sums: list[torch.Tensor] = []
    was_training = model.training
    model.eval()  # no dropout: the reference is the deterministic model
    with torch.no_grad():
        for start in range(0, len(step.rows), batch_size):
            indices = list(range(start, min(start + batch_size, len(step.rows))))
            mb = step.collate(indices, pad_id).to(device)
            batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
            # The same autocast as the training forward, so reference and policy log-probs
            # differ by the weights, not by numerics.
            with autocast(device.type, precision):
                token_logps = supervised_token_logps(model, batch)
            logps = sequence_logps(
                token_logps, batch["labels"], mb.tensors["segments"], mb.num_sequences + 1
            )
            # Per row, on the CPU: the step collates rows in any order later, and the GPU
            # memory belongs to training.
            counts = [len(step.rows[i].segments) for i in indices]
            sums += [t.cpu() for t in torch.split(logps.sums[: mb.num_sequences], counts)]
    model.train(was_training)
    return replace(step, reference=tuple(sums))


def _kl_estimate(model: nn.Module, kl: dict[str, torch.Tensor]) -> torch.Tensor:
    """KTO's KL term from the mismatched sequences (one per row), without gradient."""
    batch = {k: kl[k] for k in MODEL_INPUTS}
    # KTO treats the KL estimate as a baseline: no gradient flows through it (as in TRL).
    with torch.no_grad():
        policy = sequence_logps(supervised_token_logps(model, batch), batch["labels"])
    reference = sequence_logps(reference_token_logps(model, batch), batch["labels"])
    return kto_kl(policy.sums, reference.sums)
