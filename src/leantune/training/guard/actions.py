"""Carrying out the stability guard's decisions: warn, skip, roll back, pause or stop.

`training.guard.decide` (called once per window in `trainer.train_step`) says what to do;
`act_on_guard` does it. Every decision is an event in `events.jsonl`; a rollback restores the
last checkpoint exactly, lowers the learning rate and skips the data up to the bad window.
"""

from __future__ import annotations

import json

from leantune.core.writes import write_file
from leantune.data.dataset import PreparedData
from leantune.layout import RunPaths
from leantune.monitor.events import TrainingPaused, TrainingStopped
from leantune.training.guard.divergence import WeightsDiverged
from leantune.training.trainer import StepResult, Trainer


def act_on_guard(tr: Trainer, result: StepResult) -> bool:
    """Carry out a guard decision other than a clean step; True when the state was rolled back.

    Raises:
        TrainingPaused: action pause (after a checkpoint and the PAUSED marker).
        TrainingStopped: action stop, or a rollback beyond `guard.max_rollbacks`.
        WeightsDiverged: a pause or stop found the weights NaN/inf, so no checkpoint exists.
    """
    d, g = result.decision, tr.guard
    step, action, reason = result.record["step"], d.action, d.reason
    rollbacks = tr.progress.rollbacks
    # Bounded so that a run which diverges again after each rollback ends instead of looping.
    if action == "rollback" and rollbacks >= g.max_rollbacks:
        action, reason = "stop", f"{reason}; guard.max_rollbacks={g.max_rollbacks} reached"
    kind = d.detector or "guard"
    info = {"action": action, "loss": result.record["loss"], **d.details}
    info["grad_norm"] = result.record["grad_norm"]
    if action == "warn":
        tr.events.emit(kind, step, f"{reason}; update applied (guard.{kind}=warn)", **info)
        return False
    # From skip up the window's update is dropped: its event names the source lines to inspect.
    info.update(rows=result.rows, lines=source_lines(tr.data, result.rows))
    if action == "skip":
        tr.events.emit(kind, step, f"{reason}; update skipped", **info)
        return False
    if action == "rollback":
        tr.events.emit(kind, step, f"{reason}; rolling back", **info)
        rollback(tr, result.end, g.lr_factor)
        return True
    tr.events.emit(kind, step, f"{reason}; update skipped", **info)
    _halt(tr, step, action, kind, reason)
    return False  # not reached: _halt raises


def _halt(tr: Trainer, step: int, action: str, kind: str, reason: str) -> None:
    """Checkpoint and pause (PAUSED marker) or stop; raises the matching error."""
    files = tr.files
    try:
        path = tr.save()
    except WeightsDiverged as exc:  # no resume point to offer: pause and stop both end here
        tr.events.emit("stop", step, f"stopped; {exc}", checkpoint=None)
        raise WeightsDiverged(f"training stopped at step {step}: {reason}. Also, {exc}") from None
    if action == "pause":
        marker = {"reason": reason, "detector": kind, "step": step, "checkpoint": str(path)}
        # One writer for the shared run directory; every rank still raises below.
        if tr.strategy.is_main_process:
            write_file(RunPaths(files.run_dir).paused, json.dumps(marker, indent=2) + "\n")
        tr.events.emit("pause", step, f"paused; checkpoint {path}", checkpoint=str(path))
        raise TrainingPaused(
            f"training paused at step {step}: {reason}. Checkpoint {path}; the offending window "
            f"was skipped. Inspect it, then run `leantune train` with run.dir={files.run_dir} "
            "to resume."
        )
    tr.events.emit("stop", step, f"stopped; checkpoint {path}", checkpoint=str(path))
    raise TrainingStopped(
        f"training stopped at step {step}: {reason}. Checkpoint {path}. The same `leantune "
        "train` command resumes from it as it is; a lower train.lr or train.max_grad_norm, or "
        f"a data check, usually helps: add run.resume=force run.dir={files.run_dir} to continue "
        "it with changed settings (without run.dir they would name another run)."
    )


def rollback(tr: Trainer, bad_end: int, lr_factor: float) -> None:
    """Reload the last checkpoint exactly, scale the LR by `lr_factor` and skip the data from
    that checkpoint up to and including the bad window (`bad_end` is the position after it)."""
    before = tr.progress
    micro_batch_size = tr.micro_batch_size  # an OOM since the checkpoint still applies
    # Verified like a resume: a damaged newest checkpoint gives way to an older one.
    warn = lambda m: tr.events.log(f"warning: {m}")  # noqa: E731
    ckpt = tr.strategy.resume_checkpoint(tr.files.ckpt_dir, warn=warn)
    assert ckpt is not None, "the set-up writes a step-0 checkpoint when rollback is configured"
    path = ckpt.path
    tr.load(ckpt)
    # The checkpoint's micro-batch may predate an OOM halving; going back up would OOM again.
    tr.micro_batch_size = min(micro_batch_size, tr.micro_batch_size)
    restored_scale = tr.progress.lr_scale
    tr.progress = before.rolled_back(tr.progress, lr_factor)  # the fields say what survives
    scale = tr.progress.lr_scale
    # The restored optimizer LRs already carry the checkpoint's scale; apply only the change.
    ratio = scale / restored_scale
    for group in tr.optimizer.param_groups:
        group["lr"] *= ratio
    # The scheduler's base LRs are checkpointed, so a resumed run keeps the lower LR.
    tr.scheduler.base_lrs = [lr * ratio for lr in tr.scheduler.base_lrs]
    # Replaying the same data after restoring would likely reproduce the same blow-up.
    skipped = tr.stream.rows(tr.samples_seen, bad_end - tr.samples_seen)
    tr.samples_seen = bad_end
    lines = source_lines(tr.data, skipped)
    tr.events.emit(
        "rollback",
        tr.state.step + 1,
        f"restored {path.name} (step {tr.state.step}), learning rate x{scale:g}, skipped "
        f"{len(skipped)} samples: rows {skipped}, lines {lines}",
        checkpoint=str(path),
        lr_scale=scale,
        skipped_rows=skipped,
        skipped_lines=lines,
        source=tr.data.records[0].source,
    )


def source_lines(data: PreparedData, rows: list[int]) -> list[int]:
    """The source-file lines of the examples in `rows`, in order (a line once per row: a
    preference pair's two sequences come from one line)."""
    return [
        line
        for r in rows
        for line in dict.fromkeys(data.records[e].line for e in data.rows[r].examples)
    ]
