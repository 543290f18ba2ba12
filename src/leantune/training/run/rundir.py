"""A run directory belongs to one run: its lock, its record, and what a failed start leaves.

- ``leantune_run.json`` marks a folder as a leantune run and records the run's fingerprint
  (``training.run.fingerprint``). A folder without it is a run only if it holds leantune
  checkpoints (``checkpoints/step-*``, written by a leantune older than the record); any other
  non-empty folder is refused before anything is written into it.
- ``.leantune.lock``: an ``fcntl.flock`` held for the whole ``train`` call, with the holder's
  pid inside. A second process on the same directory exits 2 naming that pid, before it
  deletes or writes anything; a stale lock (its holder died) is taken over.
- ``run.resume=never`` on a directory that holds a run moves that run aside to
  ``<run dir>.old-<YYYYmmdd-HHMMSS>`` (and says so) instead of mixing the two. A run.dir that
  is a symbolic link keeps it: the folder it points at is moved aside and made anew.
- A start that fails before its first checkpoint removes what it created: the directory (and
  the parents it made) when it made it, else only the entries that were not there before; an
  old run it had moved aside is moved back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leantune.core import writes
from leantune.errors import UserError
from leantune.layout import RunPaths
from leantune.training.state.checkpoint import list_complete_checkpoints

if TYPE_CHECKING:
    from leantune.training.run.fingerprint import Fingerprint

RUN_FILE_VERSION = 1


class RunDirError(UserError):
    """The run directory is another process's, not a leantune run, or cannot be written."""


@dataclass(frozen=True)
class RunRecord:
    """What ``leantune_run.json`` holds."""

    fingerprint: dict[str, Any]
    sources: dict[str, str]
    split: tuple[int | str, int]
    """(micro_batch_size, grad_accum) as configured: another split of the same global batch
    is allowed, and reported."""


@dataclass
class RunDir:
    """A claimed run directory."""

    path: Path
    moved_aside: Path | None = None
    """Where ``run.resume=never`` moved the run that was there."""
    started: bool = False
    """Set when training begins: a failure after that is not a failed start, and whatever
    it left (metrics, events) stays for inspection."""


def is_run(path: Path) -> bool:
    """Whether `path` holds a leantune run (a record, or checkpoints from an older leantune)."""
    return RunPaths(path).is_run()


@contextlib.contextmanager
def claim_run_dir(path: Path, start_over: bool, log: Callable[[str], None]) -> Iterator[RunDir]:
    """Own `path` for the duration of the block: refuse a foreign folder, lock it, and on a
    failed start leave it as it was.

    Args:
        path: The run directory.
        start_over: ``run.resume=never``: move a run that is there aside first.
        log: Where to say that a run was moved aside.

    Raises:
        RunDirError: `path` is a file, a non-empty folder that is not a leantune run, locked by
            another process, or cannot be created.
    """
    # leantune creates the lock file only in a new or empty folder or a run, so a folder that
    # holds one is leantune's. Its lock comes first, so a start
    # that has not written its run record yet (it is preparing its data) is named as the
    # holder, and one that was killed then is taken over.
    fd = _take_lock(path, create=False) if path.is_dir() else None
    if fd is None:
        _refuse_foreign(path)
        created = _make_dirs(path)
        before = set() if created else set(os.listdir(path))
        fd = lock_run_dir(path)
    else:
        created, before = [], set(os.listdir(path))
    run = RunDir(path)
    try:
        if start_over and is_run(path):
            run.moved_aside = _move_aside(path)
            log(f"run.resume=never: moved the run that was in {path} to {run.moved_aside}")
            # Where it was: a run.dir that is a link keeps pointing at a folder.
            _make_dirs(path.resolve())
            fd, old = lock_run_dir(path), fd
            os.close(old)
            before = set()  # the folder is new: everything in it is this start's
        yield run
    except BaseException:  # KeyboardInterrupt too: a start stopped by Ctrl-C cleans up as well
        if not run.started:
            _undo(path, created, before, run.moved_aside)
        raise
    finally:
        os.close(fd)  # releases the lock


def lock_run_dir(path: Path) -> int:
    """Take the run directory's lock; returns the open lock file descriptor (close = release).

    Raises:
        RunDirError: another process holds it (the message names its pid), or it cannot be
            created.
    """
    fd = _take_lock(path, create=True)
    assert fd is not None, "created"
    return fd


def _take_lock(path: Path, create: bool) -> int | None:
    """`lock_run_dir`; without `create`, None when the lock file does not exist."""
    lock = RunPaths(path).lock
    writes.check_target(lock)  # the pid is written into it: never through a link
    while True:
        try:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
            fd = os.open(lock, flags, 0o644)
        except OSError as exc:
            if not create and isinstance(exc, FileNotFoundError):
                return None
            raise RunDirError(f"run.dir={path}: cannot create {lock}: {exc.strerror}") from None
        try:
            # flock, not a pid file alone: the kernel drops it when its process dies (even by
            # SIGKILL), so a stale lock needs no clean-up and the next start takes it over.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"{path} is in use by another leantune process (pid {holder}; lock {lock}). "
                "Wait for it to finish or stop it, or use another run.dir or run.name."
            ) from None
        # A start that failed may have removed the file between our open and our lock.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        os.close(fd)
    try:
        # Truncate first: a shorter pid must not leave the stale holder's digits behind.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise writes.as_write_refused(exc, lock) or exc from None
    return fd


def read_record(path: Path) -> RunRecord | None:
    """The run's record, or None when there is none or it cannot be read."""
    try:
        raw = json.loads(RunPaths(path).record.read_text(encoding="utf-8"))
        split = raw["split"]  # a JSON list: the record's field is a pair
        return RunRecord(dict(raw["fingerprint"]), dict(raw["sources"]), (split[0], split[1]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        # Unreadable and absent read alike here; the callers tell them apart by the file's
        # existence to word their refusal.
        return None


def write_record(
    path: Path,
    fingerprint: Fingerprint,
    split: tuple[int | str, int],
    started_from: dict[str, str] | None = None,
) -> None:
    """Write ``leantune_run.json`` atomically; `started_from`: the run model.path named
    (`training.start_model`), not compared on resume (its model is, by model.files)."""
    record: dict[str, object] = {
        "leantune_run": RUN_FILE_VERSION,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "split": list(split),
        "fingerprint": fingerprint.fields,
        "sources": fingerprint.sources,
    }
    if started_from is not None:
        record["started_from"] = started_from
    write_file(RunPaths(path).record, json.dumps(record, indent=2, sort_keys=True) + "\n")


def write_file(path: Path, text: str) -> None:
    """Replace a file of the run directory atomically (`leantune.core.writes.write_file`).

    Raises:
        OutputError: it is not a regular file, or the filesystem refused the write (full,
            read-only, ...); what it held is unchanged.
        RunDirError: any other reason it cannot be written.
    """
    try:
        writes.write_file(path, text)
    except OSError as exc:
        raise RunDirError(f"{path}: cannot write it: {exc.strerror}") from None


def check_config_writable(path: Path, text: str, inputs: Sequence[Path]) -> bool:
    """Whether ``config.yaml`` needs writing; never when it is one of this command's inputs.

    Returns:
        False when the file already holds `text`.

    Raises:
        RunDirError: ``config.yaml`` is an input of this command and `text` differs from it.
    """
    target = RunPaths(path).config
    if not target.is_file():
        return True
    # samefile, not path equality: the input may be named through another path or a link.
    if not any(p.is_file() and os.path.samefile(p, target) for p in inputs):
        return True
    if target.read_text(encoding="utf-8") == text:
        return False
    raise RunDirError(
        f"{target} is the input config of this command, and leantune would replace it with the "
        f"resolved config (overrides applied). Train from a copy outside the run directory, "
        f"e.g. cp {target} my.yaml"
    )


def _refuse_foreign(path: Path) -> None:
    if path.is_symlink() and not path.exists():
        raise RunDirError(f"run.dir={path} is a broken symbolic link")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run.dir={path} is a file, not a folder")
    if not path.is_dir() or is_run(path):
        return
    entries = [e for e in os.listdir(path) if e != RunPaths.lock]
    if entries:
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunDirError(
            f"run.dir={path} is a non-empty folder that is not a leantune run (no "
            f"{RunPaths.record}; it holds {shown}); leantune writes nothing into it. Use another "
            "run.dir or run.name, or an empty folder."
        )


def _make_dirs(path: Path) -> list[Path]:
    """mkdir -p, returning the directories it made (outermost first)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    made: list[Path] = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue  # another process made it: not ours to remove
        except OSError as exc:
            _remove_made(made)
            raise RunDirError(f"run.dir={path}: cannot create {d}: {exc.strerror}") from None
        made.append(d)
    return made


def _move_aside(path: Path) -> Path:
    path = path.resolve()  # a run.dir that is a link keeps it: its target moves
    # Moving the working directory away would leave the process in a renamed folder.
    if Path.cwd().resolve().is_relative_to(path):
        raise RunDirError(
            f"run.resume=never would move the run in {path} aside, but it holds the current "
            "directory; run leantune from elsewhere or use another run.dir"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.old-{stamp}")
    n = 1
    while aside.exists():  # two never-starts within a second must not collide
        aside = path.with_name(f"{path.name}.old-{stamp}-{n}")
        n += 1
    os.replace(path, aside)
    return aside


def _undo(path: Path, created: list[Path], before: set[str], aside: Path | None) -> None:
    """Leave `path` as this start found it, unless it has already written a checkpoint."""
    # A checkpoint is a resume point: removing it would throw away trained steps.
    if path.is_dir() and list_complete_checkpoints(RunPaths(path).checkpoints):
        return
    if aside is not None:  # back where `_move_aside` took it from, a link's target included
        real = path.resolve()
        # The failed start's folder goes first: a rename cannot replace a non-empty directory.
        shutil.rmtree(real, ignore_errors=True)
        os.replace(aside, real)
        return
    if not path.is_dir():
        return
    if created:  # the whole tree is this start's
        _remove_made(created)
        return
    for name in set(os.listdir(path)) - before:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():  # never rmtree through a link
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _remove_made(made: list[Path]) -> None:
    """Remove the innermost made directory's tree, then each made parent left empty."""
    if not made:
        return
    shutil.rmtree(made[-1], ignore_errors=True)
    for d in reversed(made[:-1]):
        try:
            d.rmdir()
        except OSError:  # not empty: something else was put there meanwhile, not ours
            return
