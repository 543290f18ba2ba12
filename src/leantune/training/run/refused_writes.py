"""What `train` does when the disk refuses a write that is not the checkpoint save.

A full disk (or a link where a log should be) meets `train` first wherever it writes most
often: ``metrics.jsonl``, ``events.jsonl``, the report, ``final/``. The steps trained since the
last checkpoint are still in memory then, so they are saved as a checkpoint if the disk takes one,
and the message always ends with where the same command resumes from.
"""

from __future__ import annotations

import os
from pathlib import Path

from leantune.core.writes import OutputError, as_write_refused
from leantune.layout import checkpoint_step
from leantune.training.parallel.strategy import SingleProcess
from leantune.training.state.checkpoint import CheckpointWriteError, list_complete_checkpoints
from leantune.training.trainer import Trainer


def refused_write(exc: BaseException, run_dir: Path) -> OutputError | None:
    """`exc` as a refused write outside the checkpoint save, or None when it is anything else.

    A bare OSError counts when the filesystem refused a write.
    """
    # The checkpoint save's own failure already names the resume point; it passes through.
    if isinstance(exc, CheckpointWriteError):
        return None
    if isinstance(exc, OutputError):
        return exc
    # A bare OSError comes from a writer outside leantune.core.writes (a monitoring backend's,
    # a library's).
    if isinstance(exc, OSError):
        named = exc.filename if isinstance(exc.filename, str) else None
        return as_write_refused(exc, Path(named) if named else run_dir)
    return None


def keep_trained_steps(tr: Trainer, exc: OutputError) -> OutputError:
    """Checkpoint the steps applied since the newest checkpoint, if the disk takes it; `exc`
    with the resume point added to its message."""
    step = tr.state.step
    done = _newest(tr.files.ckpt_dir)
    # The newest checkpoint already holds every applied step: nothing would be saved.
    if done is not None and done[0] == step:
        return _with(exc, f"Checkpoint {done[1]} holds all {step} steps applied", done[1])
    if step == 0:
        return _with(exc, "No step was trained yet", None)
    if not isinstance(tr.strategy, SingleProcess):  # a save is collective: no rank saves alone
        return with_resume_point(exc, tr.files.ckpt_dir, f"{step} steps were applied")
    # Worth trying on a full disk: a log append needs a fresh page, a checkpoint may still fit
    # where the log did not, or the quota may be per file.
    try:
        path = tr.save()
    except OutputError as failed:
        lost = f"the checkpoint of step {step} could not be saved either ({_reason(failed)})"
        return with_resume_point(exc, tr.files.ckpt_dir, lost)
    return _with(exc, f"Checkpoint {path} was saved nonetheless and holds all {step} steps", path)


def with_resume_point(exc: OutputError, ckpt_dir: Path, before: str = "") -> OutputError:
    """`exc` with where the same command resumes from: the newest complete checkpoint."""
    done = _newest(ckpt_dir)
    lead = f"{before[0].upper()}{before[1:]}; " if before else ""
    if done is None:
        return _with(exc, f"{lead}there is no checkpoint", None)
    return _with(exc, f"{lead}the newest checkpoint is {done[1]} (step {done[0]})", done[1])


def _newest(ckpt_dir: Path) -> tuple[int, Path] | None:
    try:
        complete = list_complete_checkpoints(ckpt_dir)
    except OSError:  # an unreadable directory must not hide the original error
        return None
    if not complete:
        return None
    return checkpoint_step(complete[-1].name) or 0, complete[-1]


def _reason(exc: BaseException) -> str:
    # An OutputError other than WriteRefused has no errno of its own; its OSError cause may.
    code = getattr(exc, "errno", None) or getattr(exc.__cause__, "errno", None)
    return os.strerror(code) if isinstance(code, int) else type(exc).__name__


def _with(exc: OutputError, where: str, resume_from: Path | None) -> OutputError:
    """The same error, its message ending with `where` and what the same command does."""
    then = "the same command resumes from it" if resume_from else "the same command starts over"
    # Rewritten in place so the exception keeps its type, traceback and cause.
    exc.args = (f"{exc} {where[0].upper()}{where[1:]}: {then}.",)
    return exc
