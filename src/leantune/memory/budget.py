"""How much memory a run may use: as configured, else what the device has free less a margin."""

from __future__ import annotations

import os

import torch

from leantune.config import ConfigError, parse_memory_size

# Not 1.0: the run shares the machine with the page cache, other processes and the
# allocator's own slack, and MemAvailable is an estimate.
SAFETY = 0.9
"""Share of the available memory a run may use when no budget is given (the rest is headroom)."""


def parse_size(text: str) -> int:
    """'24GiB', '24G', '512MiB', '1.5GB' or a plain byte count -> bytes (see
    `config.parse_memory_size`: bare letters and *iB are binary, *B is SI).

    Raises:
        ValueError: not a size.
    """
    try:
        return parse_memory_size(text)
    except ConfigError as e:
        raise ValueError(str(e)) from None


def available_memory(device: str) -> int:
    """Memory a run may use: free CUDA memory, or MemAvailable of the machine (Linux)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here to measure free memory; give a budget")
        # Free, not total: another process's (or this one's) allocations are not the run's.
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                # MemAvailable, not MemFree: page cache the kernel can drop counts as available.
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file's unit is kB (KiB)
    except OSError:
        pass
    # No /proc (not Linux): free pages, which undercounts what the page cache would give back.
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_budget(device: str) -> int:
    """The budget when none is configured: available memory less a safety margin."""
    return int(available_memory(device) * SAFETY)


def budget_for(configured: str | None, device: str, override: str | None = None) -> int:
    """`override`, else `configured` (train.memory_budget), else the default budget of
    `device`.

    Raises:
        ValueError: a size that is not one, or no CUDA device here to measure.
    """
    text = override or configured
    return parse_size(text) if text else default_budget(device)
