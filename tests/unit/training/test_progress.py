"""The run's progress record: a checkpoint written by an older leantune still resumes exactly.

``tests/fixtures/run_fd108a7`` holds a checkpoint written at commit fd108a7, before the run state
was typed (its README says how it was made): a LoRA run whose micro-batch an OOM halved and
whose loss spike rolled it back, so every key of the old ``extra`` is in it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from leantune.config import GuardConfig
from leantune.core.optim import Schedule, warmup_cosine
from leantune.monitor.metrics import read_metrics
from leantune.training.checks import load_config
from leantune.training.guard.detect import Decision, GuardHistory, remember
from leantune.training.recipe import train
from leantune.training.state.checkpoint import MARKER, CheckpointError, load_checkpoint
from leantune.training.state.progress import ROLLBACK, VERSION, Batching, RunProgress
from leantune.training.state.verify import file_digest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "run_fd108a7"
STORED = "step-000006"


def _maker() -> ModuleType:
    """The fixture's own script: the run's settings and faults are read from it."""
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Runs:
    """The stored run resumed with this code, and the same run trained uninterrupted."""

    stored: dict[str, Any]
    """The stored checkpoint's ``trainer_state.json``."""
    resumed: Path
    straight: Path
    log: list[str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    maker = _maker()
    root = tmp_path_factory.mktemp("fixture")
    shutil.copytree(FIXTURE, root, dirs_exist_ok=True)
    stored = json.loads((root / "run" / "checkpoints" / STORED / "trainer_state.json").read_text())
    log: list[str] = []
    # Without the faults: they struck at steps 2 and 6, before the checkpoint. A resume that
    # started over would differ from the straight run.
    train(load_config(None, maker.overrides(root)), log=log.append)
    straight = root / "straight"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in maker.ENV.items():
            mp.setenv(name, value)
        train(
            load_config(None, [*maker.overrides(root), f"run.dir={straight}"]), log=lambda _: None
        )
    return Runs(stored, root / "run", straight, log)


def _state(run: Path, step: int) -> dict[str, Any]:
    return json.loads((run / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").read_text())


def test_the_old_checkpoint_resumes_with_its_state_values_exactly(runs: Runs) -> None:
    assert any(f"{STORED} at step 6" in line and "resumed from" in line for line in runs.log)
    old = runs.stored["extra"]
    assert old["batching"] == {"global_batch": 4, "micro_batch_size": 1, "samples_seen": 32}
    assert (old["lr_scale"], old["rollbacks"], old["base_exact_match"]) == (0.5, 1, 0.0)
    metrics = read_metrics(runs.resumed / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    m7, m8 = metrics[6], metrics[7]
    # The micro-batch the OOM shrank stays shrunk; the data position goes on from 32 samples.
    assert (m7["micro_batch_size"], m7["grad_accum"]) == (1, 4)
    after = _state(runs.resumed, 8)
    assert (
        after["step"] == 8 and after["micro_batches_seen"] == runs.stored["micro_batches_seen"] + 8
    )
    new = after["extra"]
    assert new["batching"] == {"global_batch": 4, "micro_batch_size": 1, "samples_seen": 32 + 8}
    # The rollback's LR scale and count, and the base model's exact match, carry on.
    assert (new["lr_scale"], new["rollbacks"], new["base_exact_match"]) == (0.5, 1, 0.0)
    assert m7["lr"] == pytest.approx(0.5 * 1e-3 * warmup_cosine(6, 10, 1, 0.1), rel=1e-12)
    base_lrs = load_checkpoint(runs.resumed / "checkpoints" / "step-000008").scheduler["base_lrs"]
    assert base_lrs and all(lr == 0.5e-3 for lr in base_lrs)
    # The guard's history is the stored one with steps 7 and 8 added.
    history = GuardHistory.from_json(old["guard"])
    for m in (m7, m8):
        history = remember(
            history, m["loss"], m["grad_norm"], Decision("step"), GuardConfig().window
        )
    assert new["guard"] == history.to_json()
    # Training time adds up from the stored value; the last loss is step 8's.
    assert new["train_time_s"] == old["train_time_s"] + m7["step_time_s"] + m8["step_time_s"]
    assert new["last_loss"] == m8["loss"]
    assert new["schedule"] == old["schedule"]


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed_in_the_old_layout(straight: Path, work: Path) -> Path:
    """The uninterrupted run cut back to its step-6 checkpoint, that checkpoint rewritten in
    the version-1 layout (v2 without its version key), then resumed by this code."""
    run = work / "old-layout"
    shutil.copytree(straight, run)
    for later in ("step-000008", "step-000010"):
        shutil.rmtree(run / "checkpoints" / later)
    shutil.rmtree(run / "final")
    ckpt = run / "checkpoints" / STORED
    raw = json.loads((ckpt / "trainer_state.json").read_text())
    assert raw["extra"].pop("version") == VERSION
    (ckpt / "trainer_state.json").write_text(json.dumps(raw))
    _remark(ckpt)
    inputs = straight.parent  # the model and data the fixture's runs train on
    train(load_config(None, [*_maker().overrides(inputs), f"run.dir={run}"]), log=lambda _: None)
    return run


def test_the_old_checkpoint_continues_bit_exact_like_the_uninterrupted_run(
    runs: Runs, tmp_path: Path
) -> None:
    stored = load_checkpoint(FIXTURE / "run" / "checkpoints" / STORED)
    mine = load_checkpoint(runs.straight / "checkpoints" / STORED)
    adam = stored.optimizer["state"]
    reproduced = _same_tensors(stored.weights, mine.weights) and all(
        _same_tensors(adam[k], mine.optimizer["state"][k]) for k in adam
    )
    if reproduced:  # this code computes the fixture's first 6 steps bit for bit
        assert mine.rng["torch"].equal(stored.rng["torch"])
        resumed = runs.resumed
    else:  # other kernels or arithmetic: the state values are checked by the test above, and
        # the continuation from a checkpoint in the old layout is checked on this run's own
        resumed = _resumed_in_the_old_layout(runs.straight, tmp_path)
    a = read_metrics(runs.straight / "metrics.jsonl")
    b = read_metrics(resumed / "metrics.jsonl")
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "micro_batch_size"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    wa = load_file(runs.straight / "final" / "adapter_model.safetensors")
    wb = load_file(resumed / "final" / "adapter_model.safetensors")
    assert _same_tensors(wa, wb)
    for step in (8, 10):
        sa, sb = _state(runs.straight, step), _state(resumed, step)
        assert sa["micro_batches_seen"] == sb["micro_batches_seen"]
        for key in ("batching", "guard", "lr_scale", "rollbacks", "schedule", "base_exact_match"):
            assert sa["extra"][key] == sb["extra"][key], (step, key)


def test_after_a_rollback_checkpoints_go_on_counting_time_and_the_last_loss(runs: Runs) -> None:
    metrics = read_metrics(runs.straight / "metrics.jsonl")
    at = {step: _state(runs.straight, step)["extra"] for step in (6, 8, 10)}
    assert at[6]["rollbacks"] == 1  # the rollback happened before step 6 was saved
    assert [at[s]["last_loss"] for s in (6, 8, 10)] == [metrics[s - 1]["loss"] for s in (6, 8, 10)]
    assert at[6]["train_time_s"] < at[8]["train_time_s"] < at[10]["train_time_s"]
    summary = json.loads((runs.straight / "summary.json").read_text())
    assert summary["train_time_s"] == round(at[10]["train_time_s"], 2)
    assert summary["final_train_loss"] == metrics[-1]["loss"]


def _remark(path: Path) -> None:
    """Recompute the marker's sizes and checksums after an edit."""
    manifest = json.loads((path / MARKER).read_text())
    for name, entry in manifest["files"].items():
        entry.update(size=(path / name).stat().st_size, sha256=file_digest(path / name))
    (path / MARKER).write_text(json.dumps(manifest))


def test_the_oldest_layout_without_batching_and_schedule_still_resumes(tmp_path: Path) -> None:
    maker = _maker()
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    ckpt = tmp_path / "run" / "checkpoints" / STORED
    raw = json.loads((ckpt / "trainer_state.json").read_text())
    for key in ("batching", "schedule", "lr_scale", "rollbacks", "last_loss", "train_time_s"):
        del raw["extra"][key]
    (ckpt / "trainer_state.json").write_text(json.dumps(raw))
    _remark(ckpt)
    log: list[str] = []
    train(load_config(None, maker.overrides(tmp_path)), log=log.append)
    assert any("resumed from" in line and "at step 6" in line for line in log)
    new = _state(tmp_path / "run", 8)["extra"]
    # Without a recorded data position it is micro-batches seen times the configured micro-batch.
    assert new["batching"] == {"global_batch": 4, "micro_batch_size": 2, "samples_seen": 22 * 2 + 8}
    assert new["schedule"] == Schedule(1, 10, 0.1).to_json()  # the config's
    assert (new["lr_scale"], new["rollbacks"], new["version"]) == (1.0, 0, VERSION)
    assert new["guard"]["losses"][:6] == raw["extra"]["guard"]["losses"]


# --------------------------------------------------------------------------------------------
# RunProgress itself


def test_the_stored_untyped_state_reads_as_typed_values_and_writes_back_the_same() -> None:
    raw = json.loads((FIXTURE / "run" / "checkpoints" / STORED / "trainer_state.json").read_text())
    old = raw["extra"]
    assert "version" not in old
    progress = RunProgress.from_json(old)
    assert progress.batching == Batching(global_batch=4, micro_batch_size=1, samples_seen=32)
    assert progress.guard == GuardHistory.from_json(old["guard"])
    assert progress.schedule == Schedule.from_json(old["schedule"])
    assert (progress.lr_scale, progress.rollbacks) == (0.5, 1)
    assert (progress.train_time_s, progress.last_loss) == (old["train_time_s"], old["last_loss"])
    assert progress.base_exact_match == old["base_exact_match"]
    assert progress.to_json() == {**old, "version": VERSION}
    assert RunProgress.from_json(json.loads(json.dumps(progress.to_json()))) == progress


def test_missing_keys_take_the_defaults_and_none_is_left_out() -> None:
    empty = RunProgress.from_json({})
    assert empty == RunProgress()
    assert (empty.batching, empty.schedule, empty.last_loss, empty.base_exact_match) == (None,) * 4
    assert (empty.guard, empty.train_time_s, empty.lr_scale, empty.rollbacks) == (
        GuardHistory(),
        0.0,
        1.0,
        0,
    )
    assert RunProgress().to_json() == {
        "version": VERSION,
        "guard": GuardHistory().to_json(),
        "train_time_s": 0.0,
        "lr_scale": 1.0,
        "rollbacks": 0,
    }
    # A schedule that cannot be read counts as unrecorded: the config's applies then.
    assert RunProgress.from_json({"schedule": {"warmup_steps": 1}}).schedule is None
    with pytest.raises(ValueError, match="newer"):
        RunProgress.from_json({"version": VERSION + 1})


def test_a_rollback_keeps_what_its_fields_say_and_restores_the_rest() -> None:
    running = RunProgress(
        batching=Batching(4, 1, 48),
        guard=GuardHistory((1.0, 2.0), (0.5, 0.6), 0),
        schedule=Schedule(1, 10, 0.1),
        last_loss=2.0,
        train_time_s=9.5,
        base_exact_match=0.25,
        lr_scale=0.5,
        rollbacks=1,
    )
    restored = RunProgress(
        batching=Batching(4, 2, 16),
        guard=GuardHistory((1.0,), (0.5,), 0),
        schedule=Schedule(1, 10, 0.1, 3, 0.9),
        last_loss=1.0,
        train_time_s=3.0,
        lr_scale=0.5,
        rollbacks=1,
    )
    after = running.rolled_back(restored, 0.5)
    assert after == RunProgress(
        batching=restored.batching,
        guard=restored.guard,
        schedule=restored.schedule,
        last_loss=1.0,
        train_time_s=9.5,
        base_exact_match=0.25,
        lr_scale=0.25,
        rollbacks=2,
    )
    assert (restored.lr_scale, restored.rollbacks, running.rollbacks) == (0.5, 1, 1)  # unchanged
    assert {f.name: f.metadata[ROLLBACK] for f in dataclasses.fields(RunProgress)} == {
        "batching": "restored",
        "guard": "restored",
        "schedule": "restored",
        "last_loss": "restored",
        "train_time_s": "kept",
        "base_exact_match": "kept",
        "lr_scale": "kept",
        "rollbacks": "kept",
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("version", VERSION + 1),
        ("version", 0),
        ("last_loss", "x"),
        ("base_exact_match", 1.5),
    ],
)
def test_a_progress_value_that_cannot_be_read_is_refused_naming_it(
    tmp_path: Path, key: str, value: Any
) -> None:
    shutil.copytree(FIXTURE / "run" / "checkpoints" / STORED, tmp_path / STORED)
    state_file = tmp_path / STORED / "trainer_state.json"
    raw = json.loads(state_file.read_text())
    raw["extra"][key] = value
    state_file.write_text(json.dumps(raw))
    _remark(tmp_path / STORED)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / STORED)
    assert f"extra.{key} is {value!r}" in str(info.value)
