"""What a preference objective's micro-batch is, and its loss from the model's log-probs.

The rows are packed pairs (or unpaired KTO examples, `data.preference_packing`): every sequence
of a row is a prompt and one answer, its own segment. The window's arithmetic (each micro-batch's
loss over the whole accumulation window) is `trainer.preference_window`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from leantune.core.precision import autocast
from leantune.data.loader import collate
from leantune.data.packing import Row
from leantune.data.preference_packing import PreferenceRow, pack_unpaired
from leantune.data.preference_tokenize import UnpairedExample
from leantune.models.loss import (
    reference_token_logps,
    supervised_token_logps,
    through_wrapper,
)
from leantune.objectives.logps import SequenceLogps, sequence_logps
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
    """KTO: the mismatched (prompt, completion) sequences that estimate the KL term, one per
    example of the micro-batch (`PreferenceStep.kl_partners`), one per row."""
    reference: torch.Tensor | None = None
    """(num_sequences,) the reference's summed log-probs, when computed before training."""
    kl_reference: torch.Tensor | None = None
    """KTO: the reference's summed log-probs of the `kl` sequences, when computed before
    training."""

    def to(self, device: torch.device) -> PreferenceMicroBatch:
        kl = None if self.kl is None else {k: v.to(device) for k, v in self.kl.items()}
        return replace(
            self,
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            chosen=self.chosen.to(device),
            rejected=self.rejected.to(device),
            kl=kl,
            reference=None if self.reference is None else self.reference.to(device),
            kl_reference=None if self.kl_reference is None else self.kl_reference.to(device),
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
    update); None: each step's forward of `reference_model`, or of the model with its adapters
    off."""
    reference_model: nn.Module | None = None
    """train.reference=live (full and freeze): a frozen copy of the model before training, run
    on each micro-batch."""
    kl_partners: Sequence[int] = ()
    """KTO: per example, the example whose completion its KL sequence takes (`kl_partners`)."""
    kl_reference: torch.Tensor | None = None
    """KTO: per example, the reference's summed log-probs of its KL sequence (`with_reference`)."""

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
        reference, kl_reference = self.reference, self.kl_reference
        members = [s.example for r in rows for s in r.segments]
        kl = self.spec.needs_kl_pairs and not paired
        return PreferenceMicroBatch(
            tensors,
            torch.tensor(chosen, dtype=torch.long),
            torch.tensor(rejected, dtype=torch.long),
            n,
            len(chosen) if paired else n,
            nll_tokens,
            self._kl_sequences(members, pad_id) if kl else None,
            torch.cat([reference[i] for i in indices]) if reference is not None else None,
            kl_reference[members] if kl and kl_reference is not None else None,
        )

    def kl_examples(self, members: Sequence[int]) -> list[UnpairedExample]:
        """KTO's mismatched pairs of `members`: each one's prompt with its partner's completion."""
        pairs = [(self.unpaired[i], self.unpaired[self.kl_partners[i]]) for i in members]
        return [
            UnpairedExample(a.prompt_ids, b.completion_ids, b.completion_labels, b.label)
            for a, b in pairs
        ]

    def _kl_sequences(self, members: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """KTO's mismatched pairs of the micro-batch's examples, one sequence per row."""
        mismatched = self.kl_examples(members)
        return collate([as_row(r) for r in pack_unpaired(mismatched, None)], pad_id)

    def policy_logps(self, model: nn.Module, mb: PreferenceMicroBatch) -> SequenceLogps:
        """The model's summed log-probs of every sequence of `mb` (the padding's last)."""
        batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
        count = mb.num_sequences + 1  # the padding's sequence, empty
        token_logps = through_wrapper(model, supervised_token_logps, batch)
        return sequence_logps(token_logps, batch["labels"], mb.tensors["segments"], count)

    def reference_sums(self, model: nn.Module, mb: PreferenceMicroBatch) -> torch.Tensor:
        """The reference's summed log-probs of every sequence of `mb`, without gradient."""
        # Precomputed for full and freeze (`with_reference`), or their frozen copy's
        # (train.reference=live); adapter methods get the reference from the same model with
        # its adapters switched off.
        if mb.reference is not None:
            return mb.reference
        batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
        with torch.no_grad():
            off = self._reference_token_logps(model, batch)
        count = mb.num_sequences + 1
        return sequence_logps(off, batch["labels"], mb.tensors["segments"], count).sums

    def kl_logps(
        self, model: nn.Module, mb: PreferenceMicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KTO: the policy's and the reference's summed log-probs of `mb`'s KL sequences,
        without gradient (`kto_kl` of them, over a window, is the KL estimate)."""
        assert mb.kl is not None, "collated by a step whose objective needs KL pairs"
        batch = {k: mb.kl[k] for k in MODEL_INPUTS}
        # KTO treats the KL estimate as a baseline: no gradient flows through it (as in TRL).
        with torch.no_grad():
            token_logps = through_wrapper(model, supervised_token_logps, batch)
            policy = sequence_logps(token_logps, batch["labels"])
            if mb.kl_reference is not None:
                return policy.sums, mb.kl_reference
            reference = sequence_logps(self._reference_token_logps(model, batch), batch["labels"])
        return policy.sums, reference.sums

    def _reference_token_logps(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The reference's per-token log-probs of `batch`, run now: the frozen copy
        (train.reference=live) or the model with its adapters off."""
        if self.reference_model is not None:  # a plain module, the same on every rank
            return supervised_token_logps(self.reference_model, batch)
        return through_wrapper(model, reference_token_logps, batch)

    def output(
        self, model: nn.Module, mb: PreferenceMicroBatch, kl: torch.Tensor | None = None
    ) -> ObjectiveOutput:
        """The objective's loss and metrics for `mb`.

        The policy's per-sequence log-probs come from one forward, the reference's (adapters
        off) from another when the objective needs it. `kl`: KTO's KL estimate of the whole
        window (`window_kl`); None estimates it from `mb` alone.
        """
        # The forwards without gradient come first, under no_grad through a data-parallel
        # wrapper: DDP then prepares no all-reduce for them, only for the policy's below.
        ref_chosen = ref_rejected = None
        if self.spec.needs_reference:
            ref = self.reference_sums(model, mb)
            ref_chosen, ref_rejected = ref[mb.chosen], ref[mb.rejected]
        if mb.kl is not None and kl is None:
            kl = kto_kl(*self.kl_logps(model, mb))
        policy = self.policy_logps(model, mb)
        return self.spec.loss(
            PreferenceBatch(
                policy.select(mb.chosen), policy.select(mb.rejected), ref_chosen, ref_rejected, kl
            ),
            self.settings,
        )

    def window_kl(
        self, model: nn.Module, batches: Sequence[PreferenceMicroBatch], device: torch.device
    ) -> tuple[float, int] | None:
        """KTO: the sum of policy minus reference log-probs of the window's KL sequences and
        their count (None for other objectives); `kto_kl_of` turns them, added over the
        processes, into the KL estimate.

        One estimate for the whole window, not one per micro-batch: the loss then does not
        depend on how the window is split (an OOM's halving replays the same step), nor on how
        many processes share it.
        """
        if not self.spec.needs_kl_pairs:
            return None
        sums = [self.kl_logps(model, mb.to(device)) for mb in batches]
        policy = torch.cat([p for p, _ in sums])
        reference = torch.cat([r for _, r in sums])
        return float((policy - reference).double().sum()), len(policy)


def kto_kl_of(total: float, count: int, device: torch.device) -> torch.Tensor:
    """KTO's KL estimate from a window's summed log-ratio and count: their mean, at least 0,
    as `kto_kl` (TRL gathers over processes before the clamp, as the sums here are)."""
    return torch.tensor(total / max(1, count), dtype=torch.float32, device=device).clamp(min=0)


def kl_partners(n: int, seed: int) -> tuple[int, ...]:
    """KTO: for each of `n` examples, the example whose completion its KL sequence takes.

    TRL pairs each prompt of a batch with the next example's completion, so its pairs change
    with the batch. Here the pairs are fixed per example: one seeded random cycle through the
    data, each example paired with the next on it. A window's KL estimate is then the same
    however it is split into micro-batches, and the reference's log-probs of every KL sequence
    can be computed once before training (full, freeze). Random, not the data order: a file
    made from pairs holds the two answers of a prompt on adjacent lines, which would make the
    "mismatched" pair a matched one.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    partners = [0] * n
    for a, b in zip(order, [*order[1:], *order[:1]], strict=True):
        partners[a] = b
    return tuple(partners)


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
    is now is the reference (`objectives.reference` keeps the result for the next start).
    """
    # Full fine-tuning and freeze have no adapters to switch off; keeping the reference's
    # per-sequence sums spares a second copy of the weights. Under a data-parallel wrapper every
    # rank runs the same forwards (FSDP2's are collective), so each holds every sequence's
    # reference, whichever shard of a window it gets.
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
                token_logps = through_wrapper(model, supervised_token_logps, batch)
            logps = sequence_logps(
                token_logps, batch["labels"], mb.tensors["segments"], mb.num_sequences + 1
            )
            # Per row, on the CPU: the step collates rows in any order later, and the GPU
            # memory belongs to training.
            counts = [len(step.rows[i].segments) for i in indices]
            sums += [t.cpu() for t in torch.split(logps.sums[: mb.num_sequences], counts)]
    model.train(was_training)
    step = replace(step, reference=tuple(sums))
    return with_kl_reference(step, model, device, precision, pad_id, batch_size)


def with_live_reference(step: PreferenceStep, model: nn.Module) -> PreferenceStep:
    """`step` with a frozen copy of `model` as it is now as its reference, run on every
    micro-batch (train.reference=live). Call it before a resume restores the trained weights."""
    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    frozen.eval()  # no dropout, as `with_reference`: the reference is the deterministic model
    return replace(step, reference_model=frozen)


def with_kl_reference(
    step: PreferenceStep,
    model: nn.Module,
    device: torch.device,
    precision: str,
    pad_id: int,
    batch_size: int = REFERENCE_PASS_ROWS,
) -> PreferenceStep:
    """`step` with the reference's log-probs of KTO's KL sequences, computed now by `model`
    (unchanged for other objectives); as `with_reference`, before a resume's restore."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        kl_reference = _kl_reference(step, model, device, precision, pad_id, batch_size)
    model.train(was_training)
    return replace(step, kl_reference=kl_reference)


def _kl_reference(
    step: PreferenceStep,
    model: nn.Module,
    device: torch.device,
    precision: str,
    pad_id: int,
    batch_size: int,
) -> torch.Tensor | None:
    """KTO: the model's summed log-probs of every example's KL sequence, in example order."""
    if not step.spec.needs_kl_pairs or not step.unpaired:
        return None
    rows = pack_unpaired(step.kl_examples(range(len(step.unpaired))), None)  # one per row
    sums: list[torch.Tensor] = []
    for start in range(0, len(rows), batch_size):
        batch = collate([as_row(r) for r in rows[start : start + batch_size]], pad_id)
        batch = {k: batch[k].to(device) for k in MODEL_INPUTS}
        with autocast(device.type, precision):
            # Through the wrapper: every rank runs these forwards (FSDP2's are collective).
            token_logps = through_wrapper(model, supervised_token_logps, batch)
        sums.append(sequence_logps(token_logps, batch["labels"]).sums.cpu())
    return torch.cat(sums)
