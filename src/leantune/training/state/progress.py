"""The run's progress: what a checkpoint keeps about the run beyond weights and step counters.

:class:`RunProgress` is the typed form of ``trainer_state.json``'s ``extra`` object, which the
checkpoint module stores as plain JSON (and :mod:`leantune.training.state.verify` checks
value by value before anything reads it). The layout is versioned (:data:`VERSION`):

- 2: this layout, with a ``version`` key.
- 1 (no ``version`` key): the untyped dict of leantune up to commit fd108a7. Its keys are those
  of version 2, each optional: ``lr_scale`` and ``rollbacks`` appear after a first rollback,
  ``last_loss`` after a first applied step, ``schedule`` was added later, and ``batching`` is
  missing in checkpoints written before the data position was counted in samples.

So every key is optional when read; a missing one takes its field's default. A rollback keeps
some fields of the running state and takes the others from the checkpoint it goes back to; each
field says which in its metadata (:data:`ROLLBACK`), and :meth:`RunProgress.rolled_back` follows
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from leantune.core.optim import Schedule
from leantune.training.guard.detect import GuardHistory

VERSION = 2
"""The layout :meth:`RunProgress.to_json` writes; 1 is the untyped dict before it."""
ROLLBACK = "rollback"
"""Field metadata key: what a rollback does with the field (:data:`OnRollback`)."""
OnRollback = Literal["kept", "restored"]
"""``kept``: the running value goes on (time spent, what the run learned about its LR);
``restored``: the checkpoint's value comes back with its weights."""


def _on_rollback(what: OnRollback) -> dict[str, OnRollback]:
    return {ROLLBACK: what}


@dataclass(frozen=True)
class Batching:
    """The exact data position, and how a step's samples are split."""

    global_batch: int
    """Samples per optimizer step."""
    micro_batch_size: int
    """Samples per forward/backward (an OOM halves it; the global batch stays)."""
    samples_seen: int
    """Position in the sample stream: samples consumed so far."""

    def to_json(self) -> dict[str, int]:
        """Plain data for ``extra.batching``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Batching:
        """The inverse of :meth:`to_json`."""
        return cls(int(raw["global_batch"]), int(raw["micro_batch_size"]), int(raw["samples_seen"]))


@dataclass
class RunProgress:
    """Where the run stands beyond its step counters; saved as ``trainer_state.json``'s ``extra``.

    ``batching`` and ``guard`` are snapshots: the trainer keeps the live data position and
    guard history and writes them here when it checkpoints.
    """

    batching: Batching | None = field(default=None, metadata=_on_rollback("restored"))
    """The data position; None in a checkpoint written before it was counted in samples."""
    guard: GuardHistory = field(default_factory=GuardHistory, metadata=_on_rollback("restored"))
    """The stability guard's recent history."""
    schedule: Schedule | None = field(default=None, metadata=_on_rollback("restored"))
    """The LR schedule the run follows; None in a checkpoint written before it was recorded
    (the config's applies then)."""
    last_loss: float | None = field(default=None, metadata=_on_rollback("restored"))
    """The loss of the last applied step (the summary's ``final_train_loss``)."""
    train_time_s: float = field(default=0.0, metadata=_on_rollback("kept"))
    """Seconds spent in training steps, over every invocation and rollback."""
    base_exact_match: float | None = field(default=None, metadata=_on_rollback("kept"))
    """Exact match of the base model before training, when it was measured."""
    lr_scale: float = field(default=1.0, metadata=_on_rollback("kept"))
    """What the rollbacks so far multiplied the LR by."""
    rollbacks: int = field(default=0, metadata=_on_rollback("kept"))
    """Rollbacks so far (``guard.max_rollbacks`` bounds them)."""

    def rolled_back(self, restored: RunProgress, lr_factor: float) -> RunProgress:
        """The progress after rolling back to a checkpoint whose progress is `restored`: the
        ``kept`` fields from this one, the ``restored`` ones from it, the LR scale times
        `lr_factor` and one rollback more."""
        # Driven by the field metadata, so a new field must declare what a rollback does to it.
        kept = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata[ROLLBACK] == "kept"
        }
        after = dataclasses.replace(restored, **kept)
        # Compounds over rollbacks: each one lowers the LR the run had reached, not the config's.
        after.lr_scale *= lr_factor
        after.rollbacks += 1
        return after

    def to_json(self) -> dict[str, Any]:
        """Plain data for a checkpoint's ``extra`` (floats round-trip exactly through JSON);
        fields that are None are left out, as version 1 left out what it did not know."""
        out: dict[str, Any] = {
            "version": VERSION,
            "guard": self.guard.to_json(),
            "train_time_s": self.train_time_s,
            "lr_scale": self.lr_scale,
            "rollbacks": self.rollbacks,
        }
        if self.batching is not None:
            out["batching"] = self.batching.to_json()
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_json()
        if self.last_loss is not None:
            out["last_loss"] = self.last_loss
        if self.base_exact_match is not None:
            out["base_exact_match"] = self.base_exact_match
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunProgress:
        """Read version 2 or the untyped version 1 (every key optional; unknown keys ignored).

        The values are trusted: a loaded checkpoint's were checked by
        :func:`leantune.training.state.verify.validate_state`. A schedule that cannot be
        read counts as unrecorded.

        Raises:
            ValueError: The layout is newer than this leantune reads.
        """
        version = raw.get("version", 1)  # version 1 had no version key
        if version > VERSION:
            raise ValueError(f"run progress version {version} is newer than {VERSION}")
        batching = raw.get("batching")
        guard = raw.get("guard")
        last_loss, base = raw.get("last_loss"), raw.get("base_exact_match")
        return cls(
            batching=Batching.from_json(batching) if batching is not None else None,
            guard=GuardHistory.from_json(guard),
            schedule=_schedule(raw.get("schedule")),
            last_loss=float(last_loss) if last_loss is not None else None,
            train_time_s=float(raw.get("train_time_s", 0.0)),
            base_exact_match=float(base) if base is not None else None,
            lr_scale=float(raw.get("lr_scale", 1.0)),
            rollbacks=int(raw.get("rollbacks", 0)),
        )


def _schedule(raw: object) -> Schedule | None:
    if not isinstance(raw, dict):
        return None
    try:
        return Schedule.from_json(raw)
    except (KeyError, TypeError, ValueError):
        # Unreadable counts as unrecorded: the config's schedule applies, as for version 1.
        return None
