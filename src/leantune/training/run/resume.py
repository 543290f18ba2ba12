"""`run.resume`: whether a run directory's checkpoint may be continued with this config.

- ``auto`` (default) resumes only a run whose recorded fingerprint equals the config's; any
  difference exits 2 listing each changed field (``train.lr: 0.0002 -> 0.005``) and the two
  ways on: another run.name/run.dir, or ``run.resume=force``.
- ``force`` continues the run with the changes, after saying what each one means
  (:data:`FORCE_MEANINGS`), except changes whose weights cannot be loaded (:data:`REFUSED`, and
  any mismatch of the trainable weights' names or shapes, checked against the checkpoint before
  loading it), which exit 2 even then.
- ``never`` starts over; ``training.run.rundir`` moves a run that is there aside first.

A directory whose checkpoints predate the record (no ``leantune_run.json``) cannot be checked:
``auto`` refuses it with that reason, ``force`` continues it.

The record alone says whose directory it is: without checkpoints (never written, or deleted to
free space) a record of other settings, or one that cannot be read, is refused with ``auto``
and ``force`` alike (there is nothing to continue), and so is a finished run (``final/``) of
the same settings; ``never`` moves either aside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from safetensors import safe_open

from leantune.config import RunConfig, TrainConfig, refused_reasons
from leantune.core.optim import (
    Schedule,
    current_multiplier,
    default_schedule,
    set_peak_lr,
    set_weight_decay,
    use_schedule,
)
from leantune.core.precision import RESOLVED
from leantune.errors import UserError
from leantune.layout import RunPaths, checkpoint_step
from leantune.training.run.fingerprint import (
    Change,
    Fingerprint,
    RecordedSections,
    compare,
    run_fingerprint,
)
from leantune.training.run.rundir import RunRecord, read_record
from leantune.training.state.checkpoint import WEIGHTS_FILE, TrainingState, newest_checkpoint
from leantune.training.state.progress import RunProgress

Log = Callable[[str], None]

REFUSED: dict[str, str] = {
    **refused_reasons(),
    "model.architecture": "the checkpoint's weights are shaped for another model",
}
"""Fields whose change `run.resume=force` refuses, with why: the config's `Role.REFUSED` fields,
and the base model's shapes (read from its config.json, `fingerprint.architecture`)."""

FORCE_MEANINGS: dict[str, str] = {
    "train.lr": "the new peak LR: every LR from the next step on is the schedule's times the new "
    "peak",
    "train.max_steps": "the LR schedule continues without a jump: a cosine from the LR reached "
    "down to the floor at the new max_steps (a run still in warmup finishes it first)",
    "train.min_lr_ratio": "the new floor of the continued cosine",
    "train.epochs": "the run's length follows from it (its train.max_steps is listed too)",
    "train.warmup_ratio": "changes only a run that is still within the new warmup; after "
    "warmup the LR continues as for a new max_steps",
    "train.global_batch": "each step from the next one takes the new number of samples; the "
    "schedule still counts steps",
    "train.seed": "the data order from the next step on is the new seed's shuffle at the same "
    "position (samples of the current pass may repeat or be missed); the weights and the RNG "
    "state come from the checkpoint",
    "data.chat_template_text": "the remaining steps render conversations with the template as "
    "it is now (the tokenise-once cache is rebuilt with it)",
    "data.": "the remaining steps read the new data, from the same position (samples seen so "
    "far) in its shuffled order; the steps done are not replayed",
    "model.files": "the checkpoint's trainable weights go on training on this base model",
    "model.": "the base model is loaded this way from now on",
}
"""What `run.resume=force` does with each accepted change (a key ending in "." is a section)."""


class ResumeSettings(RecordedSections, Protocol):
    """What `plan_run` reads of a config (`Config` is one): the fingerprinted sections, and
    where the run lives and whether it may continue."""

    @property
    def run(self) -> RunConfig: ...
    @property
    def run_dir(self) -> Path: ...


class RunMismatch(UserError):
    """The run directory holds a run that this config does not describe."""


@dataclass(frozen=True)
class ResumePlan:
    """What `train` does with the run directory."""

    action: Literal["fresh", "resume", "force"]
    fingerprint: Fingerprint
    checkpoint: Path | None = None
    step: int = 0
    """The checkpoint's step."""
    changes: tuple[Change, ...] = ()
    """Accepted changes (force)."""
    legacy: bool = False
    """The run has no record: what changed is unknown."""
    split: tuple[int | str, int] = (1, 1)
    """This config's (micro_batch_size, grad_accum), for the record."""

    def changed(self, *keys: str) -> bool:
        """Whether force changes any of `keys` (or the run's settings are unknown)."""
        return self.legacy or any(c.key in keys for c in self.changes)


def meaning(key: str) -> str:
    """What forcing a change of `key` does."""
    if key in FORCE_MEANINGS:
        return FORCE_MEANINGS[key]
    # A section's entry (its key ends in ".") covers the fields that have none of their own.
    section = key.split(".")[0] + "."
    return FORCE_MEANINGS.get(section, "applies from the next step")


def plan_run(cfg: ResumeSettings, location: str, gguf_file: str | None, log: Log) -> ResumePlan:
    """Fingerprint `cfg` and decide what to do with its run directory (nothing is written).

    Args:
        cfg: The run's config (its run directory is claimed: locked, moved aside for never).
        location: The resolved model directory or hub id.
        gguf_file: The GGUF file in it, if any.
        log: Where the decision is explained.
    """
    run_dir = cfg.run_dir
    newest = newest_checkpoint(RunPaths(run_dir).checkpoints)
    fingerprint = run_fingerprint(cfg, location, gguf_file)
    split = (cfg.train.micro_batch_size, cfg.train.grad_accum)
    record = read_record(run_dir)
    return plan_resume(cfg.run.resume, run_dir, newest, record, fingerprint, split, log)


def plan_resume(
    mode: str,
    run_dir: Path,
    checkpoint: Path | None,
    record: RunRecord | None,
    new: Fingerprint,
    split: tuple[int | str, int],
    log: Log,
) -> ResumePlan:
    """Decide fresh / resume / force for `run_dir`; nothing is written.

    Args:
        mode: ``run.resume`` (``never`` has already moved any run aside).
        run_dir: The run directory (for messages).
        checkpoint: Its newest complete checkpoint, or None.
        record: Its ``leantune_run.json``, or None (none, or written by an older leantune).
        new: This config's fingerprint.
        split: This config's (micro_batch_size, grad_accum).
        log: Where force says what it accepts.

    Raises:
        RunMismatch: ``auto`` with any change, ``force`` with a refused change or a
            ``train.max_steps`` below the checkpoint's step; without a checkpoint, either
            mode when the record differs or cannot be read, or the run finished.
    """
    if mode == "never":  # the run directory's claim has already moved any run aside
        return ResumePlan("fresh", new, split=split)
    # Nothing to continue, but the record alone still says whose directory this is.
    if checkpoint is None:
        _check_no_checkpoint(run_dir, record, new)
        return ResumePlan("fresh", new, split=split)
    step = checkpoint_step(checkpoint.name) or 0
    where = f"{run_dir} (newest checkpoint {checkpoint.name})"
    if record is None:
        return _continue_unrecorded(mode, run_dir, where, checkpoint, step, new, split, log)
    changes = compare(record.fingerprint, new.fields)
    lines = [f"  {c.describe(record.sources, new.sources)}" for c in changes]
    if not changes:
        # The split is not fingerprinted (an OOM recovery changes it), so it is only reported.
        if tuple(record.split) != tuple(split):
            log(
                f"micro-batch split {record.split[0]} x {record.split[1]} -> {split[0]} x "
                f"{split[1]} (global batch {new.fields['train.global_batch']} unchanged)"
            )
        return ResumePlan("resume", new, checkpoint, step, split=split)
    if mode != "force":
        raise RunMismatch(
            f"{where} holds a run with other settings than this config:\n"
            + "\n".join(lines)
            + "\nResuming it would mix two runs. Either start a separate run with another "
            "run.name or run.dir (run.resume=never moves this run aside and starts over), or "
            "continue this one with these changes: run.resume=force."
        )
    # Refused even with force: after these changes the checkpoint's weights cannot be loaded.
    refused = [
        f"{ln} ({REFUSED[c.key]})" for c, ln in zip(changes, lines, strict=True) if c.key in REFUSED
    ]
    if refused:
        raise RunMismatch(
            f"{where}: cannot continue this run even with run.resume=force:\n"
            + "\n".join(refused)
            + "\nStart a separate run with another run.name or run.dir."
        )
    log(f"run.resume=force: continuing {where} at step {step} with these changes:")
    for c, ln in zip(changes, lines, strict=True):
        log(f"{ln}: {meaning(c.key)}")
    return _check_max_steps(
        ResumePlan("force", new, checkpoint, step, tuple(changes)), new, run_dir
    )


def _continue_unrecorded(
    mode: str,
    run_dir: Path,
    where: str,
    checkpoint: Path,
    step: int,
    new: Fingerprint,
    split: tuple[int | str, int],
    log: Log,
) -> ResumePlan:
    """A checkpoint without a readable run record: only run.resume=force continues it."""
    if mode != "force":
        why = (
            f"has a run record {RunPaths(run_dir).record} that cannot be read"
            if RunPaths(run_dir).record.exists()
            else f"was written by an older leantune, without the run record {RunPaths.record}"
        )
        raise RunMismatch(
            f"{where} {why}, so this config cannot be checked against it. Continue it "
            "anyway with run.resume=force (it says what it applies), or start a separate "
            "run with another run.name or run.dir."
        )
    log(f"run.resume=force: continuing {where}, whose settings were not recorded")
    plan = ResumePlan("force", new, checkpoint, step, legacy=True, split=split)
    return _check_max_steps(plan, new, run_dir)


def _check_no_checkpoint(run_dir: Path, record: RunRecord | None, new: Fingerprint) -> None:
    """A directory without checkpoints (never written, or deleted to free space) is still the
    run its record describes: start afresh in it only for that run, and never over its final/.

    Raises:
        RunMismatch: the record cannot be read, describes other settings, or the run finished
            (final/ is there). ``force`` is no way on: there is no checkpoint to continue.
    """
    levers = (
        "Start a separate run with another run.name or run.dir, or move this one aside and "
        "start over in its place with run.resume=never."
    )
    where = f"{run_dir} (no checkpoints)"
    if record is None:
        if RunPaths(run_dir).record.exists():
            raise RunMismatch(
                f"{where} has a run record {RunPaths(run_dir).record} that cannot be read, so this "
                f"config cannot be checked against it. {levers}"
            )
        return
    changes = compare(record.fingerprint, new.fields)
    if changes:
        lines = "\n".join(f"  {c.describe(record.sources, new.sources)}" for c in changes)
        raise RunMismatch(
            f"{where} holds a run with other settings than this config:\n{lines}\n"
            f"Training here would replace that run's record and results. {levers}"
        )
    final = RunPaths(run_dir).final
    if final.exists():
        raise RunMismatch(
            f"{where} holds this config's run, finished: {final} is its result and there is "
            f"no checkpoint to resume, so training again would replace it. {levers}"
        )


def _check_max_steps(plan: ResumePlan, new: Fingerprint, run_dir: Path) -> ResumePlan:
    max_steps = int(new.fields["train.max_steps"])
    # The schedule cannot end before the step the checkpoint has already reached.
    if max_steps < plan.step:
        raise RunMismatch(
            f"train.max_steps={max_steps} is below step {plan.step}, which {run_dir} has "
            f"already reached: use train.max_steps >= {plan.step}, or another run.name or "
            "run.dir"
        )
    return plan


def check_weights_fit(plan: ResumePlan, params: dict[str, torch.nn.Parameter]) -> None:
    """Refuse, naming the changed fields, a checkpoint whose trainable weights' names or
    shapes differ from this model's (loading it would fail half-way).

    Raises:
        RunMismatch: the names or shapes differ.
    """
    assert plan.checkpoint is not None
    try:
        # Shapes from the safetensors header only: no tensor is read.
        with safe_open(str(plan.checkpoint / WEIGHTS_FILE), framework="pt") as f:
            saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception:  # unreadable: loading the checkpoint reports what is wrong with it
        return
    # Checked before loading: a mismatch found by the load itself would fail half-way.
    # A ZeRO-3 parameter is an empty placeholder; its ds_shape is the whole one.
    now = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in params.items()}
    if saved == now:
        return
    other = [n for n in now if n in saved and saved[n] != now[n]]
    missing, unexpected = len(set(now) - set(saved)), len(set(saved) - set(now))
    parts = [f"{other[0]} is {saved[other[0]]} there, {now[other[0]]} here"] if other else []
    parts += [f"{missing} missing there"] if missing else []
    parts += [f"{unexpected} not in this model"] if unexpected else []
    # Method and model changes are the ones that reshape trainable weights: name them as causes.
    likely = [c for c in plan.changes if c.key.startswith(("method.", "model."))]
    changed = "".join(f"\n  {c.describe({}, {})}" for c in likely)
    raise RunMismatch(
        f"{plan.checkpoint.parent.parent}: cannot continue this run even with "
        f"run.resume=force: the trainable weights in {plan.checkpoint.name} do not fit this "
        f"model ({', '.join(parts)}).{' Changed:' + changed if likely else ''}\n"
        "Start a separate run with another run.name or run.dir."
    )


def recorded_schedule(progress: RunProgress, t: TrainConfig) -> Schedule:
    """The LR schedule a checkpoint follows (kept in its run progress); the config's for a
    checkpoint written before schedules were recorded. Records it in `progress`."""
    schedule = progress.schedule
    if schedule is None:
        assert t.max_steps is not None, "train() resolves it from train.epochs and the data"
        schedule = default_schedule(t.max_steps, t.warmup_ratio, t.min_lr_ratio)
    # Written back so the next checkpoint records it, and a later resume need not guess.
    progress.schedule = schedule
    return schedule


def apply_force(
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    params: dict[str, torch.nn.Parameter],
    state: TrainingState,
    progress: RunProgress,
    t: TrainConfig,
    lr: float,
    plan: ResumePlan,
    log: Log,
) -> None:
    """Make forced changes take effect on a restored optimizer and schedule.

    The peak LR (`lr`, resolved; times a rollback's ``lr_scale``) and weight decay are set from
    the config. A change of max_steps, min_lr_ratio or warmup_ratio continues the schedule from
    where it is (:meth:`Schedule.continued`); the new schedule goes into `progress`.
    """
    assert t.max_steps is not None, "train() resolves it from train.epochs and the data"
    schedule = recorded_schedule(progress, t)
    at = scheduler.last_epoch
    if plan.changed("train.max_steps", "train.min_lr_ratio", "train.warmup_ratio"):
        # None keeps the schedule's own warmup: only a changed ratio may move it.
        warmup = round(t.max_steps * t.warmup_ratio) if plan.changed("train.warmup_ratio") else None
        # Continue from the multiplier actually reached, so the LR does not jump at the resume.
        reached = current_multiplier(optimizer, scheduler)
        schedule = schedule.continued(at, reached, t.max_steps, t.min_lr_ratio, warmup)
    # The restored optimizer and scheduler carry the old peak LR and weight decay; the rollback
    # scale still applies, as the checkpointed LRs carried it.
    peak = lr * progress.lr_scale
    use_schedule(scheduler, schedule)
    now = set_peak_lr(optimizer, scheduler, peak, schedule)
    set_weight_decay(optimizer, params, t.weight_decay)
    # Recorded so that resuming the continued run follows the same schedule exactly.
    progress.schedule = schedule
    if state.step >= t.max_steps:
        log(
            f"run.resume=force: the run is at train.max_steps={t.max_steps} already: nothing "
            "left to train (raise train.max_steps to train on)"
        )
        return
    # The multiplier of the final step, counted in the scheduler's own steps from `at`.
    last = peak * schedule.multiplier(at + t.max_steps - state.step - 1)
    log(
        f"run.resume=force: LR {now:.4g} at step {state.step + 1}, {last:.4g} at step {t.max_steps}"
    )


def recorded_precision(run_dir: Path) -> str | None:
    """The precision of the run that `train` would resume in `run_dir`: the one its record
    holds, when it has a checkpoint to resume from; None for a fresh start."""
    value = recorded_setting(run_dir, "train.precision")
    # An unresolved value (auto, or an edited record) names no precision to train in.
    return value if value in RESOLVED else None


def recorded_setting(run_dir: Path, key: str) -> object:
    """Fingerprint field `key` of the run that `train` would resume in `run_dir` (None for a
    fresh start: no checkpoint to resume from, or no record of it)."""
    # A record without a checkpoint is a fresh start: its settings do not carry over.
    if newest_checkpoint(RunPaths(run_dir).checkpoints) is None:
        return None
    record = read_record(run_dir)
    return record.fingerprint.get(key) if record is not None else None
