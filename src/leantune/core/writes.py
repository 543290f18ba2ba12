"""Every file leantune writes goes through here: a regular file it owns, replaced whole.

- :func:`write_file` (bytes or text) and :func:`replacing` (for a writer that needs a path or a
  stream: a C++ or Rust writer, a file built line by line) write to a temporary file beside the
  target (``.<name>.tmp-<pid>``), fsync it and rename it over the target: the target holds its
  old content or the new, never a part, and a write that fails leaves it as it was.
- :func:`replacing_dir` does the same for a folder (an export, a prepared data set, ``final/``):
  built under a temporary name, swapped in whole.
- :func:`append_text` appends to a log (``metrics.jsonl``, ``events.jsonl``); a failed append is
  cut back, so the log never ends in a torn line of its own making.

Two rules hold for every one of them:

- An existing target that is not a regular file (a folder for :func:`replacing_dir`) is refused
  before anything is written: a symbolic link is never followed (its target would be truncated,
  or replaced by a rename), and a FIFO or device node (``--out /dev/full``) is never replaced.
  :class:`NotARegularFile`, exit 2, naming the path.
- A filesystem that refuses the write (full, over quota, read-only, ...) is
  :class:`WriteRefused`, exit 2, naming the path and the fix, wherever the error came from:
  Python's ``OSError``, torch's ``RuntimeError`` around it, or safetensors' Rust error text.
  A permission or I/O error counts only when it names the file being written (reading an input
  can meet those too, and is not this module's to explain).

A writer that does not go through here (a library's own: transformers' `save_pretrained`)
meets the same rule at the CLI's top-level handler, :func:`library_write_refused`: a full,
over-quota or read-only disk behind any exception is exit 2, not an internal error.

Checkpoints keep their own protocol (`leantune.training.state.checkpoint`: a marker, checksums, the
old one put back), with the same two rules; their refusal is `CheckpointWriteError`, an
:class:`OutputError` too.

C++ writers that abort the process when the disk fills (``torch.jit.save`` to a path ends in
``std::terminate``, exit 134) are given bytes to write instead (:func:`write_file`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from leantune.errors import UserError

FIXES: dict[int, str] = {
    errno.ENOSPC: "free space on that filesystem, or write somewhere else",
    errno.EDQUOT: "free space within your disk quota (or have it raised), or write somewhere else",
    errno.EROFS: "the filesystem is read-only: remount it read-write, or write somewhere else",
    errno.EFBIG: "the file is larger than that filesystem allows: write somewhere else",
    errno.EIO: "the disk reported an I/O error: check it (dmesg), or write somewhere else",
    errno.EACCES: "make {folder} writable for this user, or write somewhere else",
    errno.EPERM: "make {folder} writable for this user, or write somewhere else",
}
"""The errors a filesystem answers a write with that are the user's to fix, and how."""
WRITE_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""Of those, the ones a read never meets: wherever they come from, a write was refused."""

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors (Rust) reports the OSError behind a failed write."""
_TEXT_ERRNO = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")
"""An errno in a process's printed error: Rust's ``(os error N)``, Python's ``[Errno N]``."""
_LINK_ERRORS = (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR)
"""What an open with O_NOFOLLOW | O_NONBLOCK answers on a link, a FIFO, a folder."""


class OutputError(UserError):
    """An output could not be written where it was asked to go (exit 2)."""


class WriteRefused(OutputError):
    """The filesystem refused a write (full, over quota, read-only, ...); what the target held
    before is intact."""

    def __init__(self, message: str, path: Path, code: int) -> None:
        super().__init__(message)
        self.path = path
        self.errno = code


class NotARegularFile(OutputError):
    """An output path is a symbolic link, FIFO, device, socket or (for a file) a folder."""


# ---------------------------------------------------------------------------------------------
# Writing


def write_file(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is UTF-8) atomically and durably.

    Raises:
        NotARegularFile: `path` exists and is not a regular file.
        WriteRefused: the filesystem refused the write; `path` is as it was.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    # "x": the temporary name was just cleared, so finding a file there means another writer.
    with replacing(path) as tmp, open(tmp, "xb") as f:
        f.write(raw)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an error, it is
    fsynced and renamed over `path`. On an error it is removed and `path` is untouched.

    Raises:
        NotARegularFile: `path` exists and is not a regular file (before the block runs).
        WriteRefused: the block or the rename failed for a reason of the filesystem's.
    """
    path = Path(path)
    check_target(path)
    # Beside the target, not in /tmp: a rename is atomic only within one filesystem. The pid
    # keeps two processes writing the same target off each other's temporary file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _remove(tmp)  # a leftover of this pid's earlier, killed write
        yield tmp
        # Data on disk before the rename: otherwise a crash can leave the new name pointing
        # at an empty or partial file.
        _fsync_file(tmp)
        _keep_mode(path, tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself lives in the folder's entry
    except BaseException as exc:  # KeyboardInterrupt too: no temporary file is left behind
        with contextlib.suppress(OSError):
            _remove(tmp)
        refused = as_write_refused(exc, path, tmp)
        if refused is not None:
            raise refused from exc
        raise


@contextlib.contextmanager
def replacing_dir(path: Path, tmp: Path | None = None) -> Iterator[Path]:
    """Yield a new, empty temporary folder beside `path` (or `tmp`); when the block ends without
    an error it replaces `path` whole. On an error it is deleted and `path` is untouched.

    Raises:
        NotARegularFile: `path` exists and is not a folder (a link to one included).
        WriteRefused: the filesystem refused a write made in the block, or the swap.
    """
    path = Path(path)
    check_target(path, folder=True)
    tmp = tmp if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _remove(tmp)
        tmp.mkdir(parents=True)
        yield tmp
        _install_dir(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = as_write_refused(exc, path, tmp)
        if refused is not None:
            raise refused from exc
        raise


def append_text(path: Path, text: str) -> None:
    """Append `text` to the log `path` (created if missing); a failed append is cut back.

    Raises:
        NotARegularFile: `path` is a symbolic link, FIFO, device or folder.
        WriteRefused: the filesystem refused the write.
    """
    # O_NOFOLLOW refuses a link; O_NONBLOCK keeps the open of a FIFO with no reader from
    # hanging, so the check below can name it.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in _LINK_ERRORS:
            check_target(path)  # raises NotARegularFile, saying what the path is
        _reraise(exc, path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            check_target(path)  # names what it is
            raise NotARegularFile(f"{path}: is not a regular file; give another path")
        size = os.fstat(fd).st_size  # where a failed append is cut back to
        try:
            _write_all(fd, text.encode("utf-8"))
        except OSError as exc:
            with contextlib.suppress(OSError):  # shrinking needs no space
                os.ftruncate(fd, size)
            _reraise(exc, path)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Checks and translation


def check_target(path: Path, folder: bool = False) -> None:
    """Refuse an existing `path` that leantune would not replace whole: anything but a regular
    file (a folder when `folder`). A symbolic link is refused even when it points at one.

    Raises:
        NotARegularFile: it is a link, FIFO, device, socket, or the wrong one of file/folder.
    """
    try:
        mode = os.lstat(path).st_mode  # lstat: the link itself, not what it points at
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise NotARegularFile(
            f"{path}: cannot be written, since a part of the path above it is a file, not a "
            "folder. Give another path."
        ) from None
    except OSError as exc:
        _reraise(exc, path)
    if (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)) and not stat.S_ISLNK(mode):
        return
    wanted = "folder" if folder else "regular file"
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        raise NotARegularFile(
            f"{path}: is a symbolic link (to {target}), and leantune never writes through a "
            f"link: it would change a file it does not own. Remove the link, or give the real "
            f"path of the {wanted} to write."
        )
    raise NotARegularFile(
        f"{path}: is {_kind(mode)}, not a {wanted}; leantune writes its outputs only to "
        f"{wanted}s it replaces whole. Give another path."
    )


def as_write_refused(
    exc: BaseException, path: Path, tmp: Path | None = None
) -> WriteRefused | None:
    """`exc` as the user's error when a filesystem refusal is behind it, else None.

    Looks through the chain (torch reports the OSError of a stream as a RuntimeError whose
    context is it) and safetensors' Rust text ``(os error N)``. A file under `tmp`, the
    temporary stand-in for `path`, is named by where it was going.
    """
    if isinstance(exc, WriteRefused):  # from a write inside `tmp`: named by where it goes
        if tmp is not None and exc.path != tmp and _within(exc.path, tmp):
            return refused(path / exc.path.relative_to(tmp), exc.errno, target=path)
        return exc
    if isinstance(exc, UserError) and not isinstance(exc, OSError):
        return None  # already the user's message (a data error, a refused link, ...)
    for code, where in _errnos(exc):
        # A full, over-quota or read-only disk only ever refuses writes; a permission or I/O
        # error is this write's only when it names the file written.
        ours = where is None or _within(where, path) or (tmp is not None and _within(where, tmp))
        if code in FIXES and (code in WRITE_ONLY or (where is not None and ours)):
            if where is None:
                where = path
            elif tmp is not None and _within(where, tmp):
                where = path / where.relative_to(tmp) if where != tmp else path
            return refused(where, code, target=path)
    return None


def _errnos(exc: BaseException) -> Iterator[tuple[int | None, Path | None]]:
    """Each exception of `exc`'s chain (torch reports an OSError as the context of its own
    error) as its errno and the file it names, `exc` first."""
    seen: set[int] = set()  # an exception's chain can loop back on itself
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        named = getattr(current, "filename", None)
        yield _errno_of(current), Path(named) if isinstance(named, str) else None
        current = current.__cause__ or current.__context__


def library_write_refused(exc: BaseException, output: Path | None) -> WriteRefused | None:
    """`exc` as the user's error when a full, over-quota or read-only disk refused a write that
    did not go through this module (a library's own writer: transformers' `save_pretrained`,
    safetensors' `save_file`), else None: the top-level handler's last look before calling an
    exception leantune's bug.

    Only the refusals a read never meets count (`WRITE_ONLY`). Named by the file the error
    names, else by `output` (the command's output: its run directory or --out), else by the
    refusal alone; nothing is claimed about that output's earlier content (a library's writer
    need not be atomic).
    """
    for code, named in _errnos(exc):
        if code is not None and code in WRITE_ONLY:
            return library_refusal(named or output, code)
    return None


def write_refusal_in_text(text: str) -> int | None:
    """The errno of the last refused write (`WRITE_ONLY`) a process printed (its traceback's
    ``[Errno N]`` or ``(os error N)``); None when it printed none."""
    codes = [int(a or b) for a, b in _TEXT_ERRNO.findall(text)]
    found = [c for c in codes if c in WRITE_ONLY]
    return found[-1] if found else None


def library_refusal(where: Path | None, code: int) -> WriteRefused:
    """The refused write (`code`) of a writer other than this module's, named by `where`."""
    reason, fix = _reason(code), FIXES[code]
    if where is None:
        free = _free_space(Path.cwd()) if code == errno.ENOSPC else ""
        return WriteRefused(
            f"a write was refused: {reason}{free}. Fix: {fix}, then run the same command again.",
            Path.cwd(),
            code,
        )
    free = _free_space(where) if code == errno.ENOSPC else ""  # statvfs takes a file too
    return WriteRefused(
        f"cannot write {where}: {reason}{free}; the command stopped at that write. Fix: {fix}, "
        "then run the same command again.",
        where,
        code,
    )


def _reason(code: int) -> str:
    """The refusal as the system says it, with its symbolic name (what a user searches for)."""
    return f"{os.strerror(code)} [{errno.errorcode.get(code, code)}]"


def _within(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def refused(where: Path, code: int, target: Path | None = None) -> WriteRefused:
    """The message for a write to `where` (a part of writing `target`) refused with `code`."""
    target = target if target is not None else where
    reason = _reason(code)
    folder = target.parent if target.name else target
    fix = FIXES.get(code, "write somewhere else").format(folder=folder)
    free = _free_space(folder) if code == errno.ENOSPC else ""
    part = f" (writing {where})" if where != target else ""
    kept = "what was there before is unchanged" if _exists(target) else "nothing was left there"
    return WriteRefused(
        f"cannot write {target}{part}: {reason}{free}; {kept}. Fix: {fix}, then run the same "
        "command again.",
        target,
        code,
    )


def _reraise(exc: OSError, path: Path) -> NoReturn:
    """Raise `exc` as WriteRefused when the filesystem refused a write, else as it is."""
    found = as_write_refused(exc, path)
    if found is None:
        raise exc
    raise found from exc


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    # By class name: importing safetensors here would make every write pay for it.
    match = _RUST_OS_ERROR.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    return int(match.group(1)) if match else None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _free_space(folder: Path) -> str:
    probe = folder
    # The output folder may not exist yet; its nearest existing ancestor is on the same disk.
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return ""
    return f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there now)"


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


# ---------------------------------------------------------------------------------------------
# Filesystem steps


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # os.write may write only part; memoryview slices without copying
        view = view[os.write(fd, view) :]


def _install_dir(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`; an existing `path` is moved aside first and back on failure."""
    if not path.exists():
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return
    # A folder cannot be renamed over a non-empty folder, so the old one steps aside first.
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    _remove(aside)
    os.replace(path, aside)
    try:
        os.replace(tmp, path)
    except OSError:
        os.replace(aside, path)
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)  # the new folder is in; a leftover is only space


def _remove(path: Path) -> None:
    """Delete `path` if it exists; a link is unlinked, never followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _keep_mode(path: Path, tmp: Path) -> None:
    """The replaced file's permission bits carry over to its new content."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(tmp, stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # O_DIRECTORY is POSIX-only; the getattr keeps this importable elsewhere.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
