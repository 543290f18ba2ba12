"""Finding, verifying and loading checkpoints: which of a run's checkpoints are complete
(`list_complete_checkpoints`, `newest_checkpoint`), cleaning up interrupted saves on the way, and
loading the newest one that passes every check (`resume_checkpoint`, `load_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from leantune.layout import checkpoint_step
from leantune.training.state import verify
from leantune.training.state.files import fsync_dir, remove_tree
from leantune.training.state.format import (
    FORMAT_VERSION,
    MARKER,
    OLD_PREFIX,
    OLD_RE,
    OPTIMIZER_FILE,
    SHARDED_LAYOUT,
    STATE_JSON_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    DamagedCheckpoints,
    TrainingState,
    Warn,
    manifest_names,
    step_of,
)

logger = logging.getLogger(__name__)


def list_complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, sorted by step (oldest first).

    Args:
        root: Directory holding the run's checkpoints; missing means none.

    Returns:
        Paths of ``step-*`` directories whose marker and files all check out.
    """
    return [path for _, path in _scan(Path(root))[0]]


def newest_complete(root: Path) -> Path | None:
    try:
        complete = list_complete_checkpoints(root)
    except OSError:  # only named in error messages: an unreadable root must not mask the error
        return None
    return complete[-1] if complete else None


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step, after cleaning up interrupted saves.

    Puts back a checkpoint that an interrupted re-save had moved aside, then deletes ``.tmp-*``
    leftovers and ``step-*`` directories without a ``COMPLETE`` marker. A directory with a
    marker whose files do not match it is skipped with a warning, not deleted.

    Args:
        root: Directory holding the run's checkpoints; missing means none.

    Returns:
        The newest complete checkpoint, or None when there is none.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    _clean(root)
    complete, damaged = _scan(root)
    # Marked but mismatched: its save finished, so it is skipped, not deleted, and the damage
    # can be inspected or repaired.
    for path, problem in damaged:
        warnings.warn(f"skipping damaged checkpoint {path}: it {problem}", stacklevel=2)
    return complete[-1][1] if complete else None


def newest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint by the cheap size check: is there a run to resume, and where?

    Cleans up like :func:`latest_checkpoint`. Unlike it, checkpoints that all fail the size
    check are an error, not "no run": the caller must not start over on top of them.

    Raises:
        DamagedCheckpoints: ``step-*`` directories with a marker exist but none is whole.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    _clean(root)
    complete, damaged = _scan(root)
    if complete:
        return complete[-1][1]
    # Not "no run": starting over here would write on top of checkpoints a user may repair.
    if damaged:
        problems = [f"{path} cannot be used: it {why}" for path, why in damaged]
        raise DamagedCheckpoints(root, problems)
    return None


def resume_checkpoint(
    root: Path, map_location: str = "cpu", warn: Warn | None = None
) -> Checkpoint | None:
    """Load the newest checkpoint under ``root`` that passes every check.

    Cleans up like :func:`latest_checkpoint`, then tries the checkpoints newest first with
    :func:`load_checkpoint` (sizes, checksums, state values, weights-only unpickling), so each
    file is verified once, right before it is used. A damaged newer checkpoint is skipped with a
    warning and kept for inspection; the steps after the older one are trained again.

    Args:
        root: Directory holding the run's checkpoints; missing means none.
        map_location: As for :func:`load_checkpoint`.
        warn: Receives each warning (default: ``warnings.warn``).

    Returns:
        The loaded checkpoint, or None when ``root`` holds no checkpoint at all.

    Raises:
        DamagedCheckpoints: When checkpoints exist but none passes; it names each and why.
    """
    warn = warn or _warn
    root = Path(root)
    if not root.is_dir():
        return None
    _clean(root)
    complete, damaged = _scan(root)
    problems = [(step_of(path), f"{path} cannot be used: it {why}") for path, why in damaged]
    # Newest first, each file verified right before it is used: checksums are the costly part,
    # and an older checkpoint is only read when every newer one failed.
    for step, path in reversed(complete):
        try:
            ckpt = load_checkpoint(path, map_location, warn)
        except CheckpointError as exc:
            problems.append((step, str(exc)))
            continue
        newer = [why for s, why in sorted(problems) if s > step]
        if newer:
            warn(
                f"resuming from {path}, the newest checkpoint that checks out; newer ones are "
                f"damaged and kept for inspection: {'; '.join(newer)}. The steps after step "
                f"{step} are trained again (resume is deterministic)."
            )
        for why in (why for s, why in sorted(problems) if s <= step):
            warn(f"an older checkpoint is damaged (kept for inspection): {why}")
        return ckpt
    if problems:
        raise DamagedCheckpoints(root, [why for _, why in sorted(problems)])
    return None


def load_checkpoint(path: Path, map_location: str = "cpu", warn: Warn | None = None) -> Checkpoint:
    """Load one complete checkpoint directory, after verifying it.

    Args:
        path: A ``step-*`` directory written by :func:`save_checkpoint`.
        map_location: Device for the weights and optimizer tensors; scheduler, scaler and RNG
            states always load on CPU.
        warn: Receives the warning that a format-1 checkpoint (no checksums) cannot be verified
            (default: ``warnings.warn``).

    Returns:
        The checkpoint's contents.

    Raises:
        CheckpointError: When ``path`` is not a complete checkpoint (the message names the path
            and what is missing), a file's checksum differs from its marker, a training-state
            value is invalid (named with its field), or a file holds objects other than tensors
            and plain data.
    """
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it {problem}. "
            "Use resume_checkpoint(root) to load the newest one that checks out."
        )
    manifest = json.loads((path / MARKER).read_text())  # checkpoint_problem parsed it already
    # Format 1 recorded sizes only: still loadable, but nothing to verify the bytes against.
    if manifest.get("format_version", 1) < 2:
        (warn or _warn)(
            f"{path} was written by an older leantune (checkpoint format 1, sizes only): its "
            "files cannot be verified against checksums"
        )
    else:
        names = manifest_names(manifest)
        problem = verify.checksum_problem(path, manifest["files"], names)
        if problem is not None:
            raise CheckpointError(f"{path} is damaged: it {problem}")
    step = step_of(path)
    state = _read_state_json(path / STATE_JSON_FILE, step if step >= 0 else None)
    sharded = manifest.get("layout") == SHARDED_LAYOUT
    weights: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    optimizer: dict[str, Any] = {}
    # A sharded checkpoint's weights and optimizer are loaded per rank from dcp/ by the caller.
    if not sharded:
        weights, metadata = _load_weights(path / WEIGHTS_FILE, map_location)
        optimizer = torch_load(path / OPTIMIZER_FILE, map_location)
    # CPU always: RNG states must be CPU ByteTensors to be restored.
    trainer_state = torch_load(path / TRAINER_STATE_FILE, "cpu")
    missing = {"scheduler", "scaler", "rng"} - set(trainer_state)
    if missing:
        raise CheckpointError(f"{path / TRAINER_STATE_FILE} lacks {sorted(missing)}")
    return Checkpoint(
        path=path,
        state=state,
        weights=weights,
        optimizer=optimizer,
        scheduler=trainer_state["scheduler"],
        scaler=trainer_state["scaler"],
        rng=trainer_state["rng"],
        metadata=metadata,
        sharded=sharded,
    )


def _warn(message: str) -> None:
    # 3: past this helper and the public function, to the line that called it.
    warnings.warn(message, stacklevel=3)


def _clean(root: Path) -> None:
    """Undo interrupted saves and delete their leftovers; unlink (never follow) stray links."""
    # First: an ``.old-*`` that a killed re-save left is the only copy of its step.
    _recover_moved_aside(root)
    for entry in sorted(root.iterdir()):
        if entry.is_symlink():
            # leantune never makes these names links; whatever one points at is not ours.
            if entry.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                logger.warning("removing the symbolic link %s (its target is left alone)", entry)
                entry.unlink()
            continue
        if not entry.is_dir():
            continue
        if entry.name.startswith(TMP_PREFIX):
            logger.info("removing leftover of an interrupted save or delete: %s", entry)
            shutil.rmtree(entry)
        # No marker: the save never finished (the marker is written last). The root has one
        # writer at a time, so no save of another process is in progress here.
        elif checkpoint_step(entry.name) is not None and not (entry / MARKER).exists():
            logger.warning("removing incomplete checkpoint %s (no %s marker)", entry, MARKER)
            remove_tree(entry)


def _scan(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """Split ``step-*`` entries into complete ones (sorted) and damaged ones: marked but not
    matching their marker, or symbolic links (never followed out of the root)."""
    complete: list[tuple[int, Path]] = []
    damaged: list[tuple[Path, str]] = []
    if not root.is_dir():
        return complete, damaged
    for entry in root.iterdir():
        step = checkpoint_step(entry.name)
        if step is None:
            continue
        if entry.is_symlink():
            link = f"is a symbolic link (to {os.readlink(entry)}), and leantune does not follow "
            damaged.append((entry, link + "links out of its checkpoint directory: copy it in"))
            continue
        if not entry.is_dir():
            continue
        problem = checkpoint_problem(entry)
        if problem is None:
            complete.append((step, entry))
        elif (entry / MARKER).exists():
            damaged.append((entry, problem))
    complete.sort(key=lambda item: item[0])  # by step number: iterdir order is arbitrary
    return complete, damaged


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, phrased to follow "it", or None."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    marker = path / MARKER
    if not marker.is_file():
        return f"has no {MARKER} marker (its save was interrupted or is still running)"
    try:
        manifest = json.loads(marker.read_text())
        files, version = manifest["files"], manifest.get("format_version", 1)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"has an unreadable {MARKER} marker ({exc!r})"
    if not isinstance(files, dict):
        return f"has a {MARKER} marker without a file manifest"
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return (
            f"has checkpoint format {version!r}, newer than this leantune reads "
            f"({FORMAT_VERSION}): upgrade leantune to resume from it"
        )
    # Sizes only here (cheap: catches truncation); checksums wait for load_checkpoint.
    for name in manifest_names(manifest):
        file = path / name
        if not file.is_file():
            return f"is missing {name}"
        size, expected = file.stat().st_size, verify.entry_size(files.get(name))
        if size != expected:
            return f"has {name} of {size} bytes where {MARKER} records {expected}"
    return None


def _recover_moved_aside(root: Path) -> None:
    """Undo a re-save killed between moving the old checkpoint aside and renaming the new in."""
    for entry in sorted(root.iterdir()):
        match = OLD_RE.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        final = root / match.group(1)
        # Put back only when the new one never arrived whole; otherwise the aside copy is the
        # replaced one, which the finished save meant to delete.
        if checkpoint_problem(final) is not None and checkpoint_problem(entry) is None:
            logger.warning("restoring %s from %s after an interrupted save", final, entry.name)
            if final.exists() or final.is_symlink():
                remove_tree(final)
            os.replace(entry, final)
            fsync_dir(root)
        else:
            remove_tree(entry)


def _read_state_json(path: Path, step_of_directory: int | None) -> TrainingState:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a valid training state: {exc}") from exc
    try:
        verify.validate_state(raw, step_of_directory)
    except verify.StateValueError as exc:
        raise CheckpointError(
            f"{path}: {exc}. The file was edited or damaged: fix the value, or remove this "
            "checkpoint to resume from an older one."
        ) from exc
    return TrainingState(
        step=raw["step"], micro_batches_seen=raw["micro_batches_seen"], extra=raw["extra"]
    )


def _load_weights(path: Path, map_location: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device=map_location) as f:
            metadata = dict(f.metadata() or {})
            weights = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:
        raise CheckpointError(f"{path} could not be read as safetensors: {exc}") from exc
    return weights, metadata


def torch_load(path: Path, map_location: str, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:
        # Not chained: torch's message advises weights_only=False, which would run the file.
        raise CheckpointError(verify.refused_pickle_message(path, exc)) from None
