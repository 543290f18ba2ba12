"""This process's memory as the kernel counts it: resident set size now and at its peak, and
the other fields of /proc/self/status. Torch-free, so the OOM guard, the step statistics and
the metrics rows read the same numbers from one place."""

from __future__ import annotations

import resource
import sys

_PAGE_SIZE = resource.getpagesize()


def peak_rss_bytes() -> int:
    """The process's peak resident set size since it started (getrusage's ru_maxrss)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # macOS reports bytes, Linux kibibytes.
    return int(rss if sys.platform == "darwin" else rss * 1024)


def current_rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; elsewhere its peak, the best known)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        return peak_rss_bytes()


def status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmHWM, RssAnon, ...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
