"""Compressed JSONL: open gzip and zstd streams, and refuse a zstd file that is cut short."""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable
from pathlib import Path
from typing import IO

# Frame layout constants from the zstd format (RFC 8878, section 3.1.1).
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # magic of a skippable frame, low 4 bits free
_DICT_ID = (0, 1, 2, 4)  # dictionary id bytes, by the descriptor's low 2 bits
_CONTENT_SIZE = ((0, 1), (2, 2), (4, 4), (8, 8))  # by flag: (size when multi, single segment)


class ArchiveError(ValueError):
    """A compressed file that is damaged, truncated or not of its kind."""


def open_jsonl(path: Path, kind: str) -> IO[bytes]:
    """A binary stream of the decompressed lines of a `.jsonl`, `.jsonl.gz` or `.jsonl.zst`."""
    # gzip finds truncation and damage itself, while reading (EOFError, zlib.error).
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == "jsonl.zst":
        import zstandard  # optional dependency: only for .zst input

        # read_across_frames: files of several frames (`cat a.zst b.zst`, pzstd) would
        # otherwise stop after the first. The buffer makes line iteration cheap.
        raw = zstandard.ZstdDecompressor().stream_reader(
            path.open("rb"), closefd=True, read_across_frames=True
        )
        return io.BufferedReader(raw, buffer_size=1 << 20)
    return path.open("rb")


def decompression_errors(kind: str) -> tuple[type[BaseException], ...]:
    """What reading a stream of this kind raises when its data is damaged."""
    import zlib

    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
    if kind == "jsonl.zst":
        import zstandard

        errors = (*errors, zstandard.ZstdError)
    return errors


def check_zstd_frames(path: Path) -> None:
    """Walk the frames of a zstd file by their headers (no decompression).

    A zstd stream reader stops silently where a truncated file ends, so this runs before
    reading; the frame and block headers give every block's size.

    Raises:
        ArchiveError: not zstd data, a reserved block type, or a file that ends inside a frame.
    """
    size = path.stat().st_size
    with path.open("rb") as f:

        def read(at: int, n: int) -> bytes:
            f.seek(at)
            data = f.read(n)
            if len(data) < n:
                raise ArchiveError(f"truncated: the file ends inside a frame at byte {at}")
            return data

        pos = 0
        while pos < size:
            magic = int.from_bytes(read(pos, 4), "little")
            if magic & 0xFFFFFFF0 == _SKIPPABLE:
                # Skippable frames (metadata some tools write): magic, 4-byte size, payload.
                pos += 8 + int.from_bytes(read(pos + 4, 4), "little")
            elif magic != _ZSTD_MAGIC:
                raise ArchiveError(f"damaged: no zstd frame starts at byte {pos}")
            else:
                pos = _frame_end(read, pos)
            if pos > size:
                raise ArchiveError(
                    f"truncated: the file ends inside a frame ({size} of {pos} bytes)"
                )


def _frame_end(read: Callable[[int, int], bytes], pos: int) -> int:
    """Where the zstd frame starting at `pos` ends, from its header and block headers."""
    descriptor = read(pos + 4, 1)[0]
    single = (descriptor >> 5) & 1
    # Descriptor byte, a window byte unless single-segment, then the dictionary id and the
    # content size, whose widths the descriptor's flags give.
    header = 1 + (0 if single else 1) + _DICT_ID[descriptor & 3]
    header += _CONTENT_SIZE[descriptor >> 6][single]
    pos += 4 + header
    while True:
        # A 3-byte block header: bit 0 last-block flag, bits 1-2 type, the rest the size.
        block = int.from_bytes(read(pos, 3), "little")
        kind, length = (block >> 1) & 3, block >> 3
        if kind == 3:
            raise ArchiveError(f"damaged: a reserved block type at byte {pos}")
        pos += 3 + (1 if kind == 1 else length)  # an RLE block stores its byte once
        if block & 1:  # the last block of the frame
            return pos + (4 if (descriptor >> 2) & 1 else 0)  # + the content checksum
