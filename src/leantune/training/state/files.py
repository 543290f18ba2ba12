"""Durable filesystem steps of checkpoint writing: fsync what was written, and delete so that an
interruption never leaves a directory under a checkpoint's name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from leantune.training.state import verify
from leantune.training.state.format import TMP_PREFIX


def write_text_durable(path: Path, text: str) -> str:
    """Write and fsync ``text``; returns the checksum of the bytes written."""
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()  # Python's buffer first, or fsync would miss what is still in it
        os.fsync(f.fileno())
    return verify.text_digest(data)


def fsync_file(path: Path) -> None:
    # For files a library wrote by path (safetensors): reopened just to flush them to disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A rename or a new file is durable only once its directory entry is: the directory is fsynced
# after each.
def fsync_dir(path: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Delete a directory so that an interruption leaves only a ``.tmp-del-*`` leftover."""
    # Renamed first, in one step: rmtree is many steps, and a killed one would leave a partial
    # tree under its ``step-*`` name. A ``.tmp-*`` leftover is swept by the next cleanup.
    trash = path.parent / f"{TMP_PREFIX}del-{path.name}-{os.getpid()}"
    clear(trash)
    os.replace(path, trash)
    clear(trash)


def clear(path: Path) -> None:
    """Delete ``path`` if it exists; a symbolic link is unlinked, its target never touched."""
    # Checked before is_dir, which follows links: rmtree must never run on a link's target.
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
