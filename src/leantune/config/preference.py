"""The `preference:` section of a config: the settings of `train.objective`'s preference losses
(`objectives.registry.OBJECTIVES`). Unused by `train.objective=sft`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from leantune.config.roles import OBJECTIVE


@dataclass
class PreferenceConfig:
    """Settings of the preference objectives (train.objective=dpo, simpo, orpo, kto)."""

    beta: float | None = field(default=None, metadata=OBJECTIVE)
    """Strength of the implicit reward: dpo/kto the deviation allowed from the reference
    (smaller: further), simpo the scale of the length-normalised log-probs; unset = the
    objective's default (dpo 0.1, kto 0.1, simpo 2.0). With loss_type=ipo, 1/(2 beta) is the
    target margin."""
    label_smoothing: float = field(default=0.0, metadata=OBJECTIVE)
    """dpo (sigmoid), simpo: probability in [0, 0.5) that a pair's preference is flipped
    (conservative DPO); 0 = off."""
    loss_type: Literal["sigmoid", "ipo"] = field(default="sigmoid", metadata=OBJECTIVE)
    """dpo: sigmoid (DPO) or ipo (squared loss on per-token mean log-ratios)."""
    sft_weight: float = field(default=0.0, metadata=OBJECTIVE)
    """dpo, simpo: weight of the chosen answers' per-token NLL added to the loss (RPO); 0 = off."""
    simpo_gamma: float = field(default=1.0, metadata=OBJECTIVE)
    """simpo: target reward margin (the SimPO paper's gamma/beta of about 0.5 at beta 2)."""
    orpo_lambda: float = field(default=0.1, metadata=OBJECTIVE)
    """orpo: weight of the odds-ratio term next to the SFT loss (the ORPO paper's 0.1)."""
    desirable_weight: float = field(default=1.0, metadata=OBJECTIVE)
    """kto: weight of the desirable completions' losses."""
    undesirable_weight: float = field(default=1.0, metadata=OBJECTIVE)
    """kto: weight of the undesirable completions' losses (raise it when there are fewer
    undesirable ones: KTO's paper keeps weight x count about equal, or up to 4:3)."""


# data.format's choices as a type (for objectives.checks); DataConfig.format spells the same
# list out, and the two must match.
DataFormat = Literal["alpaca", "chat", "text", "sharegpt", "prompt_completion", "preference", "kto"]
