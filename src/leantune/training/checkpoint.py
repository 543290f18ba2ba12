"""Crash-safe training checkpoints: weights in safetensors, everything else loaded weights-only.

Layout of one checkpoint, ``root/step-000012/``:

- ``model.safetensors``: trainable weights; the caller's ``metadata`` lives in its header.
- ``optimizer.pt``: ``optimizer.state_dict()``.
- ``trainer_state.pt``: scheduler, grad-scaler and RNG states.
- ``trainer_state.json``: :class:`TrainingState`, human-readable.
- ``COMPLETE``: written last; a JSON manifest of the files above and their sizes.

Why a SIGKILL at any moment is harmless: everything is written and fsynced inside a temporary
sibling ``root/.tmp-step-000012-<pid>``, which becomes ``step-000012`` with one rename, so a
``step-*`` directory is either absent or whole. Re-saving an existing complete step moves the old
one aside to ``.old-step-000012-<pid>`` first, and :func:`latest_checkpoint` puts it back if the
new one never arrived. Directories are deleted by first renaming them to ``.tmp-del-*``, so a
half-deleted checkpoint never keeps its ``step-*`` name. The marker's size manifest also catches
checkpoints truncated later, e.g. by a partial copy.

One process writes to a root at a time (rank 0 under data parallelism): :func:`latest_checkpoint`
deletes the temporary directories of any save that is in progress.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels in practice
    np = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "COMPLETE"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
STATE_JSON_FILE = "trainer_state.json"
_DATA_FILES = (WEIGHTS_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, STATE_JSON_FILE)

_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_STEP_RE = re.compile(r"^step-(\d+)$")
_OLD_RE = re.compile(r"^\.old-(step-\d+)-\d+$")


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupt or holds objects unsafe to unpickle."""


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
    """JSON-serialisable extras (epoch, tokens seen, best loss, ...)."""


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


# ---------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy (if importable), torch CPU and all CUDA generators.

    Returns:
        A dict of plain lists, numbers and CPU ``ByteTensor``s that ``torch.load`` can read back
        with ``weights_only=True``.
    """
    version, internal, gauss_next = random.getstate()
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        # The legacy tuple holds an ndarray, which weights-only unpickling refuses.
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generators captured by :func:`capture_rng_state`.

    Args:
        state: The dict from :func:`capture_rng_state` (possibly after a save/load round trip).

    Warns:
        When the state holds NumPy or CUDA generators that this process cannot restore, or a
        different number of CUDA devices.
    """
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        if np is None:
            warnings.warn(
                "the checkpoint holds a NumPy RNG state but numpy is not installed; "
                "install numpy to resume its random stream exactly",
                stacklevel=2,
            )
        else:
            npy = state["numpy"]
            np.random.set_state(
                (
                    npy["bit_generator"],
                    np.asarray(npy["keys"], dtype=np.uint32),
                    npy["pos"],
                    npy["has_gauss"],
                    npy["cached_gaussian"],
                )
            )
    if "cuda" in state:
        _restore_cuda_rng(state["cuda"])


def _restore_cuda_rng(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        warnings.warn(
            "the checkpoint holds CUDA RNG states but CUDA is not available; "
            "CUDA random streams will not continue where they stopped",
            stacklevel=3,
        )
        return
    count = torch.cuda.device_count()
    if count != len(states):
        warnings.warn(
            f"the checkpoint holds RNG states for {len(states)} CUDA devices but "
            f"{count} are visible; restoring the first {min(count, len(states))}",
            stacklevel=3,
        )
    for index, rng_state in enumerate(states[:count]):
        torch.cuda.set_rng_state(rng_state.cpu(), device=index)


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
        CheckpointError: When the optimizer, scheduler, scaler or RNG state could not be loaded
            back with ``torch.load(weights_only=True)``; nothing is left behind.
    """
    root = Path(root)
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if state.step < 0 or state.micro_batches_seen < 0:
        raise ValueError(f"step and micro_batches_seen must be >= 0, got {state}")
    header = _safetensors_metadata(metadata)
    state_json = _state_to_json(state)
    tensors = _prepare_weights(weights)

    root.mkdir(parents=True, exist_ok=True)
    name = _step_dir_name(state.step)
    tmp = root / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_payload(tmp, tensors, header, optimizer, scheduler, scaler, rng, state_json)
        sizes = {f: (tmp / f).stat().st_size for f in _DATA_FILES}
        _write_marker(tmp, {"format_version": FORMAT_VERSION, "step": state.step, "files": sizes})
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    _install(tmp, final)
    _rotate(root, keep_last, final)
    return final


def _write_payload(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    header: dict[str, str],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    scaler: dict[str, Any] | None,
    rng: dict[str, Any],
    state_json: str,
) -> None:
    weights_path = directory / WEIGHTS_FILE
    save_file(tensors, str(weights_path), metadata=header)
    _fsync_file(weights_path)
    trainer_state = {
        "format_version": FORMAT_VERSION,
        "scheduler": scheduler,
        "scaler": scaler,
        "rng": rng,
    }
    for file_name, obj in ((OPTIMIZER_FILE, optimizer), (TRAINER_STATE_FILE, trainer_state)):
        path = directory / file_name
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        # Refuse to mark complete what resume could not load; mmap skips reading tensor data.
        _torch_load(path, "cpu", mmap=True)
    _write_text_durable(directory / STATE_JSON_FILE, state_json)


def _write_marker(directory: Path, manifest: dict[str, Any]) -> None:
    _write_text_durable(directory / MARKER, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing what is there without a gap."""
    root = final.parent
    if final.exists() and _problem(final) is None:
        aside = root / f"{_OLD_PREFIX}{final.name}-{os.getpid()}"
        if aside.exists():
            shutil.rmtree(aside)
        _move_aside(final, aside)
        os.replace(tmp, final)
        _fsync_dir(root)
        _remove_tree(aside)
        return
    if final.exists() or final.is_symlink():
        _remove_tree(final)
    os.replace(tmp, final)
    _fsync_dir(root)


def _move_aside(src: Path, dst: Path) -> None:
    os.replace(src, dst)
    _fsync_dir(dst.parent)


def _rotate(root: Path, keep_last: int, just_written: Path) -> None:
    others = [p for p in list_complete_checkpoints(root) if p != just_written]
    for victim in others[: max(len(others) - (keep_last - 1), 0)]:
        logger.info("removing old checkpoint %s (keep_last=%d)", victim, keep_last)
        _remove_tree(victim)


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
    _recover_moved_aside(root)
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.startswith(_TMP_PREFIX):
            logger.info("removing leftover of an interrupted save or delete: %s", entry)
            shutil.rmtree(entry)
        elif _STEP_RE.match(entry.name) and not (entry / MARKER).exists():
            logger.warning("removing incomplete checkpoint %s (no %s marker)", entry, MARKER)
            _remove_tree(entry)
    complete, damaged = _scan(root)
    for path, problem in damaged:
        warnings.warn(f"skipping damaged checkpoint {path}: it {problem}", stacklevel=2)
    return complete[-1][1] if complete else None


def load_checkpoint(path: Path, map_location: str = "cpu") -> Checkpoint:
    """Load one complete checkpoint directory.

    Args:
        path: A ``step-*`` directory written by :func:`save_checkpoint`.
        map_location: Device for the weights and optimizer tensors; scheduler, scaler and RNG
            states always load on CPU.

    Returns:
        The checkpoint's contents.

    Raises:
        CheckpointError: When ``path`` is not a complete checkpoint (the message names the path
            and what is missing) or a file holds objects other than tensors and plain data.
    """
    path = Path(path)
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it {problem}. "
            "Use latest_checkpoint(root) to find the newest complete one."
        )
    state = _read_state_json(path / STATE_JSON_FILE)
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
    )


def _scan(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """Split ``step-*`` directories into complete ones (sorted) and damaged marked ones."""
    complete: list[tuple[int, Path]] = []
    damaged: list[tuple[Path, str]] = []
    if not root.is_dir():
        return complete, damaged
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        problem = _problem(entry)
        if problem is None:
            complete.append((int(match.group(1)), entry))
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
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has an unreadable {MARKER} marker ({exc!r})"
    if not isinstance(files, dict):
        return f"has a {MARKER} marker without a file manifest"
    for name in _DATA_FILES:
        file = path / name
        if not file.is_file():
            return f"is missing {name}"
        size, expected = file.stat().st_size, files.get(name)
        if size != expected:
            return f"has {name} of {size} bytes where {MARKER} records {expected}"
    return None


def _recover_moved_aside(root: Path) -> None:
    """Undo a re-save killed between moving the old checkpoint aside and renaming the new in."""
    for entry in sorted(root.iterdir()):
        match = _OLD_RE.match(entry.name)
        if match is None or not entry.is_dir():
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


def _read_state_json(path: Path) -> TrainingState:
    try:
        raw = json.loads(path.read_text())
        state = TrainingState(
            step=raw["step"], micro_batches_seen=raw["micro_batches_seen"], extra=raw["extra"]
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid training state: {exc!r}") from exc
    if not isinstance(state.step, int) or not isinstance(state.micro_batches_seen, int):
        raise CheckpointError(f"{path}: step and micro_batches_seen must be integers")
    if not isinstance(state.extra, dict):
        raise CheckpointError(f"{path}: extra must be a JSON object")
    return state


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
        raise CheckpointError(
            f"{path} could not be loaded with torch.load(weights_only=True); checkpoints may hold "
            f"only tensors and plain Python data: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Filesystem helpers


def _step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _write_text_durable(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    if trash.is_symlink() or not trash.is_dir():
        trash.unlink()
    else:
        shutil.rmtree(trash)
