"""What leantune knows about one training objective, in one frozen dataclass.

`objectives.registry.OBJECTIVES` holds one `ObjectiveSpec` per preference value of
`train.objective` (`sft`, the default, is the token loss of `models.loss`); the config,
the loop and the planner read an objective's facts from there instead of comparing names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

# Type-only: the config reads these facts before torch loads, and objectives.preference
# imports torch.
if TYPE_CHECKING:
    from leantune.objectives.preference import ObjectiveOutput, PreferenceBatch

LossType = Literal["sigmoid", "ipo"]


@dataclass(frozen=True)
class ObjectiveSettings:
    """The resolved settings an objective's loss reads (`registry.settings_for` builds them
    from the `preference:` config section; the defaults live there)."""

    beta: float
    """Strength of the implicit reward (DPO, KTO: deviation from the reference; SimPO: scale
    of the length-normalised log-probs); 1/(2 beta) is IPO's target margin."""
    label_smoothing: float
    """Probability that a pair's preference is flipped (conservative DPO, SimPO)."""
    loss_type: LossType
    """DPO's loss: the sigmoid (DPO) or the squared one of IPO."""
    sft_weight: float
    """Weight of the chosen answers' per-token NLL added to the loss (RPO; CPO-SimPO)."""
    simpo_gamma: float
    """SimPO's target reward margin."""
    orpo_lambda: float
    """Weight of ORPO's odds-ratio term next to its SFT loss."""
    desirable_weight: float
    """KTO: weight of the desirable completions' losses."""
    undesirable_weight: float
    """KTO: weight of the undesirable completions' losses."""


@dataclass(frozen=True)
class ObjectiveSpec:
    """One preference objective: its loss and what follows from it for a run."""

    name: str
    """`train.objective`."""
    description: str
    """What it optimises, in a few words (the README's objectives table shows the same text)."""
    loss: Callable[[PreferenceBatch, ObjectiveSettings], ObjectiveOutput]
    """(per-sequence log-probs of a micro-batch, settings) -> its loss and metrics."""
    data: Literal["paired", "unpaired"]
    """paired: prompt, chosen, rejected; unpaired: prompt, completion, label (KTO)."""
    needs_reference: bool
    """The loss compares against the reference model's log-probs of the same answers."""
    default_beta: float | None
    """`preference.beta` when it is unset; None: the objective has no beta."""
    settings: tuple[str, ...]
    """The `preference.*` fields it reads; setting another one changes nothing for it."""
    length_normalised: bool = False
    """It compares per-token mean log-probs, not sums."""
    needs_kl_pairs: bool = False
    """Its batches also carry mismatched (prompt, completion) pairs whose policy and reference
    log-probs estimate the KL term (KTO: completions rotated by one within the batch)."""
