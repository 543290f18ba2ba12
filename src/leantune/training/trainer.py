"""The training step: what one optimizer update does, owned by a `Trainer`.

`train_step` reads in the order it runs: the next window of samples -> forward -> loss ->
backward over its micro-batches (`backward_window`: each micro-batch's token loss over the
window's supervised tokens; `preference_window` for a preference objective, the one place the
step forks, per objective) -> unscale -> clip (measuring the norm) -> guard -> step or skip ->
the metrics record. Two wrappers sit around the forward and backward, not inside them:
`replay_on_oom` halves the micro-batch and replays the same samples after an out-of-memory
error, and `Agreement` makes every process take the same way out of a micro-batch (an OOM or a
stop signal on one is every one's). A stop signal is acted on at a micro-batch boundary only.
The run's `StepHooks` (no-ops unless a test installed faults) are called at the fault points.

The `Trainer` holds every part the step needs, built once by the recipe's set-up, and the
step's own settings (`StepSettings`), so nothing is passed along the call chain. Its
`ParallelStrategy` decides what this process computes and how counts are summed; the step never
branches on it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from leantune.core.precision import autocast
from leantune.core.signals import Interrupted, StopSignals
from leantune.core.threads import ThreadGovernor
from leantune.data.dataset import PreparedData
from leantune.data.loader import SampleStream, collate, split_window
from leantune.models.loss import IGNORE_INDEX, count_supervised, token_loss_sum
from leantune.monitor.events import EventLog, OutOfMemoryAtMinimum
from leantune.monitor.metrics import memory_stats
from leantune.monitor.sinks import Sinks
from leantune.monitor.step_stats import StepStats
from leantune.objectives.batch import PreferenceMicroBatch, PreferenceStep, kto_kl_of
from leantune.training.guard.detect import Decision, GuardHistory, GuardSettings, decide, remember
from leantune.training.guard.oom import MemoryBudget, free_memory, halved, is_out_of_memory
from leantune.training.hooks import NoStepHooks, StepHooks
from leantune.training.parallel.strategy import (
    CheckpointParts,
    ParallelStrategy,
    SingleProcess,
)
from leantune.training.state.checkpoint import (
    Checkpoint,
    TrainingState,
    capture_rng_state,
    restore_rng_state,
)
from leantune.training.state.progress import Batching, RunProgress

Log = Callable[[str], None]
T = TypeVar("T")


@dataclass(frozen=True)
class StepSettings:
    """How each step computes: autocast precision, clipping, and the KL-to-base weight."""

    precision: str
    max_grad_norm: float
    kl_coef: float = 0.0


@dataclass
class RunFiles:
    """Where a run writes, and what every checkpoint carries."""

    run_dir: Path
    ckpt_dir: Path
    keep_last: int
    config_yaml: str
    write_config: bool = True
    """False when `config.yaml` already holds `config_yaml` (it may be the input config)."""
    started_from: dict[str, str] | None = None
    """The run model.path named, for the record and the summary (`training.start_model`)."""


@dataclass
class Trainer:
    """Everything the step needs, built once by the recipe's set-up.

    The data position is `samples_seen`, a position in the sample stream: a step consumes the
    next `global_batch` samples, split into micro-batches of `micro_batch_size` (which an OOM
    halves; the window, and so the global batch and the LR schedule, stay the same).
    """

    model: nn.Module
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    stream: SampleStream
    data: PreparedData
    pad_id: int
    device: torch.device
    state: TrainingState
    global_batch: int
    micro_batch_size: int
    events: EventLog
    guard: GuardSettings
    settings: StepSettings
    files: RunFiles
    sinks: Sinks = field(default_factory=lambda: Sinks([]))
    strategy: ParallelStrategy = field(default_factory=SingleProcess)
    history: GuardHistory = field(default_factory=GuardHistory)
    samples_seen: int = 0
    progress: RunProgress = field(default_factory=RunProgress)
    """What a checkpoint keeps beyond weights and counters (a rollback replaces it)."""
    budget: MemoryBudget = field(default_factory=lambda: MemoryBudget(None))
    hooks: StepHooks = field(default_factory=NoStepHooks)
    """A test's faults (`training.hooks`); the library's do nothing."""
    levers: str = ""
    """What to try when one sequence does not fit (the OOM-at-minimum message)."""
    stop: StopSignals = field(default_factory=StopSignals)
    """SIGTERM/SIGINT/SIGHUP: the step checks it at every micro-batch boundary."""
    stats: StepStats = field(default_factory=StepStats)
    """The record's padding, MFU, data-wait, ETA, CPU and GPU fields (`monitor.step_stats`)."""
    objective: PreferenceStep | None = None
    """train.objective other than sft: the preference objective and its packed rows (the
    window's loss is `preference_window`); None: the token loss (`backward_window`)."""
    threads: ThreadGovernor | None = None
    """CPU: moves the intra-op thread count with the machine's load (`core.threads`); None
    where the count is the user's (OMP_NUM_THREADS) or the device is not the CPU."""

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step at the current micro-batch size."""
        # Ceiling division: a window that does not split evenly ends in a shorter micro-batch.
        return -(-self.global_batch // self.micro_batch_size)

    def save(self) -> Path:
        """Write a checkpoint of the current state (atomic; see training.state.checkpoint).

        Raises:
            WeightsDiverged: a trainable weight holds NaN or inf, so nothing is written (exit 4).
            CheckpointWriteError: the disk refused the write; earlier checkpoints are intact
                (exit 2).
        """
        batching = Batching(self.global_batch, self.micro_batch_size, self.samples_seen)
        self.progress.batching, self.progress.guard = batching, self.history
        parts = CheckpointParts(
            replace(self.state, extra=self.progress.to_json()),
            params=self.params,
            optimizer=self.optimizer,
            scheduler=self.scheduler.state_dict(),
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            rng=capture_rng_state(),
            keep_last=self.files.keep_last,
            metadata={"config": self.files.config_yaml},
        )
        return self.strategy.save_checkpoint(self.files.ckpt_dir, parts)

    def load(self, ckpt: Checkpoint) -> None:
        """Put a checkpoint's exact state into the trainer (a resume and a rollback)."""
        self.strategy.load_checkpoint(ckpt, self.params, self.optimizer)
        self.scheduler.load_state_dict(ckpt.scheduler)
        if self.scaler is not None and ckpt.scaler is not None:
            self.scaler.load_state_dict(ckpt.scaler)
        restore_rng_state(ckpt.rng)
        self.state = TrainingState(ckpt.state.step, ckpt.state.micro_batches_seen)
        self.progress = RunProgress.from_json(ckpt.state.extra)
        batching = self.progress.batching
        if batching is None:  # written before the data position was kept in samples
            self.samples_seen = ckpt.state.micro_batches_seen * self.micro_batch_size
        else:
            self.samples_seen = batching.samples_seen
            if batching.global_batch == self.global_batch:  # a shrink after an OOM holds
                # The smaller of the two: the resumed run does not meet the same OOM again,
                # and a micro-batch the user lowered since is kept too.
                self.micro_batch_size = min(self.micro_batch_size, batching.micro_batch_size)
        self.history = self.progress.guard

    def restore(self, log: Log) -> None:
        """Continue from the newest checkpoint that checks out (sizes, checksums, state
        values): weights, optimizer, schedule, scaler, RNG and the exact data position.

        Raises:
            DamagedCheckpoints: checkpoints exist but none checks out (exit code 2); training
                never starts over on top of them.
        """
        ckpt = self.strategy.resume_checkpoint(
            self.files.ckpt_dir, warn=lambda m: log(f"warning: {m}")
        )
        if ckpt is None:
            return
        self.load(ckpt)
        log(f"resumed from {ckpt.path} at step {self.state.step}")


@dataclass
class StepResult:
    """One window's outcome: its metrics record, the guard's decision, the rows it held."""

    record: dict[str, Any]
    decision: Decision
    rows: list[int]
    end: int
    """Stream position just after this window."""


Batches = list[dict[str, torch.Tensor]]


def train_step(tr: Trainer) -> StepResult:
    """One optimizer update over the next window of samples: forward -> loss -> backward (per
    micro-batch) -> clip -> guard -> step or skip -> log."""
    start = time.perf_counter()
    tr.stats.begin()
    step = tr.state.step + 1
    with tr.stats.data:
        window = tr.stream.window(tr.samples_seen, tr.global_batch)
        shard = tr.strategy.shard_window(window)
    tr.stop.check()  # a signal that came between steps stops before any of this one is done
    # Forward -> loss -> backward over the micro-batches; an OOM halves the micro-batch and
    # replays the same window.
    loss, batches, objective_metrics = replay_on_oom(tr, step, partial(_accumulate, tr, shard))
    loss = tr.hooks.window_loss(step, loss, tr.params.values())
    # Clip the true gradients (fp16's loss scale taken out first), measuring their norm.
    if tr.scaler is not None:
        tr.scaler.unscale_(tr.optimizer)
    max_norm = tr.settings.max_grad_norm
    # max_grad_norm=0 turns clipping off; clipping to inf still measures the norm, which the
    # guard and the record need.
    clip_to = max_norm if max_norm > 0 else float("inf")
    grad_norm = tr.strategy.clip_grad_norm(list(tr.params.values()), clip_to)
    lr = float(tr.optimizer.param_groups[0]["lr"])  # before the step; a tensor for torchao's
    loss, decision = _guard(tr, loss, grad_norm)
    stepped = _apply_update(tr) if decision.applies_update else _skip_update(tr)
    # None, not zeros: the gradients' memory is free until the next backward allocates it.
    tr.optimizer.zero_grad(set_to_none=True)
    tr.samples_seen += len(window)
    tr.state.micro_batches_seen += len(batches)
    elapsed = time.perf_counter() - start
    tokens = sum(len(tr.data.rows[i].input_ids) for i in window)  # non-pad: the useful ones
    local = sum(len(tr.data.rows[i].input_ids) for i in shard)  # this process's, for its MFU
    elements = sum(b["input_ids"].numel() for b in batches)
    record = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        # The window's, over every process (its rows' labels are already shifted).
        "supervised_tokens": sum(
            sum(label != IGNORE_INDEX for label in tr.data.rows[i].labels) for i in window
        ),
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        **memory_stats(tr.device),
        "optimizer_stepped": stepped,
        "micro_batch_size": tr.micro_batch_size,
        "grad_accum": tr.grad_accum,
        **tr.stats.fields(step, local, elements, elapsed),
        **objective_metrics,
    }
    return StepResult(record, decision, window, tr.samples_seen)


def _guard(tr: Trainer, loss: float, grad_norm: float) -> tuple[float, Decision]:
    """The stability guard's decision on the window (and the loss as every process sees it)."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if tr.strategy.agree(int(not finite)) and finite:
        loss = math.nan  # not finite on another process: every process skips alike
    # An fp16 overflow (finite loss, inf gradients) is the scaler's business: it skips the
    # update and lowers the scale. Everything else goes through the guard, here and only here.
    overflow = tr.scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm)
    if overflow:
        return loss, Decision("step")
    decision = decide(tr.history, loss, grad_norm, tr.guard)
    tr.history = remember(tr.history, loss, grad_norm, decision, tr.guard.window)
    return loss, decision


def _apply_update(tr: Trainer) -> bool:
    """Step the optimizer (through the fp16 scaler if any) and the schedule; counts the step.
    Returns whether the optimizer stepped (the scaler skips a step that overflowed)."""
    if tr.scaler is not None:
        scale_before = tr.scaler.get_scale()
        tr.scaler.step(tr.optimizer)
        tr.scaler.update()
        stepped = tr.scaler.get_scale() >= scale_before  # a skipped step lowers the scale
    else:
        tr.optimizer.step()
        stepped = True
    if stepped:
        tr.scheduler.step()
    tr.state.step += 1
    return stepped


def _skip_update(tr: Trainer) -> bool:
    if tr.scaler is not None:
        tr.scaler.update()  # closes this iteration's unscale_ without stepping
    return False


# ---------------------------------------------------------------------------------------------
# The window's forward and backward, and the OOM replay around it


def replay_on_oom(tr: Trainer, step: int, attempt: Callable[[], T]) -> T:
    """`attempt()`; on an out-of-memory error halve the micro-batch and call it again.

    The replay equals a run that used the smaller micro-batch from the start (up to float
    rounding of the different split). A stop signal inside the window leaves the state of the
    last step.

    Raises:
        OutOfMemoryAtMinimum: one sequence per micro-batch still does not fit.
        Interrupted: a stop signal arrived (`at_boundary`; the state is the last step's).
    """
    # Each replay starts from this RNG state, the same samples in the same order and zeroed
    # gradients, so dropout draws what the smaller micro-batch's run would draw.
    rng = capture_rng_state()
    while True:
        error = ""
        try:
            return attempt()
        except Interrupted:
            # Abandon the window like an OOM does: the checkpoint a stop writes holds the last
            # step's state, with no half-accumulated gradients or advanced RNG.
            tr.optimizer.zero_grad(set_to_none=True)
            restore_rng_state(rng)
            raise
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            error = str(exc).splitlines()[0]
        # Outside the except block: the traceback (and so the attempt's frame, with its
        # batches and activations) is gone before the memory is freed.
        tr.optimizer.zero_grad(set_to_none=True)
        free_memory(tr.device)
        # Before halving: at micro-batch 1 it raises, and the checkpoint written on the way out
        # must hold the last step's RNG, not the failed window's dropout draws.
        restore_rng_state(rng)
        _halve_after_oom(tr, step, error)


def _halve_after_oom(tr: Trainer, step: int, error: str) -> None:
    """Halve the micro-batch (the global batch stays) and say so, or give up at one sequence."""
    old = tr.micro_batch_size
    if old == 1:
        raise OutOfMemoryAtMinimum(
            f"out of memory at step {step} with train.micro_batch_size=1: one sequence does "
            f"not fit ({error}). {tr.levers}"
        )
    tr.micro_batch_size = halved(old)
    tr.events.emit(
        "oom",
        step,
        f"{error}; micro-batch {old} -> {tr.micro_batch_size}, grad accumulation "
        f"-> {tr.grad_accum} (global batch {tr.global_batch} kept), replaying the step",
        micro_batch_size=tr.micro_batch_size,
        grad_accum=tr.grad_accum,
        error=error,
    )


def _accumulate(tr: Trainer, window: list[int]) -> tuple[float, Batches, dict[str, float]]:
    """Forward and backward over `window` at the current micro-batch size: the window's loss,
    its micro-batches' tensors and the objective's metrics (none for the token loss)."""
    with tr.stats.data:
        micro = split_window(window, tr.micro_batch_size)
        if tr.objective is None:
            batches = [collate([tr.data.rows[i] for i in m], tr.pad_id) for m in micro]
        else:
            pref = [tr.objective.collate(m, tr.pad_id) for m in micro]
            batches = [mb.tensors for mb in pref]
    common: dict[str, Any] = {
        "scaler": tr.scaler,
        "strategy": tr.strategy,
        "memory_check": partial(_check_memory, tr, tr.state.step + 1, len(batches)),
        "after_backward": partial(_after_backward, tr, tr.state.micro_batches_seen),
    }
    if tr.objective is None:  # the one fork: per objective, never per method
        loss = backward_window(
            tr.model,
            batches,
            tr.device,
            tr.settings.precision,
            kl_coef=tr.settings.kl_coef,
            **common,
        )
        return loss, batches, {}
    loss, metrics = preference_window(
        tr.objective, tr.model, pref, tr.device, tr.settings.precision, **common
    )
    return loss, batches, metrics


def _check_memory(tr: Trainer, step: int, count: int, k: int) -> None:
    """After micro-batch k's forward (its activation peak) and after its backward: a stop
    signal, the memory budget, a test's simulated OOM."""
    tr.stop.check()
    tr.budget.check()
    tr.hooks.check_memory(step, k, count)


def _after_backward(tr: Trainer, first_micro_batch: int, k: int) -> None:
    """Micro-batch k of the window is done: the hooks hear its index in the whole run."""
    tr.hooks.after_backward(first_micro_batch + k)


def backward_window(
    model: nn.Module,
    batches: Batches,
    device: torch.device,
    precision: str,
    *,
    scaler: torch.amp.GradScaler | None = None,
    kl_coef: float = 0.0,
    strategy: ParallelStrategy | None = None,
    memory_check: Callable[[int], None] | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> float:
    """Accumulate gradients over one optimizer step's micro-batches; returns the window's loss.

    `memory_check(k)` runs after micro-batch k's forward and after its backward,
    `after_backward(k)` once it is done.
    """
    strategy = strategy if strategy is not None else SingleProcess()
    agreed = Agreement(strategy, memory_check)
    local = sum(count_supervised(b["labels"]) for b in batches)
    # One denominator for the whole window, over every process: each micro-batch's summed
    # token loss divided by it makes k micro-batches give the gradient of one k-times larger
    # batch, however the supervised tokens fall between them. max(1, ...): a window with no
    # supervised token (all prompt) has a zero loss, not a division by zero.
    n_supervised = max(1, strategy.reduce_count(local))
    # float64 on the CPU: the window's loss is a sum of many small terms.
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k, batch in enumerate(batches):
        batch = {key: v.to(device) for key, v in batch.items()}
        # Gradients are all-reduced on the last micro-batch only; the earlier ones accumulate
        # locally, so a window costs one gradient sync.
        with strategy.gradient_sync(model, enabled=k == len(batches) - 1) as scope:
            # Forward -> loss; an OOM or a stop here on any process is every process's.
            with agreed(k), autocast(device.type, precision):
                scope.loss = loss = token_loss_sum(model, batch, kl_coef) / n_supervised
            (scaler.scale(loss) if scaler is not None else loss).backward()
            with agreed(k):  # the check after the backward, decided alike too
                # The backward came: a failure agreed on from here must not complete it again
                # (ddp.py's gradient_sync completes an abandoned forward's backward).
                scope.loss = None
        loss_sum += loss.detach().double().cpu()
        if after_backward is not None:
            after_backward(k)
    return strategy.reduce_sum(float(loss_sum))


def preference_window(
    objective: PreferenceStep,
    model: nn.Module,
    batches: list[PreferenceMicroBatch],
    device: torch.device,
    precision: str,
    *,
    scaler: torch.amp.GradScaler | None = None,
    strategy: ParallelStrategy | None = None,
    memory_check: Callable[[int], None] | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> tuple[float, dict[str, float]]:
    """`backward_window` for a preference objective; returns the window's loss and metrics.

    The metrics are the window's means: sums and counts added over micro-batches and
    processes.
    """
    strategy = strategy if strategy is not None else SingleProcess()
    agreed = Agreement(strategy, memory_check)
    # Window-wide denominators, as in backward_window: each micro-batch's summed per-example
    # loss over the window's examples (pairs; KTO: completions) and its chosen answers' NLL
    # (RPO, ORPO) over the window's chosen tokens give the gradient of one larger batch.
    examples = max(1, strategy.reduce_count(sum(b.examples for b in batches)))
    nll_tokens = max(1, strategy.reduce_count(sum(b.nll_tokens for b in batches)))
    loss_sum = torch.zeros((), dtype=torch.float64)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    # KTO: one KL estimate over the whole window, before its micro-batches (no gradient).
    with autocast(device.type, precision):
        parts = objective.window_kl(model, batches, device)
    # Added over the processes before the mean and its clamp: the window's estimate.
    kl = None
    if parts is not None:
        kl = kto_kl_of(strategy.reduce_sum(parts[0]), strategy.reduce_count(parts[1]), device)
    for k, mb in enumerate(batches):
        mb = mb.to(device)
        with strategy.gradient_sync(model, enabled=k == len(batches) - 1) as scope:
            # Forward -> loss; an OOM or a stop here on any process is every process's.
            with agreed(k), autocast(device.type, precision):
                output = objective.output(model, mb, kl)
                scope.loss = loss = output.loss(examples, nll_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            with agreed(k):  # the check after the backward, decided alike too
                scope.loss = None  # as in backward_window: the backward is not to be redone
        loss_sum += loss.detach().double().cpu()
        for name, value in output.metric_sums.items():
            sums[name] = sums.get(name, 0.0) + float(value)
            counts[name] = counts.get(name, 0) + output.metric_counts[name]
        if after_backward is not None:
            after_backward(k)
    # Means over the window's counts, not a mean of per-micro-batch means: micro-batches of
    # different sizes weigh by what they hold.
    metrics = {
        name: strategy.reduce_sum(sums[name]) / n
        for name in sorted(sums)
        if (n := strategy.reduce_count(counts[name])) > 0
    }
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return strategy.reduce_sum(float(loss_sum)), metrics


# ---------------------------------------------------------------------------------------------
# Cross-process agreement around each forward and backward

# A stop outranks an OOM (agree takes the largest code): replaying the window on the other
# processes would wait on collectives that the stopping one never joins.
_OOM, _STOP = 1, 2
"""What `Agreement` decides: an out-of-memory error, or a stop signal (the larger wins)."""


@dataclass(frozen=True)
class Agreement:
    """Every process takes the same way out of micro-batch k's forward or backward.

    `with agreed(k): work` runs `work`, then `check(k)`; an out-of-memory error or a stop
    signal on one process raises on all of them, so that all replay the window with the smaller
    micro-batch (or all stop) and their collectives stay in step.
    """

    strategy: ParallelStrategy
    check: Callable[[int], None] | None = None

    @contextlib.contextmanager
    def __call__(self, k: int) -> Iterator[None]:
        failure: BaseException | None = None
        code = 0
        try:
            yield
            if self.check is not None:
                self.check(k)
        except Interrupted as exc:
            failure, code = exc, _STOP
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            failure, code = exc, _OOM
        decided = self.strategy.agree(code)  # every process calls it once here, failed or not
        if decided == code and failure is not None:
            raise failure
        if decided == _STOP:
            raise Interrupted(signal.SIGTERM, True, "")  # another process was signalled
        if decided == _OOM:
            raise torch.OutOfMemoryError("out of memory on another process")
