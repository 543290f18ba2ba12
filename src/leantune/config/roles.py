"""What each config field is to a run's fingerprint: its `Role`, held in the field's metadata.

A run directory records the fingerprint of everything that decides the run's trajectory
(``leantune_run.json``, `training.run.fingerprint`), and ``run.resume`` compares it
(`training.run.resume`). Which fields are in it, which may be forced to change and which are
free is declared once, on each field (``field(default=..., metadata=SETTING)``); the
fingerprint, the resume policy and the docs' config reference read it from there
(`config.schema.field_roles`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class Role(StrEnum):
    """A config field's part in the fingerprint of a run (what each means: `MEANINGS`)."""

    SETTING = "setting"
    REFUSED = "refused"
    CONTENT = "content"
    BATCH = "batch"
    OBJECTIVE = "objective"
    FREE = "free"


MEANINGS: dict[Role, str] = {
    Role.SETTING: "recorded as configured, or as the run resolved it (train.lr unset is the "
    "method's default, data.max_seq_len=auto the data's longest example); resuming with another "
    "value needs run.resume=force, which says what the change does",
    Role.REFUSED: "recorded; a change is refused even with run.resume=force: the checkpoint's "
    "weights or optimizer state cannot be loaded with it",
    Role.CONTENT: "recorded by the content digest of the file or directory it names "
    "(model.files, data.train), not by its path: a moved file is the same run, an edited one "
    "is not",
    Role.BATCH: "recorded as the global batch it makes (train.global_batch); another split of "
    "the same global batch into micro-batches is free to change",
    Role.OBJECTIVE: "recorded when train.objective is a preference objective (an sft run's "
    "record holds neither it nor the preference.* settings)",
    Role.FREE: "not recorded: free to change on resume (where the run lives and how it is "
    "shown, evaluation, checkpoint cadence, the guard, monitoring, memory and parallelism)",
}
"""What each `Role` means to a resume, as the docs' config reference prints it."""


ROLE_KEY = "fingerprint"
"""The metadata key that holds a field's `Role`."""
REASON_KEY = "refused_because"
"""The metadata key that holds why a `Role.REFUSED` field's change cannot be forced."""

# Read-only: one mapping is shared by every field declared with it, so a change to it would
# change them all.
SETTING: Mapping[str, Any] = MappingProxyType({ROLE_KEY: Role.SETTING})
CONTENT: Mapping[str, Any] = MappingProxyType({ROLE_KEY: Role.CONTENT})
BATCH: Mapping[str, Any] = MappingProxyType({ROLE_KEY: Role.BATCH})
OBJECTIVE: Mapping[str, Any] = MappingProxyType({ROLE_KEY: Role.OBJECTIVE})
FREE: Mapping[str, Any] = MappingProxyType({ROLE_KEY: Role.FREE})

RECORDED = frozenset({Role.SETTING, Role.REFUSED, Role.OBJECTIVE})
"""The roles whose fields the fingerprint records under their own ``section.field`` key."""


def refused(reason: str) -> Mapping[str, Any]:
    """The metadata of a `Role.REFUSED` field; `reason` completes "refused: ..." for the user."""
    return MappingProxyType({ROLE_KEY: Role.REFUSED, REASON_KEY: reason})


class UnclassifiedField(TypeError):
    """A config field without a fingerprint role (a programming error, found by the tests)."""


def role_of(f: dataclasses.Field[Any]) -> Role | None:
    """The `Role` in a dataclass field's metadata, or None without one."""
    value = f.metadata.get(ROLE_KEY)
    return Role(value) if value is not None else None
