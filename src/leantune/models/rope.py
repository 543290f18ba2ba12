"""RoPE scaling: train and run a model beyond the context it was pretrained with.

transformers 5 keeps every RoPE setting in `config.rope_parameters` (`rope_type`, `rope_theta`,
`factor`, ...; the older `rope_scaling` key is only accepted as an alias when a config is built).
`apply_rope_scaling` edits that dict on a loaded config before the model is built, so the rotary
module computes the scaled inverse frequencies itself:

- linear: every frequency divided by `factor` (position interpolation): position `factor * p`
  gets the angles position `p` had.
- dynamic: NTK-aware; leaves short inputs unchanged and raises the base as inputs grow past the
  original context.
- yarn: interpolates low frequencies, keeps high ones, and scales attention by 0.1 ln(factor) + 1.

The rotary angles are computed in fp32 even under bf16 autocast: transformers' rotary modules
multiply fp32 `position_ids` by fp32 `inv_freq` (an elementwise product, which autocast leaves in
fp32), and only the resulting cos/sin are cast to the activations' dtype
(tests/unit/models/test_rope.py).
"""

from __future__ import annotations

from typing import Any

from leantune.config import RopeScalingConfig


def rope_parameters(
    current: dict[str, Any], max_position_embeddings: int, scaling: RopeScalingConfig
) -> tuple[dict[str, Any], int]:
    """The new `rope_parameters` and `max_position_embeddings` for `scaling`.

    Args:
        current: the model's `config.rope_parameters` (keeps its `rope_theta`).
        max_position_embeddings: the model's context length.
        scaling: type, factor and optionally the pretraining context.

    Returns:
        (rope_parameters, max_position_embeddings). linear and yarn extend the context to
        factor x the original; dynamic keeps it (its formula treats it as the original context
        and rescales only longer inputs).

    Raises:
        ValueError: the model already uses a scaled RoPE, or factor <= 1.
    """
    # Scaling on top of a scaling (yarn over llama3, ...) is no composition transformers
    # defines: refused.
    if current.get("rope_type", "default") != "default":
        raise ValueError(
            f"model.rope_scaling: the model already uses rope_type={current['rope_type']}; "
            "remove model.rope_scaling or start from an unscaled model"
        )
    if scaling.factor <= 1:
        raise ValueError(f"model.rope_scaling.factor: must be > 1, got {scaling.factor}")
    original = scaling.original_max_position_embeddings or max_position_embeddings
    # A fresh dict, not the model's edited: keys of the old rope type do not belong to the
    # new one.
    params: dict[str, Any] = {
        "rope_theta": current["rope_theta"],
        "rope_type": scaling.type,
        "factor": float(scaling.factor),
    }
    # Kept: models that rotate only part of each head (Phi, StableLM) size inv_freq with it.
    if "partial_rotary_factor" in current:
        params["partial_rotary_factor"] = current["partial_rotary_factor"]
    if scaling.type == "dynamic":
        # Its formula reads max_position_embeddings as the original context and rescales only
        # longer inputs, so the context stays as it was.
        return params, original
    if scaling.type == "yarn":
        params["original_max_position_embeddings"] = original
    return params, int(original * scaling.factor)


def apply_rope_scaling(config: Any, scaling: RopeScalingConfig) -> None:
    """Edit a transformers config in place so the model it builds uses `scaling`.

    Raises:
        ValueError: the config has no RoPE parameters, or see `rope_parameters`.
    """
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise ValueError(
            f"model.rope_scaling: {type(config).__name__} has no RoPE parameters to scale"
        )
    params, max_pos = rope_parameters(current, config.max_position_embeddings, scaling)
    config.rope_parameters = params
    config.max_position_embeddings = max_pos
    # transformers validates rope parameters when a config is built, not when it is edited.
    validate = getattr(config, "validate_rope", None)
    if callable(validate):
        validate()
