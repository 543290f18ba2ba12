"""What makes a checkpoint trustworthy before resume uses it: checksums and checked values.

Checksums. ``COMPLETE`` records, per file, its size and its SHA-256. ``torch.save``'s output and
the small JSON files are hashed as they are written (:class:`HashingWriter`); the weights file is
read back in chunks right after it is written. Verification reads every file once more before it
is loaded.

Cost, measured for a checkpoint the size of the demo model's full fine-tune (SmolLM2-135M: 538 MB
of fp32 weights plus 1,076 MB of AdamW moments, 1.61 GB in all; random tensors) on a shared
2-core Xeon with SHA extensions, five runs: a save took 2.1-4.9 s without checksums and about
1.0 s more with them (0.2-1.4 s), and verifying all files before a load took 1.0-1.4 s. Peak
memory does not grow: nothing is copied to be hashed.

Values. ``trainer_state.json`` is plain JSON that a user can edit (and re-mark), so every value
that resume trusts is checked by :func:`validate_state` before it is used: step counters, and in
``extra`` (the run's progress, :class:`leantune.training.state.progress.RunProgress`) its layout
version, the data position in ``extra.batching``, the guard's history, the rollback bookkeeping
and the numbers the summary reports.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from leantune.layout import checkpoint_name
from leantune.training.state.progress import VERSION as PROGRESS_VERSION

# SHA-256: in the standard library, about 1.3 GB/s per core with the SHA extensions of current
# x86 and ARM CPUs (measured here), and checkable by hand with ``sha256sum``. A CRC or xxHash
# would catch random corruption as well, but a crafted file can match them, and the time they
# would save is small next to writing the files (the module docstring's cost).
HASH = "sha256"
"""The manifest key of each file's checksum (and the hashlib algorithm)."""


class HashingWriter:
    """A binary file wrapper that hashes every byte written through it.

    An OSError from the file is kept in ``error`` so that the caller can raise it.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._hash = hashlib.new(HASH)
        self.written = 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        """Write and hash ``data``; returns its length in bytes."""
        try:
            self._file.write(data)
        except OSError as exc:
            # torch.save reports a failed write only as a RuntimeError about the stream
            # position; the caller needs the OSError (ENOSPC, EROFS) to explain it.
            self.error = exc
            raise
        # hashlib takes the buffer as is: no copy of the (possibly huge) chunk is made.
        self._hash.update(data)
        # nbytes, not len: a memoryview's len counts items, which may be wider than a byte.
        size = memoryview(data).nbytes
        self.written += size
        return size

    def flush(self) -> None:
        """Flush the underlying file."""
        try:
            self._file.flush()
        except OSError as exc:
            self.error = exc
            raise

    def hexdigest(self) -> str:
        """The checksum of everything written so far."""
        return self._hash.hexdigest()


def file_digest(path: Path) -> str:
    """The checksum of a file, read in chunks."""
    # safetensors' save_file takes only a path, so its output is hashed here, from the page
    # cache in chunks: no second copy of the weights is held in memory.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()


def text_digest(data: bytes) -> str:
    """The checksum of bytes about to be written."""
    return hashlib.new(HASH, data).hexdigest()


def entry_size(entry: object) -> object:
    """The size a manifest entry records: format 1 stores the size, format 2 a dict."""
    return entry.get("size") if isinstance(entry, dict) else entry


def checksum_problem(path: Path, files: dict[str, Any], names: tuple[str, ...]) -> str | None:
    """Why the files in ``path`` do not match their recorded checksums (after "it"), or None.

    Args:
        path: A checkpoint directory whose sizes already match its manifest.
        files: The manifest's ``files`` (format 2: ``{"size": int, "sha256": str}`` each).
        names: The files to check.
    """
    for name in names:
        entry = files.get(name)
        expected = entry.get(HASH) if isinstance(entry, dict) else None
        if not isinstance(expected, str):
            return f"has no {HASH} for {name} in its marker"
        actual = file_digest(path / name)
        if actual != expected:
            return (
                f"has {name} with {HASH} {actual[:16]}... where the marker records "
                f"{expected[:16]}...: the file changed after it was written (a disk error, an "
                "incomplete copy or an edit)"
            )
    return None


def as_os_error(exc: Exception, path: Path) -> OSError | None:
    """The OSError behind a safetensors (Rust) I/O error, which carries only ``(os error N)``."""
    # The Rust error crosses into Python as text only; the errno inside it is what lets a full
    # disk be reported as one.
    match = re.search(r"\(os error (\d+)\)", str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def refused_pickle_message(path: Path, exc: Exception) -> str:
    """What a file that ``torch.load(weights_only=True)`` refused holds, for the user."""
    # torch's own message recommends weights_only=False, which would run the file's code; only
    # the offending global is taken from it, never that advice.
    text = str(exc)
    if "Weights only load failed" not in text and "WeightsUnpickler" not in text:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return f"{path} could not be read as a torch file: {first}"
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found is not None:
        what = f"a reference to the Python object {found.group(1)}"
    else:
        detail = re.search(r"WeightsUnpickler error: ([^\n.]+)", text)
        what = f"pickled data that is not plain ({detail.group(1).strip()})" if detail else ""
        what = what or "pickled data other than tensors and plain Python values"
    return (
        f"{path} holds {what}, not only tensors and plain data. leantune loads checkpoint files "
        "with torch.load(weights_only=True) and never unpickles arbitrary objects, because "
        "unpickling can run code"
    )


# ---------------------------------------------------------------------------------------------
# State values

Check = tuple[str, Callable[[object], bool]]


def _is_int(value: object) -> bool:
    # bool is an int subclass, and JSON true must not pass as step 1.
    return isinstance(value, int) and not isinstance(value, bool)


# Finite only: a NaN or inf LR scale or guard history would poison the run that resumes with it.
def _is_number(value: object) -> bool:
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer past float's range (JSON allows any number of digits)
        return False


_COUNT: Check = ("an integer >= 0", lambda v: _is_int(v) and v >= 0)  # type: ignore[operator]
_SIZE: Check = ("an integer >= 1", lambda v: _is_int(v) and v >= 1)  # type: ignore[operator]
_POSITIVE: Check = ("a finite number > 0", lambda v: _is_number(v) and v > 0)  # type: ignore[operator]
_DURATION: Check = ("a finite number >= 0", lambda v: _is_number(v) and v >= 0)  # type: ignore[operator]
_NUMBERS: Check = (
    "a list of finite numbers",
    lambda v: isinstance(v, list) and all(_is_number(x) for x in v),
)

_TOP: dict[str, Check] = {"step": _COUNT, "micro_batches_seen": _COUNT}
_BATCHING: dict[str, Check] = {
    "samples_seen": _COUNT,
    "global_batch": _SIZE,
    "micro_batch_size": _SIZE,
}
_GUARD: dict[str, Check] = {"losses": _NUMBERS, "grad_norms": _NUMBERS, "consecutive_skips": _COUNT}
_EXTRA: dict[str, Check] = {
    "version": (
        f"an integer from 1 to {PROGRESS_VERSION} (a higher one was written by a newer leantune: "
        "upgrade leantune to resume from it)",
        lambda v: _is_int(v) and 1 <= v <= PROGRESS_VERSION,  # type: ignore[operator]
    ),
    "lr_scale": _POSITIVE,
    "rollbacks": _COUNT,
    "train_time_s": _DURATION,
    "last_loss": ("a finite number or null", lambda v: v is None or _is_number(v)),
    "base_exact_match": (
        "a number from 0 to 1 or null",
        lambda v: v is None or (_is_number(v) and 0 <= v <= 1),  # type: ignore[operator]
    ),
}


class StateValueError(ValueError):
    """One value of ``trainer_state.json`` that resume cannot trust."""


def _refuse(name: str, value: object, wanted: str) -> StateValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."  # an edited list may be huge
    return StateValueError(f"{name} is {shown}, but must be {wanted}")


def _check(node: dict[str, Any], checks: dict[str, Check], prefix: str, required: bool) -> None:
    for key, (wanted, ok) in checks.items():
        if key not in node:
            if required:
                raise StateValueError(f"{prefix}{key} is missing")
            continue
        if not ok(node[key]):
            raise _refuse(f"{prefix}{key}", node[key], wanted)


def validate_state(raw: object, step_of_directory: int | None) -> None:
    """Check every value of a parsed ``trainer_state.json`` that resume relies on.

    Args:
        raw: The parsed JSON.
        step_of_directory: The step in the directory's name (``step-000012``: 12), when known.

    Raises:
        StateValueError: Naming the field (dotted, e.g. ``extra.batching.samples_seen``), its
            value and what it must be.
    """
    if not isinstance(raw, dict):
        raise _refuse("the top level", raw, "a JSON object")
    _check(raw, _TOP, "", required=True)
    if step_of_directory is not None and raw["step"] != step_of_directory:
        raise StateValueError(
            f"step is {raw['step']}, but it lies in the directory of step {step_of_directory} "
            f"({checkpoint_name(step_of_directory)})"
        )
    extra = raw.get("extra")
    if not isinstance(extra, dict):
        raise _refuse("extra", extra, "a JSON object")
    # Not required: a version-1 progress left out whatever it had not learned yet.
    _check(extra, _EXTRA, "extra.", required=False)
    batching = extra.get("batching")
    if batching is not None:
        if not isinstance(batching, dict):
            raise _refuse("extra.batching", batching, "a JSON object")
        _check(batching, _BATCHING, "extra.batching.", required=True)
        # The trainer splits a global batch into micro-batches; a larger one cannot be split.
        if batching["micro_batch_size"] > batching["global_batch"]:
            raise _refuse(
                "extra.batching.micro_batch_size",
                batching["micro_batch_size"],
                f"at most extra.batching.global_batch ({batching['global_batch']})",
            )
    guard = extra.get("guard")
    if guard is not None:
        if not isinstance(guard, dict):
            raise _refuse("extra.guard", guard, "a JSON object")
        _check(guard, _GUARD, "extra.guard.", required=False)
