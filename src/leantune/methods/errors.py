"""The error a method raises when its settings do not fit the model (exit 2)."""

from __future__ import annotations

from leantune.errors import UserError


class MethodError(ValueError, UserError):
    """A `method.*` setting the model cannot take (more blocks than it has, a bottleneck wider
    than its hidden size, ...); the message names the field and the valid range. Known only once
    the model's shape is, so `validate` cannot catch it; the planner, which builds the model on
    the meta device, raises it before any weight loads."""
