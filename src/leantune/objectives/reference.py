"""The reference's per-sequence log-probs kept on disk beside the tokenised data, so that a
resumed run, or another run of the same model on the same data, reads them instead of running
the reference over every sequence again (full and freeze, `train.reference=cached`).

The file is keyed by everything that decides the numbers: the reference model's files (their
digest, as the run's fingerprint holds it), its dtype, attention and RoPE settings, the training
precision, the device, torch's version and the packed rows themselves (token ids, labels,
positions, segments: the data, its lengths and its packing). A file is used only when its key,
its rows' sequence counts and the checksum of its numbers all match; anything else is computed
again and written over it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from leantune.core.writes import write_file
from leantune.data.preference_packing import PreferenceRow

__all__ = ["REFERENCE_VERSION", "read_reference", "reference_key", "write_reference"]

REFERENCE_VERSION = 1
"""Bumped when what the file holds or how the reference is computed changes."""
_SUMS = "sums"


def rows_digest(rows: Sequence[PreferenceRow]) -> str:
    """sha256 of the packed rows as the reference reads them (ids, labels, positions and
    segment bounds): two runs share the file only when they feed the reference the same rows."""
    h = hashlib.sha256()
    for row in rows:
        bounds = [v for s in row.segments for v in (s.start, s.end)]
        for values in (row.input_ids, row.labels, row.position_ids, bounds):
            # The length first: without it, where one list ends and the next starts is lost.
            h.update(len(values).to_bytes(8, "little"))
            h.update(array("q", values).tobytes())
    return h.hexdigest()


def reference_key(
    model: Mapping[str, Any], settings: Mapping[str, Any], rows: Sequence[PreferenceRow]
) -> str:
    """The file's key.

    Args:
        model: What decides the reference model's outputs: its files' digest and the model.*
            settings (dtype, attention, RoPE scaling), as the run's fingerprint records them.
        settings: The rest that changes the numbers: precision, device, batch size, compile.
    """
    parts = {
        "version": REFERENCE_VERSION,
        "torch": torch.__version__,  # kernels change between releases, and with them the bits
        "model": dict(model),
        "settings": dict(settings),
        "rows": rows_digest(rows),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _checksum(flat: torch.Tensor) -> str:
    # Its bytes, whatever the dtype (numpy has no bfloat16).
    return hashlib.sha256(flat.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def write_reference(file: Path, key: str, sums: Sequence[torch.Tensor]) -> None:
    """Write the per-row sums (CPU tensors) with their key, counts and checksum, whole."""
    flat = torch.cat(list(sums)) if sums else torch.zeros(0)
    meta = {
        "key": key,
        "counts": json.dumps([len(s) for s in sums]),
        "sha256": _checksum(flat),
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    # write_file replaces the file whole: a crash mid-write leaves the old file or none.
    write_file(file, save_tensors({_SUMS: flat}, metadata=meta))


def read_reference(
    file: Path, key: str, rows: Sequence[PreferenceRow]
) -> tuple[torch.Tensor, ...] | None:
    """The per-row sums in `file`, or None when it is absent, damaged or not this run's: a
    different key, a row with another number of sequences, numbers that fail the checksum."""
    try:
        raw = file.read_bytes()
        # The metadata is read from the header the same way safetensors does; `load` checks
        # the rest of the layout (sizes, offsets) and raises on a torn file.
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8 : 8 + header_len])["__metadata__"]
        flat = load_tensors(raw)[_SUMS]
        counts = json.loads(meta["counts"])
        if meta["key"] != key or meta["sha256"] != _checksum(flat):
            return None
        if counts != [len(r.segments) for r in rows] or sum(counts) != flat.numel():
            return None
    # Any damage is a miss, never an error: the reference is computed again.
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None
    return tuple(torch.split(flat, counts))
