"""The stability guard: a pure function from recent history, loss and gradient norm to an action.

Three detectors look at every optimizer step before it is applied:

- ``nonfinite``: the loss or the gradient norm is NaN or infinite. Stepping would poison the
  weights, so its action is never ``warn``.
- ``loss_spike``: the loss is far above the recent losses.
- ``grad_norm``: the (pre-clipping) gradient norm is far above the recent norms.

"Far above" is robust statistics in log space over the last ``window`` accepted steps, active
after ``warmup`` of them: ``log(x) - median > max(sigmas * 1.4826 * MAD, log(min_ratio))``.
A falling loss never triggers (only upward deviations count).

The guard never touches tensors or files: the training loop calls :func:`decide` once per step
and carries out the action.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Literal

Action = Literal["step", "warn", "skip", "pause", "rollback", "stop"]
"""What the loop does with the step: ``step`` (nothing wrong), ``warn`` (log, then step),
``skip`` (drop the update: zero grads, scheduler does not advance), ``pause`` (skip, checkpoint,
exit), ``rollback`` (reload the last checkpoint, lower the LR, skip the data since it),
``stop`` (too many consecutive skips: checkpoint and stop)."""
DetectorAction = Literal["off", "warn", "skip", "pause", "rollback"]
NonfiniteAction = Literal["skip", "pause", "rollback"]

# Ordered mildest first: when two detectors fire, the later entry wins.
_SEVERITY: tuple[Action, ...] = ("step", "warn", "skip", "pause", "rollback", "stop")
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_TINY = 1e-12  # floor before log(): a zero loss or gradient norm must not raise


@dataclass(frozen=True)
class GuardSettings:
    """The guard's knobs; the defaults live in ``config.GuardConfig``, documented per field."""

    nonfinite: NonfiniteAction
    loss_spike: DetectorAction
    grad_norm: DetectorAction
    loss_sigmas: float
    loss_min_ratio: float
    grad_sigmas: float
    grad_min_ratio: float
    window: int
    warmup: int
    max_consecutive_skips: int
    max_rollbacks: int
    lr_factor: float
    """A rollback scales the learning rate by this."""


@dataclass(frozen=True)
class GuardHistory:
    """What the guard remembers: the last accepted steps and the current run of skips."""

    losses: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()
    consecutive_skips: int = 0

    def to_json(self) -> dict[str, object]:
        """Plain data for a checkpoint's run progress (floats round-trip exactly through JSON)."""
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "consecutive_skips": self.consecutive_skips,
        }

    @classmethod
    def from_json(cls, raw: dict[str, object] | None) -> GuardHistory:
        """Inverse of :meth:`to_json`; None gives an empty history."""
        if not raw:
            return cls()
        losses = raw.get("losses", [])
        norms = raw.get("grad_norms", [])
        skips = raw.get("consecutive_skips", 0)
        assert isinstance(losses, list) and isinstance(norms, list) and isinstance(skips, int)
        return cls(tuple(map(float, losses)), tuple(map(float, norms)), skips)


@dataclass(frozen=True)
class Decision:
    """The guard's verdict on one step."""

    action: Action
    detector: str | None = None
    """Which detector fired (``nonfinite``, ``loss_spike``, ``grad_norm``), None when clean."""
    reason: str = ""
    """One human-readable sentence with the numbers that triggered it."""
    details: dict[str, float] = field(default_factory=dict)

    @property
    def applies_update(self) -> bool:
        """Whether the optimizer step goes ahead."""
        return self.action in ("step", "warn")


def robust_excess(value: float, history: tuple[float, ...]) -> tuple[float, float, float]:
    """How far ``log(value)`` lies above the history's median, and the history's spread.

    Returns:
        ``(excess, sigma, median)``: ``log(value) - median(log h)``, ``1.4826 * MAD(log h)`` and
        the median in linear space.
    """
    # Log space: losses and gradient norms are positive and their noise is multiplicative.
    logs = [math.log(max(x, _TINY)) for x in history]
    # Median and MAD rather than mean and std: one outlier in the window must not hide the next.
    med = statistics.median(logs)
    mad = statistics.median(abs(x - med) for x in logs)
    return math.log(max(value, _TINY)) - med, _MAD_TO_SIGMA * mad, math.exp(med)


def _outlier(
    name: str, value: float, history: tuple[float, ...], sigmas: float, min_ratio: float
) -> tuple[str, dict[str, float]] | None:
    excess, sigma, median = robust_excess(value, history)
    # The min_ratio floor: a run whose values barely move has a tiny MAD, and a 10% wiggle
    # above it is not a spike.
    threshold = max(sigmas * sigma, math.log(min_ratio))
    if excess <= threshold:
        return None
    ratio, limit = math.exp(excess), math.exp(threshold)
    reason = (
        f"{name} {value:.4g} is {ratio:.1f}x the median {median:.4g} of the last {len(history)} "
        f"steps (threshold {limit:.2f}x)"
    )
    return reason, {"value": value, "median": median, "ratio": ratio, "threshold_ratio": limit}


def decide(
    history: GuardHistory, loss: float, grad_norm: float, settings: GuardSettings
) -> Decision:
    """The action for a step with this loss and pre-clipping gradient norm.

    Args:
        history: The accepted steps so far (see :func:`remember`).
        loss: The step's loss over its whole accumulation window.
        grad_norm: The total gradient norm before clipping (after unscaling).
        settings: Actions and thresholds.

    Returns:
        ``step`` when nothing is wrong; otherwise the configured action of the detector that
        fired (non-finite first; when both the loss and the gradient-norm detectors fire, the
        severer action: warn < skip < pause < rollback). A skip that would be the
        ``max_consecutive_skips``-th in a row becomes ``stop``.
    """
    decision = _detect(history, loss, grad_norm, settings)
    if decision.action == "skip" and history.consecutive_skips + 1 >= (
        settings.max_consecutive_skips
    ):
        reason = (
            f"{decision.reason}; {history.consecutive_skips + 1} consecutive steps skipped "
            f"(guard.max_consecutive_skips={settings.max_consecutive_skips})"
        )
        return replace(decision, action="stop", reason=reason)
    return decision


def _detect(
    history: GuardHistory, loss: float, grad_norm: float, settings: GuardSettings
) -> Decision:
    # Checked first and never ``warn``: stepping on a NaN/inf would poison the weights, and the
    # statistics below are meaningless for it.
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        reason = f"non-finite loss {loss} or gradient norm {grad_norm}"
        return Decision(settings.nonfinite, "nonfinite", reason, {})
    checks = (
        ("loss_spike", "loss", loss, history.losses, settings.loss_spike, settings.loss_sigmas,
         settings.loss_min_ratio),
        ("grad_norm", "gradient norm", grad_norm, history.grad_norms, settings.grad_norm,
         settings.grad_sigmas, settings.grad_min_ratio),
    )  # fmt: skip
    hits: list[Decision] = []
    for detector, label, value, past, action, sigmas, min_ratio in checks:
        # The median and MAD of only a few steps are too noisy to judge an outlier by.
        if action == "off" or len(past) < settings.warmup:
            continue
        hit = _outlier(label, value, past[-settings.window :], sigmas, min_ratio)
        if hit is not None:
            hits.append(Decision(action, detector, *hit))
    if not hits:
        return Decision("step")
    # Both may fire (a spike in the loss scales the gradients too): the severest action wins.
    worst = max(hits, key=lambda d: _SEVERITY.index(d.action))
    return replace(worst, reason="; ".join(d.reason for d in hits))


def remember(
    history: GuardHistory, loss: float, grad_norm: float, decision: Decision, window: int
) -> GuardHistory:
    """The history after ``decision`` was carried out for this step.

    Applied updates join the rolling window and end a run of skips; skipped and paused updates
    only count.
    """
    # Flagged-but-applied (``warn``) steps join too: a warn says the run carries on with them.
    if decision.applies_update:
        return GuardHistory(
            (*history.losses, loss)[-window:], (*history.grad_norms, grad_norm)[-window:], 0
        )
    if decision.action in ("skip", "pause", "stop"):
        return replace(history, consecutive_skips=history.consecutive_skips + 1)
    # A rollback restores the checkpoint's own history, so nothing is recorded here.
    return history
