"""Checkpoints are trusted only after they check out: checksums, state values, damaged runs,
pickles, symlinks, failing disks and diverged weights."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from support import chat_rows, run_cli, write_jsonl

import leantune.training.state.checkpoint as ck
from leantune.monitor.events import EXIT_GUARD_STOPPED, read_events
from leantune.training import build as components
from leantune.training.state import verify as checkpoint_verify
from leantune.training.state.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpoints,
    TrainingState,
    capture_rng_state,
    latest_checkpoint,
    list_complete_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)

DATA_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.pt", "trainer_state.json")


def _save(root: Path, step: int, value: float = 1.0, **extra: Any) -> Path:
    torch.manual_seed(step)
    batching = {"global_batch": 4, "micro_batch_size": 2, "samples_seen": 4 * step}
    return save_checkpoint(
        root,
        TrainingState(
            step=step, micro_batches_seen=2 * step, extra={"batching": batching, **extra}
        ),
        {"w": torch.randn(64 * 1024) + value},  # 256 KiB: room for 60 KB of zeros in the middle
        {"state": {0: {"exp_avg": torch.randn(1024)}}, "param_groups": []},
        {"last_epoch": step},
        None,
        capture_rng_state(),
        keep_last=5,
    )


def _remark(path: Path) -> None:
    """Recompute the marker's sizes and checksums: what someone who edited a file and re-marked
    the checkpoint would do."""
    manifest = json.loads((path / MARKER).read_text())
    manifest["files"] = {
        name: {
            "size": (path / name).stat().st_size,
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
        for name in DATA_FILES
    }
    (path / MARKER).write_text(json.dumps(manifest))


def _zero_middle(file: Path, count: int = 60_000) -> None:
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.seek(size // 2 - count // 2)
        f.write(b"\0" * count)
    assert file.stat().st_size == size


# --------------------------------------------------------------------------------------------
# Checksums


def test_zeros_written_into_the_weights_are_caught_although_the_size_is_unchanged(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path, 3)
    _zero_middle(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"step-000003.*model\.safetensors.*sha256"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", DATA_FILES)
def test_one_changed_byte_in_any_file_is_caught(tmp_path: Path, name: str) -> None:
    path = _save(tmp_path, 2)
    file = path / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{name}.*sha256"):
        load_checkpoint(path)


def test_the_marker_records_size_and_sha256_of_each_file(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / MARKER).read_text())
    assert manifest["format_version"] == ck.FORMAT_VERSION == 2
    assert sorted(manifest["files"]) == sorted(DATA_FILES)
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_format_1_checkpoint_still_loads_with_a_warning_that_it_cannot_be_verified(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path, 4)
    sizes = {name: (path / name).stat().st_size for name in DATA_FILES}
    (path / MARKER).write_text(json.dumps({"format_version": 1, "step": 4, "files": sizes}))
    warned: list[str] = []
    ckpt = load_checkpoint(path, warn=warned.append)
    assert ckpt.state.step == 4
    assert len(warned) == 1 and "cannot be verified" in warned[0] and "step-000004" in warned[0]
    # The cheap size check still applies to format 1.
    (path / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt of 1 bytes"):
        load_checkpoint(path)


def test_a_checkpoint_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / MARKER).read_text())
    manifest["format_version"] = 99
    (path / MARKER).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"format 99.*newer"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------------------
# State values


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", -1),
        ("step", "3"),
        ("micro_batches_seen", -3),
        ("micro_batches_seen", True),
        ("extra.batching.samples_seen", -7),
        ("extra.batching.samples_seen", 1.5),
        ("extra.batching.global_batch", 0),
        ("extra.batching.micro_batch_size", 0),
        ("extra.batching.micro_batch_size", 8),  # above the global batch of 4
        ("extra.batching", [1, 2]),
        ("extra.guard.consecutive_skips", -1),
        ("extra.guard.losses", ["x"]),
        ("extra.lr_scale", 0),
        # Integers past float's range: math.isfinite raises OverflowError on them.
        pytest.param("extra.lr_scale", 10**400, id="extra.lr_scale-huge-int"),
        pytest.param("extra.guard.losses", [1.0, 10**400], id="extra.guard.losses-huge-int"),
        ("extra.rollbacks", -1),
        ("extra", None),
    ],
)
def test_a_hand_edited_state_value_is_refused_naming_file_field_and_value(
    tmp_path: Path, field: str, value: Any
) -> None:
    path = _save(tmp_path, 3, guard={"losses": [1.0], "grad_norms": [1.0], "consecutive_skips": 0})
    state_file = path / "trainer_state.json"
    raw = json.loads(state_file.read_text())
    *parents, leaf = field.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[leaf] = value
    state_file.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"bytes where|sha256"):  # the marker sees it
        load_checkpoint(path)
    _remark(path)  # edited and re-marked: only the value check stands in the way
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."  # cut to 80
    assert "trainer_state.json" in message and field in message and shown in message


def test_a_state_whose_step_disagrees_with_its_directory_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    state_file = path / "trainer_state.json"
    raw = json.loads(state_file.read_text())
    raw["step"] = 30
    state_file.write_text(json.dumps(raw))
    _remark(path)
    with pytest.raises(CheckpointError, match=r"trainer_state\.json.*step is 30.*step-000003"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------------------
# Choosing the checkpoint to resume from


def test_resume_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    _zero_middle(newest / "model.safetensors")
    warned: list[str] = []
    ckpt = resume_checkpoint(tmp_path, warn=warned.append)
    assert ckpt is not None and ckpt.path.name == "step-000002"
    assert any("step-000004" in w and "sha256" in w and "step-000002" in w for w in warned)
    assert newest.exists()  # kept for inspection, never deleted by the check


def test_resume_from_the_newest_names_a_damaged_older_one_without_redoing_steps(
    tmp_path: Path,
) -> None:
    older = _save(tmp_path, 2)
    _save(tmp_path, 4)
    (older / "optimizer.pt").write_bytes(b"cut")
    warned: list[str] = []
    ckpt = resume_checkpoint(tmp_path, warn=warned.append)
    assert ckpt is not None and ckpt.path.name == "step-000004"
    assert len(warned) == 1 and "older checkpoint is damaged" in warned[0]
    assert "step-000002" in warned[0] and "trained again" not in warned[0]


def test_resume_with_every_checkpoint_damaged_names_each(tmp_path: Path) -> None:
    first, second = _save(tmp_path, 2), _save(tmp_path, 4)
    _zero_middle(second / "model.safetensors")
    (first / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(DamagedCheckpoints) as info:
        resume_checkpoint(tmp_path, warn=lambda _: None)
    message = str(info.value)
    assert "step-000002" in message and "optimizer.pt of 9 bytes" in message
    assert "step-000004" in message and "sha256" in message
    assert "run.resume=never" in message and "run.name" in message
    assert info.value.exit_code == 2
    assert first.exists() and second.exists()


def test_resume_on_an_empty_root_is_none(tmp_path: Path) -> None:
    assert resume_checkpoint(tmp_path / "missing") is None
    assert resume_checkpoint(tmp_path) is None


# --------------------------------------------------------------------------------------------
# Pickles


class _Evil:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.target), "w"))


def test_a_refused_pickle_says_what_was_found_and_never_advises_weights_only_false(
    tmp_path: Path,
) -> None:
    sentinel = tmp_path / "pwned"
    path = _save(tmp_path / "ckpts", 2)
    torch.save({"scheduler": _Evil(sentinel), "scaler": None, "rng": {}}, path / "trainer_state.pt")
    _remark(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "trainer_state.pt" in message and "io.open" in message
    assert "never unpickles" in message
    assert "weights_only=False" not in message and "likely succeed" not in message
    assert "weights_only` set to `False`" not in message and "add_safe_globals" not in message
    assert not sentinel.exists()


# --------------------------------------------------------------------------------------------
# Symbolic links


@pytest.mark.parametrize("name", [".tmp-step-000009-1", ".old-step-000001-1", ".tmp-del-x-1"])
def test_a_symlinked_leftover_is_unlinked_and_its_target_survives(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "ckpts"
    _save(root, 1)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.txt").write_text("keep me")
    (target / MARKER).write_text("{}")
    (root / name).symlink_to(target, target_is_directory=True)
    assert latest_checkpoint(root) == root / "step-000001"
    assert not (root / name).is_symlink() and not (root / name).exists()
    assert (target / "data.txt").read_text() == "keep me" and (target / MARKER).exists()


def test_a_symlinked_step_directory_is_never_used_nor_deleted_through(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    elsewhere = _save(tmp_path / "other", 7)
    _save(root, 1)
    (root / "step-000007").symlink_to(elsewhere, target_is_directory=True)
    warned: list[str] = []
    ckpt = resume_checkpoint(root, warn=warned.append)
    assert ckpt is not None and ckpt.path.name == "step-000001"
    assert any("step-000007" in w and "symbolic link" in w for w in warned)
    assert [p.name for p in list_complete_checkpoints(root)] == ["step-000001"]
    # Rotation and re-saving that step replace the link, never the target's files.
    for step in (7, 8, 9):
        save_checkpoint(
            root, TrainingState(step, step, {}), {}, {}, {}, None, {}, keep_last=1
        )  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == ["step-000009"]
    assert load_checkpoint(elsewhere).state.step == 7


def test_a_symlink_at_the_save_directory_name_is_replaced_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.txt").write_text("keep me")
    (root / f".tmp-step-000003-{os.getpid()}").symlink_to(target, target_is_directory=True)
    path = save_checkpoint(root, TrainingState(3, 3, {}), {}, {}, {}, None, {})
    assert load_checkpoint(path).state.step == 3
    assert (target / "data.txt").read_text() == "keep me"


def test_only_symlinked_checkpoints_mean_none_to_resume_from(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "step-000005").symlink_to(_save(tmp_path / "other", 5), target_is_directory=True)
    with pytest.raises(DamagedCheckpoints, match=r"step-000005.*symbolic link"):
        resume_checkpoint(root, warn=lambda _: None)


# --------------------------------------------------------------------------------------------
# A disk that fails while saving


class _FailingFile:
    """A file whose writes fail with `code` once `after` bytes went through."""

    def __init__(self, file: Any, code: int, after: int) -> None:
        self.file, self.code, self.left = file, code, after

    def write(self, data: Any) -> int:
        self.left -= memoryview(data).nbytes
        if self.left < 0:
            raise OSError(self.code, os.strerror(self.code))
        return int(self.file.write(data))

    def flush(self) -> None:
        self.file.flush()


def _fail_torch_writes(monkeypatch: pytest.MonkeyPatch, code: int, after: int = 100) -> None:
    """Make the files torch.save writes (through the hashing writer) fail after `after` bytes."""
    writer = checkpoint_verify.HashingWriter
    original = writer.__init__

    def init(self: checkpoint_verify.HashingWriter, file: Any) -> None:
        original(self, _FailingFile(file, code, after))

    monkeypatch.setattr(writer, "__init__", init)


def _fail_safetensors(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    original = ck.save_file

    def save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise SafetensorError(
            f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"
        )

    monkeypatch.setattr(ck, "save_file", save_file)
    assert original is not None


def _fail_mkdir(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    original = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith(".tmp-step-"):
            raise OSError(code, os.strerror(code), str(self))
        original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)


@pytest.mark.parametrize(
    ("where", "code"),
    [
        ("torch", errno.ENOSPC),
        ("safetensors", errno.ENOSPC),
        ("marker", errno.ENOSPC),
        ("mkdir", errno.EROFS),
        ("torch", errno.EIO),
    ],
)
def test_a_failing_disk_gives_a_clear_error_and_keeps_earlier_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int
) -> None:
    root = tmp_path / "ckpts"
    earlier = _save(root, 2)
    before = {name: (earlier / name).read_bytes() for name in DATA_FILES}
    if where == "torch":
        _fail_torch_writes(monkeypatch, code)
    elif where == "safetensors":
        _fail_safetensors(monkeypatch, code)
    elif where == "mkdir":
        _fail_mkdir(monkeypatch, code)
    else:

        def marker(*_: Any) -> None:
            raise OSError(code, "")

        monkeypatch.setattr(ck, "_write_marker", marker)
    with pytest.raises(CheckpointWriteError) as info:
        _save(root, 4)
    message = str(info.value)
    assert str(root) in message and os.strerror(code).lower() in message.lower()
    assert "step-000002" in message  # still the resume point, and it says so
    assert info.value.exit_code == 2
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]  # no temporary left
    assert {name: (earlier / name).read_bytes() for name in DATA_FILES} == before
    monkeypatch.undo()
    ckpt = resume_checkpoint(root)
    assert ckpt is not None and ckpt.path == earlier


def test_a_failed_resave_of_an_existing_step_puts_the_old_one_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpts"
    old = _save(root, 2, value=1.0)
    weights = load_checkpoint(old).weights["w"].clone()
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-step-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(CheckpointWriteError):
        _save(root, 2, value=5.0)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    assert torch.equal(load_checkpoint(old).weights["w"], weights)


def test_a_read_only_checkpoint_directory_gives_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpts"
    earlier = _save(root, 2)
    root.chmod(0o555)
    try:
        probe = root / "probe"
        try:
            probe.mkdir()
        except PermissionError:
            bypassed = False
        else:  # root ignores permission bits: simulate the read-only filesystem instead
            probe.rmdir()
            bypassed = True
            _fail_mkdir(monkeypatch, errno.EROFS)
        with pytest.raises(CheckpointWriteError) as info:
            _save(root, 4)
    finally:
        root.chmod(0o755)
    reason = os.strerror(errno.EROFS if bypassed else errno.EACCES)
    assert str(root) in str(info.value) and reason.lower() in str(info.value).lower()
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    assert load_checkpoint(earlier).state.step == 2


# --------------------------------------------------------------------------------------------
# Through the CLI: the run that meets these checkpoints


def _train_args(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train", f"model.path={model}", f"data.train={data}", "data.eval=null",
        "data.max_seq_len=128", "train.eval_exact_match=false", "train.micro_batch_size=2",
        "train.max_steps=4", "train.save_every=2", "train.keep_last=2", "train.lr=1e-2",
        "train.seed=3", f"run.dir={run}", "run.progress=false", *extra,
    ]  # fmt: skip


@pytest.fixture()
def train_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", chat_rows(24))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Copies: safetensors maps the file, so its tensors would change with the file."""
    return {name: w.clone() for name, w in load_checkpoint(path).weights.items()}


def test_cli_every_checkpoint_damaged_exits_2_naming_each_and_keeps_them(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run)
    assert run_cli(args).code == 0
    ckpts = run / "checkpoints"
    _zero_middle(ckpts / "step-000004" / "model.safetensors")
    (ckpts / "step-000002" / "optimizer.pt").write_bytes(b"cut")
    kept = {p: p.read_bytes() for p in ckpts.rglob("*") if p.is_file()}

    result = run_cli(args)
    assert result.code == 2, result
    assert "step-000002" in result.err and "optimizer.pt of 3 bytes" in result.err
    assert "step-000004" in result.err and "sha256" in result.err
    assert "run.resume=never" in result.err
    assert {p: p.read_bytes() for p in ckpts.rglob("*") if p.is_file()} == kept


def test_cli_every_checkpoint_cut_short_exits_2_and_never_starts_over(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path
) -> None:
    """Damage the cheap size check sees (a partial copy): still no silent fresh start."""
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run)
    assert run_cli(args).code == 0
    ckpts = run / "checkpoints"
    for step in ("step-000002", "step-000004"):
        (ckpts / step / "model.safetensors").write_bytes(b"cut")
    kept = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    result = run_cli(args)
    assert result.code == 2, result
    assert "step-000002" in result.err and "step-000004" in result.err
    assert "model.safetensors of 3 bytes" in result.err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == kept


def test_cli_a_damaged_newest_checkpoint_resumes_from_the_older_one(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run)
    assert run_cli(args).code == 0
    newest = run / "checkpoints" / "step-000004"
    expected = _weights(newest)
    _zero_middle(newest / "model.safetensors")

    result = run_cli(args)
    assert result.code == 0, result
    out = result.out + result.err
    assert "step-000004" in out and "damaged" in out
    assert "resumed from" in out and "step-000002" in out
    again = _weights(newest)  # steps 3 and 4 redone, bit for bit
    assert all(torch.equal(again[n], w) for n, w in expected.items())


def test_cli_a_swapped_pickle_exits_2_without_running_it(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run, "train.max_steps=2")
    assert run_cli(args).code == 0
    path = run / "checkpoints" / "step-000002"
    sentinel = tmp_path / "pwned"
    torch.save({"scheduler": _Evil(sentinel), "scaler": None, "rng": {}}, path / "trainer_state.pt")
    _remark(path)
    result = run_cli(args)
    assert result.code == 2, result
    assert "trainer_state.pt" in result.err and "never unpickles" in result.err
    assert "weights_only=False" not in result.err and "likely succeed" not in result.err
    assert not sentinel.exists()


def test_cli_a_symlinked_tmp_directory_is_unlinked_and_its_target_kept(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run)
    assert run_cli(args).code == 0
    shutil.rmtree(run / "checkpoints" / "step-000004")  # as if it stopped after step 2
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (run / "checkpoints" / ".tmp-step-000003-1").symlink_to(target, target_is_directory=True)
    result = run_cli(args)
    assert result.code == 0, result
    assert "resumed from" in result.out
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000004",
    ]


def test_cli_a_full_disk_mid_run_exits_2_and_the_next_run_resumes_exactly(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_path / "reference"
    assert run_cli(_train_args(tiny_llama_dir, train_file, reference)).code == 0

    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run)
    original = ck._write_payload

    def payload(directory: Path, *rest: Any) -> Any:
        if directory.name.startswith(".tmp-step-000004"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "x"))
        return original(directory, *rest)

    monkeypatch.setattr(ck, "_write_payload", payload)
    result = run_cli(args)
    assert result.code == 2, result
    assert "No space left on device" in result.err and str(run / "checkpoints") in result.err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]

    monkeypatch.undo()
    result = run_cli(args)
    assert result.code == 0, result
    assert "resumed from" in result.out and "step-000002" in result.out
    expected = _weights(reference / "checkpoints" / "step-000004")
    got = _weights(run / "checkpoints" / "step-000004")
    assert all(torch.equal(got[n], w) for n, w in expected.items())


# --------------------------------------------------------------------------------------------
# Diverged weights


def _poison_weights_after_update(monkeypatch: pytest.MonkeyPatch, update: int) -> None:
    """Fill one trainable tensor with NaN right after optimizer update number `update`."""
    original = components.build_optimizer

    def build(params: Any, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = original(params, *args, **kwargs)
        count = [0]

        def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
            count[0] += 1
            if count[0] == update:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].fill_(math.nan)

        optimizer.register_step_post_hook(hook)
        return optimizer

    monkeypatch.setattr(components, "build_optimizer", build)


def test_cli_guard_stop_with_nan_weights_writes_no_checkpoint_and_names_the_last_good(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_weights_after_update(monkeypatch, 3)
    run = tmp_path / "run"
    args = _train_args(
        tiny_llama_dir, train_file, run, "train.max_steps=8", "guard.max_consecutive_skips=2"
    )
    result = run_cli(args)
    assert result.code == EXIT_GUARD_STOPPED, result
    assert "2 consecutive steps skipped" in result.err  # the guard's reason, then the weights'
    assert "diverged" in result.err and "no checkpoint was written" in result.err
    assert "step-000002" in result.err and "train.lr" in result.err
    assert "resumes" not in result.err
    stop = read_events(run / "events.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["checkpoint"] is None and "diverged" in stop["message"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    kept = _weights(run / "checkpoints" / "step-000002")
    assert all(torch.isfinite(w).all() for w in kept.values())


def test_cli_a_periodic_save_of_nan_weights_is_refused(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_weights_after_update(monkeypatch, 4)
    run = tmp_path / "run"
    result = run_cli(_train_args(tiny_llama_dir, train_file, run))
    assert result.code == EXIT_GUARD_STOPPED, result
    assert "diverged" in result.err and "step 4" in result.err and "step-000002" in result.err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    (stop,) = read_events(run / "events.jsonl")
    assert (stop["kind"], stop["step"], stop["checkpoint"]) == ("stop", 4, None)
    assert "diverged" in stop["message"]


def test_cli_nan_weights_from_the_first_update_leave_no_checkpoint(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_weights_after_update(monkeypatch, 1)
    run = tmp_path / "run"
    args = _train_args(tiny_llama_dir, train_file, run, "guard.max_consecutive_skips=2")
    result = run_cli(args)
    assert result.code == EXIT_GUARD_STOPPED, result
    assert "diverged" in result.err and "no earlier checkpoint" in result.err
    assert "resumes" not in result.err
    assert not list((run / "checkpoints").iterdir())
    shutil.rmtree(run)
