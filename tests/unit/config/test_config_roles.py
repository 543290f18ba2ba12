"""Every config field declares its part in a run's fingerprint (`config.roles.Role`), and the
fingerprint and the resume policy read their field lists from those declarations alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from leantune.config import Config, field_docs, field_roles, refused_reasons
from leantune.config.roles import FREE, MEANINGS, RECORDED, Role, UnclassifiedField
from leantune.training.run.fingerprint import (
    BATCH_KEY,
    CONTENT_KEYS,
    trajectory_settings,
)
from leantune.training.run.resume import REFUSED


def test_every_field_of_every_section_has_a_role() -> None:
    roles = field_roles()
    assert set(roles) == set(field_docs())  # the fields a user can set, section by section
    assert all(isinstance(role, Role) for role in roles.values())
    assert set(MEANINGS) == set(Role)  # the docs can say what each one means


def test_a_field_without_a_role_is_named() -> None:
    @dataclass
    class Extra:
        kept: int = field(default=1, metadata=FREE)
        new_knob: int = 2

    @dataclass
    class WithExtra(Config):
        extra: Extra = field(default_factory=Extra)

    with pytest.raises(UnclassifiedField, match=r"extra\.new_knob") as error:
        field_roles(WithExtra)
    assert "extra.kept" not in str(error.value)


def test_the_fingerprint_records_exactly_the_recorded_roles() -> None:
    """An sft run records its setting and refused fields and the global batch; a preference
    run adds its objective fields; content fields go in as the digests `run_fingerprint`
    computes, under the keys `CONTENT_KEYS` names; no free or batch field is recorded."""
    roles = field_roles()
    recorded = {k for k, r in roles.items() if r in RECORDED and r is not Role.OBJECTIVE}
    assert set(trajectory_settings(Config())) == recorded | {BATCH_KEY}
    dpo = Config()
    dpo.train.objective = "dpo"
    objective = {k for k, r in roles.items() if r is Role.OBJECTIVE}
    assert set(trajectory_settings(dpo)) == recorded | objective | {BATCH_KEY}
    assert set(CONTENT_KEYS) == {k for k, r in roles.items() if r is Role.CONTENT}


def test_free_and_batch_fields_leave_the_fingerprint_alone() -> None:
    """Changing every free field, and the split of a global batch, changes nothing recorded."""
    base = trajectory_settings(Config())
    changed = Config()
    changed.run.name, changed.guard.window, changed.dist.timeout_s = "x", 7, 1.0
    changed.train.save_every, changed.train.device, changed.monitor.report = 3, "cpu", False
    changed.train.micro_batch_size, changed.train.grad_accum = 2, 4
    changed.train.global_batch_size = 99  # ignored with a fixed micro-batch
    assert trajectory_settings(changed) == {**base, BATCH_KEY: 8}


def test_refused_changes_are_the_refused_roles() -> None:
    reasons = refused_reasons()
    assert set(reasons) == {k for k, r in field_roles().items() if r is Role.REFUSED}
    assert reasons.items() <= REFUSED.items()
    assert set(REFUSED) - set(reasons) == {"model.architecture"}  # not a config field


def test_a_preference_runs_fingerprint_holds_every_preference_setting() -> None:
    """train.objective and every preference.* field are recorded for a preference run (another
    beta is another run) and none of them for an sft run."""
    keys = {"train.objective"} | {k for k in field_docs() if k.startswith("preference.")}
    assert len(keys) >= 9
    assert all(field_roles()[k] is Role.OBJECTIVE for k in keys)
    for objective in ("dpo", "simpo", "orpo", "kto"):
        cfg = Config()
        cfg.train.objective = objective  # type: ignore[assignment]
        assert keys <= set(trajectory_settings(cfg)), objective
    assert not keys & set(trajectory_settings(Config()))
