"""The one place that maps `train.objective` to its `ObjectiveSpec`: one table of specs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from leantune.objectives.spec import ObjectiveSettings, ObjectiveSpec

if TYPE_CHECKING:
    from leantune.config.preference import PreferenceConfig
    from leantune.objectives.preference import ObjectiveOutput, PreferenceBatch

SFT = "sft"
"""`train.objective` of supervised fine-tuning: the token loss, no spec here."""
REFERENCE_PASS_ROWS = 8
"""Rows per forward of the reference pass before training (`objectives.batch.with_reference`)."""

ReferenceKind = Literal["none", "forward", "precomputed", "live"]


# Each loss is a thin wrapper that imports objectives.preference (torch) only when called:
# the config validates against OBJECTIVES before torch loads, as methods.registry does.
def _dpo(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    from leantune.objectives.preference import dpo_loss  # torch: at the first loss

    return dpo_loss(batch, s)


def _simpo(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    from leantune.objectives.preference import simpo_loss  # torch: at the first loss

    return simpo_loss(batch, s)


def _orpo(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    from leantune.objectives.preference import orpo_loss  # torch: at the first loss

    return orpo_loss(batch, s)


def _kto(batch: PreferenceBatch, s: ObjectiveSettings) -> ObjectiveOutput:
    from leantune.objectives.preference import kto_loss  # torch: at the first loss

    return kto_loss(batch, s)


OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            name="dpo",
            description="the chosen answer over the rejected one, relative to the reference",
            loss=_dpo,
            data="paired",
            needs_reference=True,
            default_beta=0.1,  # the DPO paper's and TRL's default
            settings=("beta", "label_smoothing", "loss_type", "sft_weight"),
        ),
        ObjectiveSpec(
            name="simpo",
            description="length-normalised log-probs with a target margin, no reference",
            loss=_simpo,
            data="paired",
            needs_reference=False,
            default_beta=2.0,  # SimPO's beta scales mean log-probs, so it is larger than DPO's
            settings=("beta", "label_smoothing", "simpo_gamma", "sft_weight"),
            length_normalised=True,
        ),
        ObjectiveSpec(
            name="orpo",
            description="SFT on the chosen answers plus an odds-ratio term, no reference",
            loss=_orpo,
            data="paired",
            needs_reference=False,
            default_beta=None,
            settings=("orpo_lambda",),
            length_normalised=True,
        ),
        ObjectiveSpec(
            name="kto",
            description="unpaired answers labelled desirable or not, relative to the reference",
            loss=_kto,
            data="unpaired",
            needs_reference=True,
            default_beta=0.1,
            settings=("beta", "desirable_weight", "undesirable_weight"),
            needs_kl_pairs=True,
        ),
    )
}


def settings_for(spec: ObjectiveSpec, cfg: PreferenceConfig) -> ObjectiveSettings:
    """The settings `spec.loss` reads: the `preference:` section with beta resolved to the
    objective's default when unset."""
    beta = cfg.beta if cfg.beta is not None else spec.default_beta
    return ObjectiveSettings(
        beta=1.0 if beta is None else beta,  # unread by an objective without a beta
        label_smoothing=cfg.label_smoothing,
        loss_type=cfg.loss_type,
        sft_weight=cfg.sft_weight,
        simpo_gamma=cfg.simpo_gamma,
        orpo_lambda=cfg.orpo_lambda,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
    )


def reference_kind(
    spec: ObjectiveSpec, trains_base_weights: bool, reference: str = "auto"
) -> ReferenceKind:
    """How a run gets the log-probs its loss compares against: "precomputed" once before
    training (full and freeze: their reference is the model before its first update, and no
    adapter can be switched off), "live" with `reference` (train.reference) live there, a frozen
    copy of the model run on every micro-batch, "forward" on every micro-batch without grad
    (adapters off; KTO's KL estimate too), or "none"."""
    if spec.needs_reference and trains_base_weights:
        return "live" if reference == "live" else "precomputed"
    return "forward" if spec.needs_reference or spec.needs_kl_pairs else "none"
