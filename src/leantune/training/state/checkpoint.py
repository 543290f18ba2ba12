"""Crash-safe training checkpoints: weights in safetensors, everything else loaded weights-only.

Writing is here (`save_checkpoint`); the format's names and types are in
:mod:`leantune.training.state.format`, finding, verifying and loading in
:mod:`leantune.training.state.reading` (both re-exported here).

Layout of one checkpoint, ``root/step-000012/``:

- ``model.safetensors``: trainable weights; the caller's ``metadata`` lives in its header.
- ``optimizer.pt``: ``optimizer.state_dict()``.
- ``trainer_state.pt``: scheduler, grad-scaler and RNG states.
- ``trainer_state.json``: :class:`TrainingState`, human-readable.
- ``COMPLETE``: written last; a JSON manifest of the files above, each with its size and SHA-256
  (format 2; format 1 recorded sizes only and still loads, with a warning that it cannot be
  verified).

A sharded checkpoint (``dist.strategy=fsdp2``, :mod:`leantune.training.parallel.sharded`)
holds ``dcp/`` (a ``torch.distributed.checkpoint`` folder: every rank's shard of the trainable
weights and optimizer state) instead of ``model.safetensors`` and ``optimizer.pt``; its marker
says ``"layout": "sharded"`` and lists every file, shards included, with size and SHA-256.

A SIGKILL at any moment is harmless: a ``step-*`` directory is either absent or whole (the
comments in `save_checkpoint`, `_install` and `files.remove_tree` say how).

Why a checkpoint is trusted: listing (:func:`list_complete_checkpoints`, :func:`latest_checkpoint`)
compares sizes with the marker, which catches truncation; :func:`load_checkpoint`, and so
:func:`resume_checkpoint`, also verifies every file's checksum and every value of the training
state before anything is used (:mod:`leantune.training.state.verify`, which states the cost).
Weights with NaN or inf are never saved. A disk that fails mid-save (full, read-only) leaves the
earlier checkpoints as they were. Symbolic links in the root are never followed: a linked
``step-*`` is not used, and deleting a link removes the link, never its target.

One process writes to a root at a time (rank 0 under data parallelism): :func:`latest_checkpoint`
deletes the temporary directories of any save that is in progress.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import IO, Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from leantune.core.rng import capture_rng_state as capture_rng_state  # re-exported
from leantune.core.rng import restore_rng_state as restore_rng_state  # re-exported
from leantune.layout import checkpoint_name
from leantune.training.guard.divergence import diverged
from leantune.training.state import verify
from leantune.training.state.files import (
    clear,
    fsync_dir,
    fsync_file,
    remove_tree,
    write_text_durable,
)
from leantune.training.state.format import (
    DATA_FILES,
    FORMAT_VERSION,
    MARKER,
    OLD_PREFIX,
    OPTIMIZER_FILE,
    SHARDED_DIR,
    SHARDED_LAYOUT,
    STATE_JSON_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpoints,
    TrainingState,
)
from leantune.training.state.reading import (
    checkpoint_problem,
    latest_checkpoint,
    list_complete_checkpoints,
    load_checkpoint,
    newest_checkpoint,
    newest_complete,
    resume_checkpoint,
    torch_load,
)

# The checkpoint API in one place: saving is here, the format and reading in their modules.
__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "OPTIMIZER_FILE",
    "SHARDED_DIR",
    "SHARDED_LAYOUT",
    "STATE_JSON_FILE",
    "TRAINER_STATE_FILE",
    "WEIGHTS_FILE",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriteError",
    "DamagedCheckpoints",
    "TrainingState",
    "capture_rng_state",
    "latest_checkpoint",
    "list_complete_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "restore_rng_state",
    "resume_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)


def save_checkpoint(
    root: Path,
    state: TrainingState,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    scaler: dict[str, Any] | None,
    rng: dict[str, Any],
    keep_last: int = 2,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write ``root/step-<step>/`` atomically, then keep only the newest ``keep_last`` checkpoints.

    Args:
        root: Directory holding all checkpoints of one run (created if missing).
        state: Step counters and JSON-serialisable extras.
        weights: Trainable weights; moved to CPU, made contiguous, shared storage cloned.
        optimizer: ``optimizer.state_dict()``.
        scheduler: The LR scheduler's ``state_dict()``.
        scaler: ``GradScaler.state_dict()``, or None without loss scaling.
        rng: From :func:`capture_rng_state`.
        keep_last: How many complete checkpoints to keep, counting this one, which is never
            deleted; the others kept are those with the highest steps.
        metadata: String pairs stored in the safetensors header.

    Returns:
        The final checkpoint directory.

    Raises:
        ValueError: On a negative step, ``keep_last < 1`` or non-string metadata, before writing.
        TypeError: When ``state.extra`` is not JSON-serialisable or a weight is not a tensor.
        WeightsDiverged: When a floating-point weight holds NaN or inf, before writing.
        CheckpointError: When the optimizer, scheduler, scaler or RNG state could not be loaded
            back with ``torch.load(weights_only=True)``; nothing is left behind.
        CheckpointWriteError: When the filesystem refused the write (no space, read-only, I/O
            error); nothing is left behind and the earlier checkpoints are untouched.
    """
    root = Path(root)
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if state.step < 0 or state.micro_batches_seen < 0:
        raise ValueError(f"step and micro_batches_seen must be >= 0, got {state}")
    # Every input is checked before the first byte is written, so a bad call leaves no trace.
    header = _safetensors_metadata(metadata)
    state_json = _state_to_json(state)
    tensors = _prepare_weights(weights)
    # A NaN/inf checkpoint would be a resume point that can only continue the divergence.
    nonfinite = [k for k, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    if nonfinite:
        raise diverged(state.step, nonfinite, newest_complete(root))

    name = checkpoint_name(state.step)
    final = root / name
    # Everything is written and fsynced in a temporary sibling that becomes `final` with one
    # rename: a SIGKILL at any moment leaves no half-written ``step-*``. A sibling, so the
    # rename stays on one filesystem; the pid keeps two processes' leftovers apart.
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        clear(tmp)  # an earlier save's leftover under the same pid (failed, or pid reused)
        tmp.mkdir()
        files = _write_payload(tmp, tensors, header, optimizer, scheduler, scaler, rng, state_json)
        # The marker goes last: its presence vouches for the files above it.
        _write_marker(tmp, {"format_version": FORMAT_VERSION, "step": state.step, "files": files})
        # The directory entries must be on disk before the rename makes them a checkpoint.
        fsync_dir(tmp)
        _install(tmp, final)
    except BaseException as exc:  # Ctrl-C mid-save too: no partial temporary is left behind
        try:
            clear(tmp)
        except OSError as cleanup:
            logger.warning("could not remove %s after a failed save: %s", tmp, cleanup)
        if isinstance(exc, OSError):
            raise _write_error(root, final, exc) from exc
        raise
    # Only once the new checkpoint is installed: a failed save must never cost an old one.
    _rotate(root, keep_last, final)
    return final


def _write_error(root: Path, final: Path, exc: OSError) -> CheckpointWriteError:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    # The symbolic name too (ENOSPC, EROFS): what a user would search for.
    code = errno.errorcode.get(exc.errno or 0, "")
    where = f" (at {exc.filename})" if exc.filename else ""
    newest = newest_complete(root)
    kept = (
        f"the newest complete checkpoint, {newest}, is untouched, and the same command resumes "
        "from it"
        if newest is not None
        else "there is no earlier checkpoint to resume from"
    )
    return CheckpointWriteError(
        f"could not write checkpoint {final.name} in {root}: {reason}"
        f"{f' [{code}]' if code else ''}{where}. Nothing of this save was kept; {kept}. Free "
        f"space on that filesystem or make {root} writable, then run the same command again."
    )


def _write_payload(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    header: dict[str, str],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    scaler: dict[str, Any] | None,
    rng: dict[str, Any],
    state_json: str,
) -> dict[str, dict[str, Any]]:
    """Write the data files; returns the marker's manifest (size and checksum of each)."""
    digests: dict[str, str] = {}
    weights_path = directory / WEIGHTS_FILE
    try:
        save_file(tensors, str(weights_path), metadata=header)
    except SafetensorError as exc:
        os_error = verify.as_os_error(exc, weights_path)
        if os_error is None:
            raise
        raise os_error from exc
    fsync_file(weights_path)
    # save_file takes only a path: hash the file just written, from the page cache, in chunks.
    digests[WEIGHTS_FILE] = verify.file_digest(weights_path)
    trainer_state = {
        "format_version": FORMAT_VERSION,
        "scheduler": scheduler,
        "scaler": scaler,
        "rng": rng,
    }
    for file_name, obj in ((OPTIMIZER_FILE, optimizer), (TRAINER_STATE_FILE, trainer_state)):
        path = directory / file_name
        with open(path, "wb") as f:
            # Hashed while torch.save streams it: the optimizer state can be larger than the
            # weights, and reading it back only to hash it would be a second pass.
            writer = verify.HashingWriter(f)
            try:
                torch.save(obj, cast(IO[bytes], writer))  # it needs only write and flush
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        digests[file_name] = writer.hexdigest()
        # Refuse to mark complete what resume could not load; mmap skips reading tensor data.
        try:
            torch_load(path, "cpu", mmap=True)
        except CheckpointError as exc:
            raise CheckpointError(f"not saved, since resume could not load it: {exc}") from None
    digests[STATE_JSON_FILE] = write_text_durable(directory / STATE_JSON_FILE, state_json)
    return {
        name: {"size": (directory / name).stat().st_size, verify.HASH: digests[name]}
        for name in DATA_FILES
    }


def _write_marker(directory: Path, manifest: dict[str, Any]) -> None:
    write_text_durable(directory / MARKER, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing what is there without a gap.

    A complete checkpoint (or a link) at ``final`` is moved aside first and put back if the
    rename fails.
    """
    root = final.parent
    if final.is_symlink() or (final.exists() and checkpoint_problem(final) is None):
        # os.replace cannot replace a non-empty directory, and deleting first would leave a gap
        # with no checkpoint of this step: a failing disk must never cost the one that was
        # there. latest_checkpoint puts an ``.old-*`` back if the new one never arrived.
        aside = root / f"{OLD_PREFIX}{final.name}-{os.getpid()}"
        clear(aside)
        _move_aside(final, aside)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(aside, final)
            raise
        fsync_dir(root)
        try:
            remove_tree(aside)
        except OSError as exc:  # the new checkpoint is in; latest_checkpoint tidies up later
            logger.warning("could not remove the replaced checkpoint %s: %s", aside, exc)
        return
    if final.exists():  # an incomplete leftover: nothing in it is worth keeping
        remove_tree(final)
    os.replace(tmp, final)
    fsync_dir(root)


def _move_aside(src: Path, dst: Path) -> None:
    os.replace(src, dst)
    fsync_dir(dst.parent)


def _rotate(root: Path, keep_last: int, just_written: Path) -> None:
    """Delete the oldest checkpoints beyond ``keep_last``; a failure here only logs, since the
    new checkpoint is already complete."""
    try:
        others = [p for p in list_complete_checkpoints(root) if p != just_written]
        # Oldest first: the list is in step order, and the new one counts towards keep_last.
        for victim in others[: max(len(others) - (keep_last - 1), 0)]:
            logger.info("removing old checkpoint %s (keep_last=%d)", victim, keep_last)
            remove_tree(victim)
    except OSError as exc:
        logger.warning("could not remove old checkpoints in %s: %s", root, exc)


def _prepare_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two tensors sharing storage (safetensors refuses tied tensors)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights[{key!r}] is a {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        ptr = t.untyped_storage().data_ptr()
        # safetensors refuses tensors that share storage (tied weights) and non-contiguous views.
        if ptr in seen or ptr == 0 or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(ptr)
        out[key] = t
    return out


def _safetensors_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    header = {"format": "pt"}  # what transformers' safetensors loader expects of a torch file
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(
                f"metadata must map str to str (safetensors header); got {key!r}: {value!r}"
            )
        header[key] = value
    return header


def _state_to_json(state: TrainingState) -> str:
    try:
        return json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": int(state.step),
                "micro_batches_seen": int(state.micro_batches_seen),
                "extra": state.extra,
            },
            indent=2,
            sort_keys=True,
        )
    except TypeError as exc:
        raise TypeError(f"TrainingState.extra must be JSON-serialisable: {exc}") from exc
