"""A run's small files (`config.yaml`, `leantune_run.json`, `summary.json`, ...), parsed once
per version and within limits.

Each file is parsed again only when its identity, size or modification time changed. A file
larger than `MAX_TEXT` is not read. What cannot be parsed is kept as an error, which the run's
row shows.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.config.parse import load_yaml
from leantune.monitor.dashboard.series import finite_json

MAX_TEXT = 1 << 20
"""Largest run file read (a run writes a few kB)."""


@dataclass(frozen=True)
class Parsed:
    """One file as last read: its text, its value, or why it has none."""

    text: str | None
    """The file's text (None: no such file, or too large to read)."""
    value: Any
    """The parsed value (None: no file, or it did not parse)."""
    error: str | None
    """Why a file that exists has no value, naming the file."""


ABSENT = Parsed(None, None, None)
Parse = Callable[[str, str], Any]
"""(text, file name) -> value, or ValueError whose message names the file."""


class ParsedFiles:
    """Parsed files by path, re-read only when `(device, inode, size, mtime)` changes."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int, int, int], Parsed]] = {}
        self._lock = threading.Lock()
        self.parses = 0
        """How many times a file was parsed (tests count the re-parses a poll costs)."""

    def read(self, path: Path | None, parse: Parse) -> Parsed:
        """`path` parsed by `parse` (`ABSENT` for None or a missing file)."""
        if path is None:
            return ABSENT
        # The run list is polled every two seconds for every run, and a run's files rarely
        # change: the parse is the cost worth caching.
        try:
            # fstat of the open file, not a stat before opening: the key then belongs to the
            # very bytes read, even when the file is replaced in between.
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                # Device and inode too: an atomic replace can keep the size and mtime.
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                with self._lock:
                    cached = self._entries.get(path)
                if cached is not None and cached[0] == key:
                    return cached[1]
                # One byte past the limit tells an oversized file without reading all of it.
                parsed = self._parse(f.read(MAX_TEXT + 1), path.name, parse)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            with self._lock:  # gone: forget it, so the cache holds only files that exist
                self._entries.pop(path, None)
            return ABSENT
        with self._lock:
            self._entries[path] = (key, parsed)
            self.parses += 1
        return parsed

    @staticmethod
    def _parse(data: bytes, name: str, parse: Parse) -> Parsed:
        if len(data) > MAX_TEXT:
            return Parsed(
                None, None, f"{name} is larger than {MAX_TEXT >> 20} MiB, too large to read"
            )
        text = data.decode("utf-8", errors="replace")
        try:
            return Parsed(text, parse(text, name), None)
        except ValueError as exc:
            return Parsed(text, None, str(exc))


def parse_config(text: str, name: str) -> dict[str, Any]:
    """A config.yaml as a mapping of sections, non-finite numbers as their names."""
    # The loader `train` uses, which refuses aliases that expand past a bound.
    data, _ = load_yaml(text, name)  # ParseError is a ValueError naming the file
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return dict(finite_json(data))  # the page's JSON has no NaN or Infinity
    except RecursionError:
        raise ValueError(f"{name}: nested too deeply") from None


def parse_json(text: str, name: str) -> Any:
    """A JSON file's value, non-finite numbers as their names."""
    try:
        return finite_json(json.loads(text))
    except RecursionError:
        raise ValueError(f"{name}: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{name}: not JSON ({exc})") from None
