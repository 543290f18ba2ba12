"""The preference objectives: pure functions of per-sequence log-probs (`objectives.logps`).

Each takes a `PreferenceBatch` (the policy's log-probs of the chosen and rejected answers, the
reference's where the objective needs them) and the resolved `ObjectiveSettings`, and returns
an `ObjectiveOutput` of sums and counts. The losses are checked against TRL's
(tests/unit/objectives/test_objectives_trl.py).

Metric names are TRL's: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected (and nll_loss, log_odds_ratio, log_odds_chosen, kl where TRL
reports them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from leantune.objectives.logps import SequenceLogps
from leantune.objectives.spec import ObjectiveSettings


@dataclass(frozen=True)
class PreferenceBatch:
    """The log-probs one micro-batch gives an objective.

    Paired objectives: `chosen[i]` and `rejected[i]` answer the same prompt. KTO: `chosen` are
    the desirable completions and `rejected` the undesirable ones, in any numbers.
    """

    chosen: SequenceLogps
    rejected: SequenceLogps
    ref_chosen: torch.Tensor | None = None
    """(n_chosen,) the reference model's summed log-probs of the chosen answers."""
    ref_rejected: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    """KTO: the batch's KL estimate (`kto_kl`), a constant of the loss."""


@dataclass(frozen=True)
class ObjectiveOutput:
    """A micro-batch's loss as sums, and its metrics as sums with their counts."""

    # Sums and counts, not means: the loop normalises by the counts of the whole accumulation
    # window (STYLE.md section 6), and metrics add up across micro-batches and ranks.
    loss_sum: torch.Tensor
    """Sum of the per-example losses (pairs; KTO: completions)."""
    examples: int
    """How many examples `loss_sum` is over."""
    nll_sum: torch.Tensor | None = None
    """Summed NLL of the chosen answers' tokens (the SFT part), unweighted; None when unused."""
    nll_tokens: int = 0
    nll_weight: float = 0.0
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)

    def loss(self, examples: int | None = None, nll_tokens: int | None = None) -> torch.Tensor:
        """The loss normalised by `examples` and `nll_tokens` (default: this batch's own).

        Pass the whole accumulation window's counts so k micro-batches equal one k times larger.
        """
        # The default is the per-batch mean TRL computes, which the TRL parity tests compare.
        n = self.examples if examples is None else examples
        loss = self.loss_sum / max(n, 1)  # max: a window without examples gives 0, not NaN
        if self.nll_sum is not None and self.nll_weight:
            tokens = self.nll_tokens if nll_tokens is None else nll_tokens
            # The SFT part is a per-token mean, like the token loss, not a per-pair one.
            loss = loss + self.nll_weight * self.nll_sum / max(tokens, 1)
        return loss

    def metrics(self) -> dict[str, float]:
        """Each metric's mean, and rewards/margins = rewards/chosen - rewards/rejected."""
        out = {
            name: float(total) / self.metric_counts[name]
            for name, total in self.metric_sums.items()
            if self.metric_counts[name] > 0
        }
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def dpo_loss(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    """DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)).

    The log-ratios are the policy's summed log-probs minus the reference's. With
    `label_smoothing` e, conservative DPO. `loss_type=ipo`: (d - 1/(2 beta))^2 with d the
    difference of per-token mean log-ratios. `sft_weight` adds that weight times the chosen
    answers' per-token NLL (RPO). Rewards are beta times the log-ratios.
    """
    ref_c, ref_r = _paired(batch, "dpo", reference=True)
    chosen_ratio = batch.chosen.sums - ref_c
    rejected_ratio = batch.rejected.sums - ref_r
    if s.loss_type == "ipo":
        # Per-token means, not sums: TRL normalises IPO by the answers' lengths, and the
        # target margin 1/(2 beta) is on that scale.
        delta = chosen_ratio / batch.chosen.counts.clamp(min=1) - rejected_ratio / (
            batch.rejected.counts.clamp(min=1)
        )
        losses = (delta - 1 / (2 * s.beta)) ** 2
    else:
        losses = _smoothed_sigmoid(s.beta * (chosen_ratio - rejected_ratio), s.label_smoothing)
    # Rewards are metrics only: detached so they carry no graph into the metric sums.
    return _paired_output(
        losses,
        batch,
        s.beta * chosen_ratio.detach(),
        s.beta * rejected_ratio.detach(),
        (batch.chosen.sums, batch.rejected.sums),
        s.sft_weight,
    )


def simpo_loss(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    """SimPO: -log sigmoid(beta * (mean chosen - mean rejected) - gamma), without a reference.

    The means are per-token mean log-probs. Label smoothing is as in conservative DPO;
    `sft_weight` adds the chosen NLL, as CPO does. Rewards are beta times the mean log-probs.
    """
    _paired(batch, "simpo", reference=False)  # only the pairing check; no reference to read
    chosen, rejected = batch.chosen.means(), batch.rejected.means()
    losses = _smoothed_sigmoid(s.beta * (chosen - rejected) - s.simpo_gamma, s.label_smoothing)
    return _paired_output(
        losses,
        batch,
        s.beta * chosen.detach(),
        s.beta * rejected.detach(),
        (chosen, rejected),  # logps/* are the means, as TRL's CPO trainer reports them
        s.sft_weight,
    )


def orpo_loss(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    """ORPO: the chosen answers' per-token NLL minus lambda * log sigmoid(log odds ratio).

    The odds of an answer are p / (1 - p) with p its per-token mean probability. No reference.
    Rewards are lambda times the mean log-probs (TRL's).
    """
    _paired(batch, "orpo", reference=False)
    chosen, rejected = batch.chosen.means(), batch.rejected.means()
    # log(p / (1 - p)) in log space: means are log p <= 0, so log(1 - p) is log1mexp(log p);
    # exponentiating first would underflow for long or unlikely answers.
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    out = _paired_output(
        -s.orpo_lambda * ratio,
        batch,
        s.orpo_lambda * chosen.detach(),
        s.orpo_lambda * rejected.detach(),
        (chosen, rejected),
        1.0,  # the SFT term is part of ORPO itself, at weight 1
    )
    n = len(batch.chosen)
    out.metric_sums.update(
        log_odds_ratio=ratio.detach().sum(), log_odds_chosen=log_odds.detach().sum()
    )
    out.metric_counts.update(log_odds_ratio=n, log_odds_chosen=n)
    return out


def kto_loss(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    """KTO: desirable completions 1 - sigmoid(beta * (log-ratio - kl)), undesirable ones
    1 - sigmoid(beta * (kl - log-ratio)).

    Weighted by `desirable_weight` and `undesirable_weight`, averaged over all completions;
    `kl` is the batch's KL estimate (`kto_kl`). Rewards are beta times the log-ratios.
    """
    if batch.ref_chosen is None or batch.ref_rejected is None or batch.kl is None:
        raise ValueError("kto: needs the reference's log-probs and the batch's KL estimate")
    kl = batch.kl.detach()  # a baseline, not a term to optimise: no gradient through it
    chosen_ratio = batch.chosen.sums - batch.ref_chosen
    rejected_ratio = batch.rejected.sums - batch.ref_rejected
    chosen_losses = 1 - torch.sigmoid(s.beta * (chosen_ratio - kl))
    rejected_losses = 1 - torch.sigmoid(s.beta * (kl - rejected_ratio))
    loss_sum = (
        s.desirable_weight * chosen_losses.sum() + s.undesirable_weight * rejected_losses.sum()
    )
    n_c, n_r = len(batch.chosen), len(batch.rejected)
    sums = {
        "rewards/chosen": (s.beta * chosen_ratio).detach().sum(),
        "rewards/rejected": (s.beta * rejected_ratio).detach().sum(),
        "logps/chosen": batch.chosen.sums.detach().sum(),
        "logps/rejected": batch.rejected.sums.detach().sum(),
        "kl": kl.reshape(()),  # one estimate per micro-batch, hence its count of 1
    }
    counts = {"rewards/chosen": n_c, "rewards/rejected": n_r, "logps/chosen": n_c}
    counts.update({"logps/rejected": n_r, "kl": 1})
    return ObjectiveOutput(loss_sum, n_c + n_r, metric_sums=sums, metric_counts=counts)


def kto_kl(policy_logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """KTO's KL estimate, as TRL computes it, without gradient.

    The mean of policy minus reference summed log-probs over the batch's mismatched
    (prompt, completion) pairs, at least 0. In a data-parallel run, average the mean over ranks
    before the clamp (TRL gathers first).
    """
    # The clamp: a true KL is >= 0, while a small batch's estimate can dip below it.
    return (policy_logps - reference_logps).mean().detach().clamp(min=0)


def _paired(
    batch: PreferenceBatch, name: str, reference: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs (zeros without a reference), after checking the pairing."""
    if len(batch.chosen) != len(batch.rejected):
        raise ValueError(
            f"{name}: {len(batch.chosen)} chosen and {len(batch.rejected)} rejected answers; "
            "a paired objective needs one of each per prompt"
        )
    # Zeros let the reference-free objectives share the pairing check's return shape.
    if not reference:
        return torch.zeros_like(batch.chosen.sums), torch.zeros_like(batch.rejected.sums)
    if batch.ref_chosen is None or batch.ref_rejected is None:
        raise ValueError(f"{name}: needs the reference model's log-probs")
    return batch.ref_chosen, batch.ref_rejected


def _smoothed_sigmoid(x: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-(1 - e) log sigmoid(x) - e log sigmoid(-x): the logistic loss when the label is flipped
    with probability e."""
    # logsigmoid, not log(sigmoid): finite for large |x|.
    loss = -F.logsigmoid(x)
    if smoothing:
        loss = (1 - smoothing) * loss - smoothing * F.logsigmoid(-x)
    return loss


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    # Maechler's split at -log 2: log1p(-exp(x)) is accurate for very negative x,
    # log(-expm1(x)) near 0, where 1 - exp(x) cancels.
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def _paired_output(
    losses: torch.Tensor,
    batch: PreferenceBatch,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    logps: tuple[torch.Tensor, torch.Tensor],
    nll_weight: float,
) -> ObjectiveOutput:
    n = len(batch.chosen)
    sums = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        # strict >: a tie is not counted as preferring the chosen answer (TRL's definition)
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "logps/chosen": logps[0].detach().sum(),
        "logps/rejected": logps[1].detach().sum(),
    }
    # The SFT part reuses the chosen answers' summed log-probs: no second forward.
    nll = -batch.chosen.sums.sum() if nll_weight else None
    tokens = int(batch.chosen.counts.sum()) if nll_weight else 0
    if nll is not None:
        sums["nll_loss"] = nll.detach()
    counts = dict.fromkeys(sums, n)
    if nll is not None:
        counts["nll_loss"] = tokens  # nll_loss is reported per token, like the SFT loss
    return ObjectiveOutput(losses.sum(), n, nll, tokens, nll_weight, sums, counts)
