"""The JSONL files of a run, read while the run appends to them.

A run appends one object per line to `metrics.jsonl`, `eval.jsonl` and `events.jsonl`, and on a
resume or rollback rewrites `metrics.jsonl`/`eval.jsonl` as a shorter prefix before appending
again. `JsonlCache` keeps each file's complete lines parsed once and on the next read parses
only what was appended; it starts over when the file was replaced or rewritten. A last line
without its newline is a write in progress: it is never cached, and it is skipped while it does
not parse (a torn line is not an error). A line that is not a JSON object is skipped.
Non-finite numbers are kept as the strings "NaN", "Infinity" and "-Infinity".
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NON_FINITE = ("NaN", "Infinity")  # "-Infinity" contains "Infinity"


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its name ("NaN", "Infinity", ...)."""
    # Python's json writes a non-finite float as NaN/Infinity, which a browser's JSON.parse
    # refuses: the whole row would be lost to the page for one value.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def parse_line(raw: bytes) -> tuple[str, int] | None:
    """One line -> (its JSON object as browser-safe text, its "step" or -1); None if it is not
    a JSON object."""
    try:
        text = raw.decode("utf-8").strip()
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    # A text search first: only the rare line that may hold one pays for a re-serialisation.
    if any(word in text for word in NON_FINITE):
        text = json.dumps(finite_json(obj))
    step = obj.get("step")
    # bool is an int, but `"step": true` is no step.
    return text, step if isinstance(step, int) and not isinstance(step, bool) else -1


def line_sig(text: str) -> str:
    """A short checksum of one row, which a client sends back to prove its copy is current."""
    return f"{zlib.crc32(text.encode()):08x}"


@dataclass
class _Entry:
    """What is known of one file: its identity and the complete lines read so far."""

    ident: tuple[int, int]
    offset: int = 0
    """Bytes consumed: the end of the last complete line."""
    last_line: bytes = b""
    """The raw bytes of the last complete line with its newline, re-read to notice a rewrite."""
    lines: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Rows:
    """A file's valid rows at one moment: JSON texts and their steps."""

    lines: list[str]
    steps: list[int]

    def after_step(self, step: int | None, sig: str | None) -> tuple[list[str], bool]:
        """The rows after `step`, for a client whose last row was `step` with checksum `sig`.

        Returns:
            (rows, reset): every row and reset=True when the client's last row is no longer in
            the file as it was (a resume or rollback rewrote it, or the run started over).
        """
        if step is None:
            return self.lines, False
        i = bisect.bisect_left(self.steps, step)
        # The step alone is not enough: after a rollback the same step number holds another
        # row, and only the checksum tells the client's copy from the file's.
        ok = i < len(self.steps) and self.steps[i] == step and line_sig(self.lines[i]) == sig
        if not ok:
            return self.lines, True
        return self.lines[i + 1 :], False


class JsonlCache:
    """Parsed lines of the JSONL files the dashboard reads, shared by its request threads."""

    def __init__(self) -> None:
        self._entries: dict[Path, _Entry] = {}
        self._lock = threading.Lock()

    def read(self, path: Path | None) -> Rows:
        """Every valid row of `path` now (none when it does not exist, or is None)."""
        if path is None:
            return Rows([], [])
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                # The request threads share the entries: an update is one critical section.
                with self._lock:
                    entry = self._update(path, f, (st.st_dev, st.st_ino), st.st_size)
                    return self._rows(entry, f)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            with self._lock:
                self._entries.pop(path, None)
            return Rows([], [])

    def _update(self, path: Path, f: Any, ident: tuple[int, int], size: int) -> _Entry:
        entry = self._entries.get(path)
        # A new inode is a replaced file (a resume rewrites metrics.jsonl atomically); same
        # inode but other bytes is an in-place rewrite: either way, start over.
        if entry is None or entry.ident != ident or not _unchanged(f, entry, size):
            entry = _Entry(ident)
            self._entries[path] = entry
        f.seek(entry.offset)
        # Up to the size fstat saw: what the run appends meanwhile waits for the next read.
        data = f.read(max(0, size - entry.offset))
        end = data.rfind(b"\n")
        if end < 0:  # no complete new line yet
            return entry
        for raw in data[:end].split(b"\n"):
            parsed = parse_line(raw) if raw.strip() else None
            if parsed is not None:
                entry.lines.append(parsed[0])
                entry.steps.append(parsed[1])
        # The last complete line is kept to check, next time, that the file still begins with
        # what was read (`_unchanged`).
        start = data.rfind(b"\n", 0, end) + 1
        entry.last_line = data[start : end + 1]
        entry.offset += end + 1
        return entry

    @staticmethod
    def _rows(entry: _Entry, f: Any) -> Rows:
        lines, steps = list(entry.lines), list(entry.steps)
        f.seek(entry.offset)
        tail = f.read(1 << 20)  # an unterminated last line: included once it parses
        if tail.strip() and b"\n" not in tail:
            parsed = parse_line(tail)
            if parsed is not None:
                lines.append(parsed[0])
                steps.append(parsed[1])
        return Rows(lines, steps)


def _unchanged(f: Any, entry: _Entry, size: int) -> bool:
    """Whether the bytes read so far are still the file's prefix (checked by the last line)."""
    if size < entry.offset:  # truncated: certainly rewritten
        return False
    # The last line read must still end where it did; comparing all bytes would cost a full read.
    n = len(entry.last_line)
    f.seek(entry.offset - n)
    return bool(f.read(n) == entry.last_line)
