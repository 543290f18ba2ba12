"""The config checks an objective owns, run by `training.checks.check_config`.

`train.objective` and the `preference:` section against the objectives' registry, and the data
format and method a preference objective can train with.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

from leantune.config.parse import ConfigError
from leantune.config.preference import DataFormat, PreferenceConfig
from leantune.objectives.registry import OBJECTIVES, SFT


def check_preference(p: PreferenceConfig, objective: str, kl_coef: float = 0.0) -> list[str]:
    """Ranges of the `preference:` fields and `train.objective` itself (with `train.kl_coef`,
    which only SFT takes); returns warnings for fields set away from their defaults that the
    objective does not read.

    Raises:
        ConfigError: naming the field and its valid range.
    """
    if objective != SFT and objective not in OBJECTIVES:
        raise ConfigError(
            f"train.objective: unknown objective {objective!r}; valid: "
            f"{', '.join([SFT, *OBJECTIVES])}"
        )
    # Preference objectives stay near the reference through beta; a second KL penalty on top
    # would double-count it.
    if objective != SFT and kl_coef:
        raise ConfigError(
            f"train.kl_coef: applies to train.objective=sft; {objective} keeps near the "
            "reference through preference.beta (set train.kl_coef=0)"
        )
    if p.beta is not None and not p.beta > 0:
        raise ConfigError(f"preference.beta: must be > 0, got {p.beta}")
    # A flip probability of 0.5 makes chosen and rejected interchangeable: no signal left.
    if not 0 <= p.label_smoothing < 0.5:
        raise ConfigError(
            f"preference.label_smoothing: must be in [0, 0.5), got {p.label_smoothing}"
        )
    if p.loss_type == "ipo" and p.label_smoothing:
        raise ConfigError(
            "preference.label_smoothing: the ipo loss has no label smoothing; "
            "set preference.label_smoothing=0 or preference.loss_type=sigmoid"
        )
    for key in ("sft_weight", "simpo_gamma", "orpo_lambda"):
        if getattr(p, key) < 0:
            raise ConfigError(f"preference.{key}: must be >= 0, got {getattr(p, key)}")
    for key in ("desirable_weight", "undesirable_weight"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"preference.{key}: must be > 0, got {getattr(p, key)}")
    # "Set" means different from the dataclass default: a YAML that repeats a default value
    # does not warn.
    default = PreferenceConfig()
    changed = [f.name for f in fields(p) if getattr(p, f.name) != getattr(default, f.name)]
    reads = OBJECTIVES[objective].settings if objective in OBJECTIVES else ()
    return [
        f"preference.{name} is set but train.objective={objective} does not use it"
        for name in changed
        if name not in reads
    ]


def check_reference(
    reference: str, objective: str, method: str, trains_base_weights: bool
) -> list[str]:
    """train.reference against the objective and the method; returns a warning when it is set
    for an objective without a reference.

    Raises:
        ConfigError: cached with an adapter method (its reference is never precomputed).
    """
    if reference == "auto":
        return []
    if objective == SFT or not OBJECTIVES[objective].needs_reference:
        return [f"train.reference is set but train.objective={objective} uses no reference model"]
    # An adapter method's reference is its base with the adapters off for one forward: no
    # copy and no pass before training, which is live already; nothing is kept to cache.
    if reference == "cached" and not trains_base_weights:
        raise ConfigError(
            f"train.reference=cached: method.name={method} runs its reference (the model with "
            "its adapters off) on every micro-batch, without a copy; cached is for "
            "method.name=full or freeze. Leave train.reference unset (auto)"
        )
    return []


def preference_format(objective: str) -> Literal["preference", "kto"]:
    """The data.format a preference objective reads: kto (unpaired) or preference (pairs)."""
    return "kto" if OBJECTIVES[objective].data == "unpaired" else "preference"


def objective_data_format(objective: str, fmt: DataFormat) -> DataFormat:
    """data.format as a run with `objective` reads it: chat (the default) is the preference
    objective's own format (chat data cannot train one); any other value as given."""
    if objective == SFT or fmt != "chat":
        return fmt
    return preference_format(objective)


def check_objective(
    objective: str,
    fmt: str,
    method: str,
    *,
    needs_unpacked_data: bool,
    eval_exact_match: bool = False,
) -> None:
    """train.objective against data.format, the method's facts and train.eval_exact_match: a
    preference objective reads its own data format, and this version trains it with what it
    supports.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if objective == SFT:
        if fmt in ("preference", "kto"):
            raise ConfigError(
                f"data.format={fmt}: preference data trains a preference objective; set "
                f"train.objective={'kto' if fmt == 'kto' else 'dpo'} (or simpo, orpo), or "
                "use an SFT format (chat, ...)"
            )
        return
    needed = preference_format(objective)
    if fmt not in (needed, "chat"):  # chat, the default, is read as `needed`
        fields = "prompt, completion, label" if needed == "kto" else "prompt, chosen, rejected"
        raise ConfigError(
            f"data.format={fmt}: train.objective={objective} reads data.format={needed} "
            f"({fields}); set data.format={needed}"
        )
    if needs_unpacked_data:
        raise ConfigError(
            f"method.name={method}: train.objective={objective} puts a pair's two answers in "
            "one row, which this method's virtual tokens cannot keep apart; use method.name=lora"
        )
    # Held-out preference data has no single reference answer to compare a generation with.
    if eval_exact_match:
        raise ConfigError(
            f"train.eval_exact_match: train.objective={objective} evaluates data.eval by its "
            "loss and reward metrics, not by generated answers; set train.eval_exact_match=false"
        )
