"""A run whose trainable weights went NaN or infinite: never checkpointed, and told so.

:func:`leantune.training.state.checkpoint.save_checkpoint` refuses such weights and the run
stops with :class:`WeightsDiverged`, whose message names the last good checkpoint and the fix.
"""

from __future__ import annotations

from pathlib import Path

from leantune.monitor.events import TrainingStopped


# A checkpoint of non-finite weights would be a resume point that can only continue the
# divergence, hence an error rather than a save.
class WeightsDiverged(TrainingStopped):
    """The trainable weights hold NaN or inf; no checkpoint was written (exit code 4)."""


def diverged(step: int, names: list[str], last_good: Path | None) -> WeightsDiverged:
    """The error for weights found non-finite when saving the checkpoint of ``step``.

    Args:
        step: Optimizer updates applied so far (the step the checkpoint would have had).
        names: The non-finite tensors' names.
        last_good: The newest complete checkpoint, if any.
    """
    which = f"{names[0]} holds" if len(names) == 1 else f"{names[0]} and {len(names) - 1} more hold"
    earlier = (
        f"The last good checkpoint is {last_good}."
        if last_good is not None
        else "There is no earlier checkpoint."
    )
    return WeightsDiverged(
        f"the weights diverged: after update {step}, {which} NaN or inf values, so no "
        f"checkpoint was written for step {step} (continuing from it could only diverge "
        f"again). {earlier} Lower train.lr, or fix the setting that drove the weights to NaN or "
        "inf (a very large train.weight_decay, say), then train again in a new run (another "
        "run.dir or run.name) or start this one over with run.resume=never."
    )
