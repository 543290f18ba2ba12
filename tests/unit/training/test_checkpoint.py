"""Checkpoints round-trip exactly, clean up after crashes and survive a real SIGKILL mid-save."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from leantune.training.state.checkpoint import (
    MARKER,
    CheckpointError,
    TrainingState,
    capture_rng_state,
    latest_checkpoint,
    list_complete_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)

SRC = Path(__file__).resolve().parents[3] / "src"


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Recursive exact equality; tensors must match in dtype and every bit of value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _build() -> tuple[nn.Linear, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train_step(model: nn.Linear, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8
    loss = (model(x) ** 2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _save_simple(root: Path, step: int, value: float, keep_last: int = 2) -> Path:
    return save_checkpoint(
        root,
        TrainingState(step=step, micro_batches_seen=4 * step, extra={"value": value}),
        {"w": torch.full((8,), value)},
        {"state": {}, "param_groups": []},
        {"last_epoch": step},
        None,
        capture_rng_state(),
        keep_last=keep_last,
    )


def _steps(paths: list[Path]) -> list[int]:
    return [int(p.name.split("-")[1]) for p in paths]


def test_round_trip_restores_training_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, optimizer, scheduler = _build()
    for _ in range(2):
        _train_step(model, optimizer, scheduler)
    state = TrainingState(step=2, micro_batches_seen=8, extra={"epoch": 0, "best_loss": 0.25})
    random.seed(1)
    np.random.seed(2)
    rng = capture_rng_state()
    expected = (torch.rand(5), random.random(), np.random.rand(3))

    path = save_checkpoint(
        tmp_path,
        state,
        dict(model.state_dict()),
        optimizer.state_dict(),
        scheduler.state_dict(),
        None,
        rng,
        metadata={"run": "abc"},
    )
    assert path == tmp_path / "step-000002"
    assert sorted(p.name for p in path.iterdir()) == [
        MARKER,
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
        "trainer_state.pt",
    ]
    assert json.loads((path / "trainer_state.json").read_text())["micro_batches_seen"] == 8

    ckpt = load_checkpoint(path)
    assert ckpt.path == path
    assert ckpt.state == state
    assert ckpt.scaler is None
    assert ckpt.metadata == {"format": "pt", "run": "abc"}
    _assert_same(dict(model.state_dict()), ckpt.weights, "weights")
    _assert_same(optimizer.state_dict(), ckpt.optimizer, "optimizer")
    _assert_same(scheduler.state_dict(), ckpt.scheduler, "scheduler")
    assert len(ckpt.optimizer["state"]) == 2  # AdamW moments for weight and bias exist

    restore_rng_state(ckpt.rng)
    assert torch.equal(torch.rand(5), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])

    # Resuming from the checkpoint continues bit-exactly like the uninterrupted run.
    resumed, resumed_opt, resumed_sched = _build()
    resumed.load_state_dict(ckpt.weights)
    resumed_opt.load_state_dict(ckpt.optimizer)
    resumed_sched.load_state_dict(ckpt.scheduler)
    _train_step(model, optimizer, scheduler)
    _train_step(resumed, resumed_opt, resumed_sched)
    _assert_same(dict(model.state_dict()), dict(resumed.state_dict()), "after resume")
    assert resumed_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_scaler_state_round_trips(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    path = save_checkpoint(
        tmp_path, TrainingState(1, 1, {}), {}, {}, {}, scaler.state_dict(), capture_rng_state()
    )
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(load_checkpoint(path).scaler or {})
    assert restored.get_scale() == 1024.0


def test_shared_and_strided_tensors_are_saved_as_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weights = {"embed": base, "lm_head": base, "row": base[1], "transposed": base.t()}
    path = save_checkpoint(tmp_path, TrainingState(3, 3, {}), weights, {}, {}, None, {})
    loaded = load_checkpoint(path).weights
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    assert loaded["transposed"].shape == (4, 3)


def test_latest_ignores_and_removes_incomplete_and_temporary_dirs(tmp_path: Path) -> None:
    _save_simple(tmp_path, 1, 1.0)
    _save_simple(tmp_path, 2, 2.0)
    unmarked = tmp_path / "step-000003"
    unmarked.mkdir()
    (unmarked / "model.safetensors").write_bytes(b"partial")
    leftover = tmp_path / ".tmp-step-000004-12345"
    leftover.mkdir()
    (leftover / MARKER).write_text("{}")
    unrelated = tmp_path / "notes"
    unrelated.mkdir()

    assert _steps(list_complete_checkpoints(tmp_path)) == [1, 2]
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step-000002"
    assert not unmarked.exists() and not leftover.exists()
    assert unrelated.exists()
    assert load_checkpoint(latest).weights["w"][0].item() == 2.0


def test_latest_on_missing_or_empty_root(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nope") is None
    assert latest_checkpoint(tmp_path) is None
    assert list_complete_checkpoints(tmp_path / "nope") == []


def test_damaged_checkpoint_with_marker_is_skipped_not_deleted(tmp_path: Path) -> None:
    _save_simple(tmp_path, 1, 1.0)
    damaged = _save_simple(tmp_path, 2, 2.0)
    optimizer_file = damaged / "optimizer.pt"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:10])  # truncated, e.g. partial copy

    assert _steps(list_complete_checkpoints(tmp_path)) == [1]
    with pytest.warns(UserWarning, match="optimizer.pt"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert damaged.exists()
    with pytest.raises(CheckpointError, match=r"step-000002.*optimizer\.pt of 10 bytes"):
        load_checkpoint(damaged)


def test_keep_last_rotation(tmp_path: Path) -> None:
    for step in range(1, 5):
        _save_simple(tmp_path, step, float(step), keep_last=2)
    assert _steps(list_complete_checkpoints(tmp_path)) == [3, 4]

    # Re-saving an older step keeps it and the newest other one.
    _save_simple(tmp_path, 2, 2.0, keep_last=2)
    assert _steps(list_complete_checkpoints(tmp_path)) == [2, 4]

    _save_simple(tmp_path, 5, 5.0, keep_last=1)
    assert _steps(list_complete_checkpoints(tmp_path)) == [5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000005"]

    with pytest.raises(ValueError, match="keep_last"):
        _save_simple(tmp_path, 6, 6.0, keep_last=0)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    _save_simple(tmp_path, 7, 1.0)
    path = _save_simple(tmp_path, 7, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007"]
    assert load_checkpoint(path).weights["w"][0].item() == 2.0


def test_load_errors_name_the_path_and_what_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "step-000009"
    with pytest.raises(CheckpointError, match=r"step-000009.*does not exist"):
        load_checkpoint(missing)

    path = _save_simple(tmp_path, 1, 1.0)
    (path / MARKER).unlink()
    with pytest.raises(CheckpointError, match=rf"{path.name} is not a complete.*no {MARKER}"):
        load_checkpoint(path)

    path = _save_simple(tmp_path, 2, 2.0)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step-000002.*missing optimizer\.pt"):
        load_checkpoint(path)


def test_invalid_inputs_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, TrainingState(1, 1, {"bad": object()}), {}, {}, {}, None, {})
    with pytest.raises(ValueError, match="metadata"):
        save_checkpoint(tmp_path, TrainingState(1, 1, {}), {}, {}, {}, None, {}, metadata={"a": 1})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


class _Evil:
    """Unpickling this would create a file: proof that code in a checkpoint ran."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.target), "w"))


def test_objects_beyond_weights_only_are_refused(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt.*weights_only=True"):
        save_checkpoint(root, TrainingState(1, 1, {}), {}, {}, {"x": _Evil(sentinel)}, None, {})
    assert list(root.iterdir()) == []  # no temporary directory left behind

    # A complete checkpoint whose trainer_state.pt was swapped for a malicious one: the
    # checksum refuses it, and so does weights-only loading once the marker is redone to match.
    path = _save_simple(root, 2, 2.0)
    swapped = path / "trainer_state.pt"
    torch.save({"scheduler": _Evil(sentinel), "scaler": None, "rng": {}}, swapped)
    with pytest.raises(CheckpointError, match=r"step-000002.*trainer_state\.pt (of|with sha)"):
        load_checkpoint(path)
    manifest = json.loads((path / MARKER).read_text())
    manifest["files"]["trainer_state.pt"] = {
        "size": swapped.stat().st_size,
        "sha256": hashlib.sha256(swapped.read_bytes()).hexdigest(),
    }
    (path / MARKER).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step-000002.trainer_state\.pt"):
        load_checkpoint(path)
    assert not sentinel.exists()


_CHILD = r"""
import os, shutil, signal, sys
from pathlib import Path

import torch

import leantune.training.state.checkpoint as ck

root, point = Path(sys.argv[1]), sys.argv[2]


def save(step, value):
    ck.save_checkpoint(
        root,
        ck.TrainingState(step, 4 * step, {"value": value}),
        {"w": torch.full((1024,), value)},
        {"state": {0: {"exp_avg": torch.full((1024,), value)}}, "param_groups": []},
        {"last_epoch": step},
        None,
        ck.capture_rng_state(),
        keep_last=2,
    )


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


save(1, 1.0)
if point == "before_marker":
    ck._write_marker = die  # step 2's data files are written and fsynced, the marker is not
    save(2, 2.0)
elif point == "after_move_aside":
    real_move_aside = ck._move_aside

    def move_aside_then_die(src, dst):
        real_move_aside(src, dst)
        die()

    ck._move_aside = move_aside_then_die  # re-saving step 1: old moved aside, new not yet in
    save(1, 9.0)
elif point == "mid_rotation":
    save(2, 2.0)

    def rmtree_halfway(path, *args, **kwargs):
        (Path(path) / "model.safetensors").unlink()  # the marker survives, the weights do not
        die()

    shutil.rmtree = rmtree_halfway  # saving step 3 rotates step 1 away
    save(3, 3.0)
sys.exit(3)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
@pytest.mark.parametrize(
    ("point", "leftover", "expected_steps", "expected_value"),
    [
        ("before_marker", ".tmp-step-000002-", [1], 1.0),
        ("after_move_aside", ".old-step-000001-", [1], 1.0),
        ("mid_rotation", ".tmp-del-step-000001-", [2, 3], 3.0),
    ],
)
def test_sigkill_mid_save_leaves_previous_checkpoints_intact(
    tmp_path: Path, point: str, leftover: str, expected_steps: list[int], expected_value: float
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), point],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # The kill hit the intended moment: its half-done work is on disk.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(leftover)], point

    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:06d}" for s in expected_steps]
    assert _steps(list_complete_checkpoints(tmp_path)) == expected_steps
    ckpt = load_checkpoint(latest)
    assert ckpt.state.step == expected_steps[-1]
    assert ckpt.state.micro_batches_seen == 4 * expected_steps[-1]
    assert torch.equal(ckpt.weights["w"], torch.full((1024,), expected_value))
    assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], torch.full((1024,), expected_value))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weights_and_rng_round_trip(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(3)
    weights = {"w": torch.randn(4, device="cuda")}
    rng = capture_rng_state()
    expected = torch.rand(4, device="cuda")
    path = save_checkpoint(tmp_path, TrainingState(1, 1, {}), weights, {}, {}, None, rng)

    ckpt = load_checkpoint(path, map_location="cuda:0")
    assert ckpt.weights["w"].device.type == "cuda"
    assert torch.equal(ckpt.weights["w"], weights["w"])
    assert len(ckpt.rng["cuda"]) == torch.cuda.device_count()
    restore_rng_state(ckpt.rng)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
