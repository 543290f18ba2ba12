"""Crash-safe training checkpoints: weights in safetensors, everything else loaded weights-only.

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

Why a SIGKILL at any moment is harmless: everything is written and fsynced inside a temporary
sibling ``root/.tmp-step-000012-<pid>``, which becomes ``step-000012`` with one rename, so a
``step-*`` directory is either absent or whole. Re-saving an existing complete step moves the old
one aside to ``.old-step-000012-<pid>`` first, and :func:`latest_checkpoint` puts it back if the
new one never arrived. Directories are deleted by first renaming them to ``.tmp-del-*``, so a
half-deleted checkpoint never keeps its ``step-*`` name.

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
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from leantune.core.rng import capture_rng_state as capture_rng_state  # re-exported
from leantune.core.rng import restore_rng_state as restore_rng_state  # re-exported
from leantune.core.writes import OutputError
from leantune.errors import UserError
from leantune.layout import CHECKPOINT_MARKER as MARKER
from leantune.layout import CHECKPOINT_PREFIX, checkpoint_name, checkpoint_step
from leantune.training.guard.divergence import diverged
from leantune.training.state import verify

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: the marker records each file's size and SHA-256; 1: sizes only."""
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
STATE_JSON_FILE = "trainer_state.json"
_DATA_FILES = (WEIGHTS_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, STATE_JSON_FILE)
SHARDED_LAYOUT = "sharded"
SHARDED_DIR = "dcp"
"""The torch.distributed.checkpoint folder of a sharded checkpoint."""
_SHARDED_FILES = (TRAINER_STATE_FILE, STATE_JSON_FILE, f"{SHARDED_DIR}/.metadata")

_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_OLD_RE = re.compile(rf"^\.old-({CHECKPOINT_PREFIX}\d+)-\d+$")


Warn = Callable[[str], None]
"""Where non-fatal findings go (a damaged checkpoint skipped, an unverifiable old format)."""


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupt or holds objects unsafe to unpickle."""


class DamagedCheckpoints(CheckpointError, UserError):
    """Checkpoints exist but none can be resumed from; the message names each and why."""

    def __init__(self, root: Path, problems: list[str]) -> None:
        self.root = root
        self.problems = problems
        listed = "".join(f"\n  - {p}" for p in problems)
        super().__init__(
            f"no checkpoint in {root} can be resumed from:{listed}\n"
            "Training does not start over on its own, since that would overwrite them. Fix or "
            "remove the checkpoints named above, or start a new run with another run.dir or "
            "run.name, or start this run over with run.resume=never."
        )


class CheckpointWriteError(CheckpointError, OutputError):
    """The disk refused a save (full, read-only, I/O error); earlier checkpoints are intact."""


@dataclass
class TrainingState:
    """Where training stands; saved as ``trainer_state.json``.

    ``extra`` goes through JSON, so tuples come back as lists and non-string keys as strings.
    """

    step: int
    """Optimizer steps completed."""
    micro_batches_seen: int
    """Exact data position: micro-batches consumed so far."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras; the recipe keeps its run progress here
    (:meth:`leantune.training.state.progress.RunProgress.to_json`)."""


@dataclass
class Checkpoint:
    """Everything :func:`load_checkpoint` reads back from one checkpoint directory."""

    path: Path
    state: TrainingState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    """The safetensors header metadata (includes ``format: pt``)."""
    sharded: bool = False
    """A sharded checkpoint: `weights` and `optimizer` are empty, ``path/dcp`` holds them."""


# ---------------------------------------------------------------------------------------------
# Saving


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
    header = _safetensors_metadata(metadata)
    state_json = _state_to_json(state)
    tensors = _prepare_weights(weights)
    nonfinite = [k for k, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    if nonfinite:
        raise diverged(state.step, nonfinite, _newest_complete(root))

    name = checkpoint_name(state.step)
    final = root / name
    tmp = root / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clear(tmp)
        tmp.mkdir()
        files = _write_payload(tmp, tensors, header, optimizer, scheduler, scaler, rng, state_json)
        _write_marker(tmp, {"format_version": FORMAT_VERSION, "step": state.step, "files": files})
        _fsync_dir(tmp)
        _install(tmp, final)
    except BaseException as exc:
        try:
            _clear(tmp)
        except OSError as cleanup:
            logger.warning("could not remove %s after a failed save: %s", tmp, cleanup)
        if isinstance(exc, OSError):
            raise _write_error(root, final, exc) from exc
        raise
    _rotate(root, keep_last, final)
    return final


def _write_error(root: Path, final: Path, exc: OSError) -> CheckpointWriteError:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    code = errno.errorcode.get(exc.errno or 0, "")
    where = f" (at {exc.filename})" if exc.filename else ""
    newest = _newest_complete(root)
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


def _newest_complete(root: Path) -> Path | None:
    try:
        complete = list_complete_checkpoints(root)
    except OSError:
        return None
    return complete[-1] if complete else None


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
    _fsync_file(weights_path)
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
            _torch_load(path, "cpu", mmap=True)
        except CheckpointError as exc:
            raise CheckpointError(f"not saved, since resume could not load it: {exc}") from None
    digests[STATE_JSON_FILE] = _write_text_durable(directory / STATE_JSON_FILE, state_json)
    return {
        name: {"size": (directory / name).stat().st_size, verify.HASH: digests[name]}
        for name in _DATA_FILES
    }


def _write_marker(directory: Path, manifest: dict[str, Any]) -> None:
    _write_text_durable(directory / MARKER, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing what is there without a gap.

    A complete checkpoint (or a link) at ``final`` is moved aside first and put back if the
    rename fails, so a failing disk never costs the checkpoint that was there.
    """
    root = final.parent
    if final.is_symlink() or (final.exists() and _problem(final) is None):
        aside = root / f"{_OLD_PREFIX}{final.name}-{os.getpid()}"
        _clear(aside)
        _move_aside(final, aside)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(aside, final)
            raise
        _fsync_dir(root)
        try:
            _remove_tree(aside)
        except OSError as exc:  # the new checkpoint is in; latest_checkpoint tidies up later
            logger.warning("could not remove the replaced checkpoint %s: %s", aside, exc)
        return
    if final.exists():
        _remove_tree(final)
    os.replace(tmp, final)
    _fsync_dir(root)


def _move_aside(src: Path, dst: Path) -> None:
    os.replace(src, dst)
    _fsync_dir(dst.parent)


def _rotate(root: Path, keep_last: int, just_written: Path) -> None:
    """Delete the oldest checkpoints beyond ``keep_last``; a failure here only logs, since the
    new checkpoint is already complete."""
    try:
        others = [p for p in list_complete_checkpoints(root) if p != just_written]
        for victim in others[: max(len(others) - (keep_last - 1), 0)]:
            logger.info("removing old checkpoint %s (keep_last=%d)", victim, keep_last)
            _remove_tree(victim)
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
        if ptr in seen or ptr == 0 or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(ptr)
        out[key] = t
    return out


def _safetensors_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    header = {"format": "pt"}
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


# ---------------------------------------------------------------------------------------------
# Finding and loading


def list_complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, sorted by step (oldest first).

    Args:
        root: Directory holding the run's checkpoints; missing means none.

    Returns:
        Paths of ``step-*`` directories whose marker and files all check out.
    """
    return [path for _, path in _scan(Path(root))[0]]


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
    problems = [(_step_of(path), f"{path} cannot be used: it {why}") for path, why in damaged]
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


def _step_of(path: Path) -> int:
    step = checkpoint_step(path.name)
    return step if step is not None else -1


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
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it {problem}. "
            "Use resume_checkpoint(root) to load the newest one that checks out."
        )
    manifest = json.loads((path / MARKER).read_text())
    if manifest.get("format_version", 1) < 2:
        (warn or _warn)(
            f"{path} was written by an older leantune (checkpoint format 1, sizes only): its "
            "files cannot be verified against checksums"
        )
    else:
        names = _manifest_names(manifest)
        problem = verify.checksum_problem(path, manifest["files"], names)
        if problem is not None:
            raise CheckpointError(f"{path} is damaged: it {problem}")
    step = _step_of(path)
    state = _read_state_json(path / STATE_JSON_FILE, step if step >= 0 else None)
    sharded = manifest.get("layout") == SHARDED_LAYOUT
    weights: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    optimizer: dict[str, Any] = {}
    if not sharded:
        weights, metadata = _load_weights(path / WEIGHTS_FILE, map_location)
        optimizer = _torch_load(path / OPTIMIZER_FILE, map_location)
    trainer_state = _torch_load(path / TRAINER_STATE_FILE, "cpu")
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


def _manifest_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The files a marker vouches for: the fixed four, or every file of a sharded one."""
    if manifest.get("layout") == SHARDED_LAYOUT and isinstance(manifest.get("files"), dict):
        listed = {n for n in manifest["files"] if ".." not in Path(n).parts}  # stays inside
        return tuple(sorted(listed | set(_SHARDED_FILES)))
    return _DATA_FILES


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _clean(root: Path) -> None:
    """Undo interrupted saves and delete their leftovers; unlink (never follow) stray links."""
    _recover_moved_aside(root)
    for entry in sorted(root.iterdir()):
        if entry.is_symlink():
            if entry.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
                logger.warning("removing the symbolic link %s (its target is left alone)", entry)
                entry.unlink()
            continue
        if not entry.is_dir():
            continue
        if entry.name.startswith(_TMP_PREFIX):
            logger.info("removing leftover of an interrupted save or delete: %s", entry)
            shutil.rmtree(entry)
        elif checkpoint_step(entry.name) is not None and not (entry / MARKER).exists():
            logger.warning("removing incomplete checkpoint %s (no %s marker)", entry, MARKER)
            _remove_tree(entry)


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
        problem = _problem(entry)
        if problem is None:
            complete.append((step, entry))
        elif (entry / MARKER).exists():
            damaged.append((entry, problem))
    complete.sort(key=lambda item: item[0])
    return complete, damaged


def _problem(path: Path) -> str | None:
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
    for name in _manifest_names(manifest):
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
        match = _OLD_RE.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        final = root / match.group(1)
        if _problem(final) is not None and _problem(entry) is None:
            logger.warning("restoring %s from %s after an interrupted save", final, entry.name)
            if final.exists() or final.is_symlink():
                _remove_tree(final)
            os.replace(entry, final)
            _fsync_dir(root)
        else:
            _remove_tree(entry)


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


def _torch_load(path: Path, map_location: str, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:
        # Not chained: torch's message advises weights_only=False, which would run the file.
        raise CheckpointError(verify.refused_pickle_message(path, exc)) from None


# ---------------------------------------------------------------------------------------------
# Filesystem helpers


def _write_text_durable(path: Path, text: str) -> str:
    """Write and fsync ``text``; returns the checksum of the bytes written."""
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return verify.text_digest(data)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Delete a directory so that an interruption leaves only a ``.tmp-del-*`` leftover."""
    trash = path.parent / f"{_TMP_PREFIX}del-{path.name}-{os.getpid()}"
    _clear(trash)
    os.replace(path, trash)
    _clear(trash)


def _clear(path: Path) -> None:
    """Delete ``path`` if it exists; a symbolic link is unlinked, its target never touched."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
