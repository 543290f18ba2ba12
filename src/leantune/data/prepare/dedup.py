"""Exact (content hash) and near-duplicate (MinHash + LSH) removal; the first occurrence wins.

A small own implementation rather than `datasketch`: vectorised numpy signatures, and an index
that stores only what dedup needs (per kept record one 8-byte hash, one signature and one key
per LSH band).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

DEDUP_MODES = ("none", "exact", "near")
# Byte n-grams, not word n-grams: CJK text, which has no spaces, shingles as well as English.
SHINGLE_BYTES = 7
_SLICE = 8192  # shingles per block, so a huge record never makes a huge temporary matrix

# Seeded constants: the same hash functions on every worker and every run, which identical
# local and Dask output (and a stable cache) needs.
_rng = np.random.default_rng(20240531)
_A = _rng.integers(1, 2**63, size=256, dtype=np.uint64) | np.uint64(1)  # odd multipliers
_B = _rng.integers(0, 2**63, size=256, dtype=np.uint64)
_FOLD = _rng.integers(1, 2**63, size=256, dtype=np.uint64) | np.uint64(1)


def content_hash(parsed: dict[str, Any]) -> int:
    """64-bit hash of a cleaned record's canonical JSON (exact-duplicate key)."""
    # sort_keys and fixed separators: equal records give equal bytes whatever their key order.
    # 64 bits keep the index small; a chance collision (which would drop a record as a
    # duplicate) stays improbable up to hundreds of millions of records.
    blob = json.dumps(parsed, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(blob.encode(), digest_size=8).digest(), "little")


def record_text(parsed: dict[str, Any]) -> str:
    """The text MinHash compares: every message content and tool call (or the text), case and
    spacing folded."""
    if "text" in parsed:
        raw = parsed["text"]
    else:
        raw = "\n".join(_message_text(m) for m in parsed["messages"])
    return " ".join(str(raw).lower().split())


def _message_text(msg: dict[str, Any]) -> str:
    # A tool call is part of what the model learns to write: two records that differ only in a
    # call's arguments are not the same example.
    calls = msg.get("tool_calls")
    if not calls:
        return str(msg["content"])
    return " ".join([msg["content"], *(json.dumps(c["function"], sort_keys=True) for c in calls)])


def shingles(text: str) -> np.ndarray:
    """Distinct byte 7-grams of the UTF-8 text, packed into uint64."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    # A text shorter than one shingle is zero-padded into exactly one.
    if data.size < SHINGLE_BYTES:
        data = np.pad(data, (0, SHINGLE_BYTES - data.size))
    windows = np.lib.stride_tricks.sliding_window_view(data, SHINGLE_BYTES).astype(np.uint64)
    # 7 bytes fit one uint64 losslessly: each shingle is its own integer, no hashing needed.
    shifts = np.arange(SHINGLE_BYTES, dtype=np.uint64) * np.uint64(8)
    return np.unique(np.bitwise_or.reduce(windows << shifts, axis=1))


def minhash(text: str, num_perm: int) -> np.ndarray:
    """MinHash signature (uint32, `num_perm` values) with multiply-shift hashing."""
    x = shingles(text)
    a, b = _A[:num_perm], _B[:num_perm]
    out = np.full(num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
    for start in range(0, x.size, _SLICE):
        block = x[start : start + _SLICE, None]
        # Multiply-shift: uint64 arithmetic wraps mod 2**64, and the high 32 bits are the
        # well-mixed ones.
        np.minimum(out, ((block * a + b) >> np.uint64(32)).min(axis=0), out=out)
    return out.astype(np.uint32)


@functools.cache  # ~14 ms of numpy per call, and every preparation builds a DedupIndex
def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising weighted false positives and negatives around `threshold`.

    Candidates are verified against the signature, so a false positive costs one comparison
    while a false negative keeps a duplicate: misses weigh 9 times more.
    """
    # The LSH S-curve 1 - (1 - s**rows)**bands, integrated on a grid over similarity s.
    s = np.linspace(0.0, 1.0, 201)
    best: tuple[float, int, int] | None = None
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            p = 1.0 - (1.0 - s**rows) ** bands
            fp = float(np.trapezoid(np.where(s < threshold, p, 0.0), s))
            fn = float(np.trapezoid(np.where(s >= threshold, 1.0 - p, 0.0), s))
            cost = 0.1 * fp + 0.9 * fn
            if best is None or cost < best[0]:
                best = (cost, bands, rows)
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class Verdict:
    """Why a record is dropped: the kept record it duplicates, and the estimated similarity."""

    kind: str  # "exact_duplicate" | "near_duplicate"
    of: int  # id of the kept record
    similarity: float


class DedupIndex:
    """Sequential first-wins dedup over records fed in input order."""

    def __init__(self, mode: str, threshold: float = 0.85, num_perm: int = 64) -> None:
        if mode not in DEDUP_MODES:
            raise ValueError(f"dedup mode {mode!r} is not one of {' | '.join(DEDUP_MODES)}")
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.mode = mode
        self.threshold = threshold
        self.num_perm = num_perm
        self.bands, self.rows = lsh_bands(threshold, num_perm)
        self._exact: dict[int, int] = {}
        self._buckets: list[dict[int, int]] = [{} for _ in range(self.bands)]
        self._sigs: list[np.ndarray] = []
        self._sig_ids: dict[int, int] = {}

    def _band_keys(self, sig: np.ndarray) -> list[int]:
        # Each band's rows are folded into one integer key with odd multipliers: equal bands
        # give equal keys, and a bucket is a dict lookup, not a tuple comparison.
        used = sig[: self.bands * self.rows].reshape(self.bands, self.rows).astype(np.uint64)
        return [int(k) for k in (used * _FOLD[: self.rows]).sum(axis=1)]

    def check(self, rid: int, digest: int, sig: np.ndarray | None) -> Verdict | None:
        """Return a Verdict if record `rid` duplicates a kept record, else remember it as kept."""
        if self.mode == "none":
            return None
        first = self._exact.get(digest)
        if first is not None:
            return Verdict("exact_duplicate", first, 1.0)
        keys: list[int] = []
        if self.mode == "near":
            assert sig is not None
            keys = self._band_keys(sig)
            for band, key in enumerate(keys):
                other = self._buckets[band].get(key)
                if other is None:
                    continue
                # A shared band is only a candidate: the signatures' agreement estimates the
                # Jaccard similarity, and only that decides.
                similarity = float(np.mean(self._sigs[self._sig_ids[other]] == sig))
                if similarity >= self.threshold:
                    return Verdict("near_duplicate", other, similarity)
        self._exact[digest] = rid
        if self.mode == "near":
            assert sig is not None
            self._sig_ids[rid] = len(self._sigs)
            self._sigs.append(sig)
            # setdefault: a bucket keeps its first record, the one later duplicates are named
            # after.
            for band, key in enumerate(keys):
                self._buckets[band].setdefault(key, rid)
        return None
