"""The supervised fine-tuning recipe: one loop for every method, read top to bottom.

`train(cfg)` builds components in dependency order (tokenizer -> data -> model -> method ->
optimizer -> schedule -> checkpoint state), then runs the step: forward -> loss -> backward ->
accumulate -> unscale -> clip (measuring the norm) -> guard -> step or skip -> log -> save. The
method only decides how the model is wrapped and which parameters train; the loop never
branches on it.

Two things can interrupt a step. An out-of-memory error halves the micro-batch and replays the
same window of samples (`accumulate`). The stability guard (`training.guard.decide`, called once
in `train_step`) may skip the update, pause the run, roll back to the last checkpoint or stop;
`act_on_guard` carries that out. Every such decision is an event in `events.jsonl`.

The run directory is claimed first (`training.rundir`: a lock, no foreign folder) and its
record decides whether the checkpoint there may be continued (`training.resume_policy`). A
SIGTERM or SIGINT stops at the next micro-batch boundary with a checkpoint of the last applied
step (`training.signals`, checked in `accumulate` only).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml
from torch import nn

from leantune.config import Config, GuardConfig, TrainConfig, parse_memory_size, to_dict, validate
from leantune.data.dataset import PreparedData
from leantune.data.loader import SampleStream, collate, split_window
from leantune.data.templates import apply_chat_template
from leantune.methods.registry import (
    DEFAULT_LR,
    apply_method,
    base_quantization,
    count_parameters,
    merge_for_inference,
    trainable_named_parameters,
)
from leantune.models.artifacts import save_final
from leantune.models.loading import (
    ModelSource,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    resolve_model,
)
from leantune.training.checkpoint import (
    Checkpoint,
    TrainingState,
    capture_rng_state,
    latest_checkpoint,
    list_complete_checkpoints,
    restore_rng_state,
    resume_checkpoint,
    save_checkpoint,
)
from leantune.training.divergence import WeightsDiverged
from leantune.training.evaluation import (
    PeriodicEval,
    evaluate_after,
    exact_match_before,
)
from leantune.training.events import (
    EVENTS_FILE,
    PAUSED_MARKER,
    EventLog,
    OutOfMemoryAtMinimum,
    TrainingPaused,
    TrainingStopped,
    lift_pause,
)
from leantune.training.faults import KILL_ENV, FaultHooks, kill_after, signal_after, signal_at_start
from leantune.training.guard import Decision, GuardHistory, GuardSettings, decide, remember
from leantune.training.loss import count_supervised, token_loss_sum
from leantune.training.metrics import MetricsLog, memory_stats, progress_bar
from leantune.training.oom import (
    MemoryBudget,
    free_memory,
    halved,
    is_out_of_memory,
    levers_message,
)
from leantune.training.optim import build_optimizer, build_scheduler, default_schedule, use_schedule
from leantune.training.precision import (
    autocast,
    make_grad_scaler,
    pick_device,
    recorded_precision,
    resolve_precision,
)
from leantune.training.progress import Batching, RunProgress
from leantune.training.resume_policy import (
    ResumePlan,
    apply_force,
    check_weights_fit,
    recorded_schedule,
)
from leantune.training.run_setup import (
    check_resumable,
    guard_settings,
    named_run,
    seed_everything,
    set_up_run,
)
from leantune.training.rundir import (
    RunDir,
    check_config_writable,
    claim_run_dir,
    write_file,
    write_record,
)
from leantune.training.signals import Interrupted, StopSignals
from leantune.training.summary import write_summary

Log = Callable[[str], None]
T = TypeVar("T")
# Test hook: SIGKILL this process right after the backward of this global micro-batch index.
FAULT_ENV = KILL_ENV


@dataclass
class Trainer:
    """Everything the step needs, built once by `train`.

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
    history: GuardHistory = field(default_factory=GuardHistory)
    samples_seen: int = 0
    progress: RunProgress = field(default_factory=RunProgress)
    """What checkpoints record beyond the step counters (batching and guard: when saving)."""
    budget: MemoryBudget = field(default_factory=lambda: MemoryBudget(None))
    faults: FaultHooks = field(default_factory=FaultHooks)
    levers: str = ""
    """What to try when one sequence does not fit (the OOM-at-minimum message)."""
    stop: StopSignals = field(default_factory=StopSignals)
    """SIGTERM/SIGINT: `accumulate` checks it at every micro-batch boundary."""

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step at the current micro-batch size."""
        return -(-self.global_batch // self.micro_batch_size)


@dataclass
class StepResult:
    """One window's outcome: its metrics record, the guard's decision, the rows it held."""

    record: dict[str, Any]
    decision: Decision
    rows: list[int]
    end: int
    """Stream position just after this window."""


def restore(trainer: Trainer, ckpt_dir: Path, log: Log) -> None:
    """Continue from the newest checkpoint that checks out (sizes, checksums, state values):
    weights, optimizer, schedule, scaler, RNG and the exact data position.

    Raises:
        DamagedCheckpoints: checkpoints exist but none checks out (exit code 2); training never
            starts over on top of them.
    """
    ckpt = resume_checkpoint(ckpt_dir, warn=lambda message: log(f"warning: {message}"))
    if ckpt is None:
        return
    load_into(trainer, ckpt)
    log(f"resumed from {ckpt.path} at step {trainer.state.step}")


def load_into(trainer: Trainer, ckpt: Checkpoint) -> None:
    """Put a checkpoint's exact state into the trainer (also what a rollback does)."""
    if set(ckpt.weights) != set(trainer.params):
        raise RuntimeError(
            f"{ckpt.path}: checkpoint weights do not match the model's trainable parameters "
            f"(was it written with another method or model?)"
        )
    with torch.no_grad():
        for name, tensor in ckpt.weights.items():
            trainer.params[name].copy_(tensor)
    trainer.optimizer.load_state_dict(ckpt.optimizer)
    trainer.scheduler.load_state_dict(ckpt.scheduler)
    if trainer.scaler is not None and ckpt.scaler is not None:
        trainer.scaler.load_state_dict(ckpt.scaler)
    restore_rng_state(ckpt.rng)
    trainer.state = TrainingState(ckpt.state.step, ckpt.state.micro_batches_seen)
    trainer.progress = RunProgress.from_json(ckpt.state.extra)
    batching = trainer.progress.batching
    if batching is None:  # written before the data position was kept in samples
        trainer.samples_seen = ckpt.state.micro_batches_seen * trainer.micro_batch_size
    else:
        trainer.samples_seen = batching.samples_seen
        if batching.global_batch == trainer.global_batch:  # a shrink after an OOM holds
            trainer.micro_batch_size = min(trainer.micro_batch_size, batching.micro_batch_size)
    trainer.history = trainer.progress.guard


def checkpoint(trainer: Trainer, ckpt_dir: Path, keep_last: int, config_yaml: str) -> Path:
    """Write a checkpoint of the current state (atomic; see training.checkpoint).

    Raises:
        WeightsDiverged: a trainable weight holds NaN or inf, so nothing is written (exit 4).
        CheckpointWriteError: the disk refused the write; earlier checkpoints are intact (exit 2).
    """
    batching = Batching(trainer.global_batch, trainer.micro_batch_size, trainer.samples_seen)
    trainer.progress.batching, trainer.progress.guard = batching, trainer.history
    return save_checkpoint(
        ckpt_dir,
        replace(trainer.state, extra=trainer.progress.to_json()),
        weights={n: p.detach() for n, p in trainer.params.items()},
        optimizer=trainer.optimizer.state_dict(),
        scheduler=trainer.scheduler.state_dict(),
        scaler=trainer.scaler.state_dict() if trainer.scaler is not None else None,
        rng=capture_rng_state(),
        keep_last=keep_last,
        metadata={"config": config_yaml},
    )


def backward_window(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    scaler: torch.amp.GradScaler | None = None,
    first_micro_batch: int = 0,
    kl_coef: float = 0.0,
    memory_check: Callable[[int], None] | None = None,
) -> float:
    """Accumulate gradients over one optimizer step's micro-batches; returns the window's loss.

    Each micro-batch's summed token loss is divided by the supervised tokens of the whole
    window, so k micro-batches give the same gradient as one k-times larger batch.
    `memory_check(k)` runs after micro-batch k's forward (its activation peak) and backward.
    """
    n_supervised = max(1, sum(count_supervised(b["labels"]) for b in batches))
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k, batch in enumerate(batches):
        batch = {key: v.to(device) for key, v in batch.items()}
        with autocast(device.type, precision):
            loss = token_loss_sum(model, batch, kl_coef) / n_supervised
        if memory_check is not None:
            memory_check(k)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if memory_check is not None:
            memory_check(k)
        loss_sum += loss.detach().double().cpu()
        kill_after(first_micro_batch + k)
        signal_after(first_micro_batch + k)
    return float(loss_sum)


def accumulate(
    tr: Trainer, window: list[int], precision: str, kl_coef: float
) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Forward and backward over `window`; on OOM halve the micro-batch and replay it.

    The replay sees the same samples in the same order with zeroed gradients and the RNG as it
    was before the failed attempt, so it equals a run that used the smaller micro-batch from
    the start (up to float rounding of the different split).

    A stop signal is acted on here, and only here: at the window's start and after each
    micro-batch's forward and backward, the window is abandoned as the OOM replay abandons it.

    Raises:
        OutOfMemoryAtMinimum: one sequence per micro-batch still does not fit.
        Interrupted: SIGTERM or SIGINT arrived (`at_boundary`; the state is the last step's).
    """
    step = tr.state.step + 1
    tr.stop.check()
    rng = capture_rng_state()
    while True:
        micro = split_window(window, tr.micro_batch_size)
        batches = [collate([tr.data.rows[i] for i in m], tr.pad_id) for m in micro]

        def check(k: int, count: int = len(batches)) -> None:
            tr.stop.check()
            tr.budget.check()
            tr.faults.train_oom(step, k, count)

        error = ""
        try:
            loss = backward_window(
                tr.model, batches, tr.device, precision, tr.scaler,
                tr.state.micro_batches_seen, kl_coef, check,
            )  # fmt: skip
            return loss, batches
        except Interrupted:
            tr.optimizer.zero_grad(set_to_none=True)
            restore_rng_state(rng)
            raise
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            error = str(exc).splitlines()[0]
        # Outside the except block, so the traceback no longer pins the attempt's activations.
        del batches
        tr.optimizer.zero_grad(set_to_none=True)
        free_memory(tr.device)
        old = tr.micro_batch_size
        if old == 1:
            raise OutOfMemoryAtMinimum(
                f"out of memory at step {step} with train.micro_batch_size=1: one sequence does "
                f"not fit ({error}). {tr.levers}"
            )
        tr.micro_batch_size = halved(old)
        restore_rng_state(rng)
        tr.events.emit(
            "oom", step,
            f"{error}; micro-batch {old} -> {tr.micro_batch_size}, grad accumulation "
            f"-> {tr.grad_accum} (global batch {tr.global_batch} kept), replaying the step",
            micro_batch_size=tr.micro_batch_size, grad_accum=tr.grad_accum, error=error,
        )  # fmt: skip


def train_step(
    tr: Trainer, precision: str, max_grad_norm: float, kl_coef: float = 0.0
) -> StepResult:
    """One window: backward -> unscale -> clip (measure) -> guard -> step or skip."""
    start = time.perf_counter()
    step = tr.state.step + 1
    window = tr.stream.window(tr.samples_seen, tr.global_batch)
    loss, batches = accumulate(tr, window, precision, kl_coef)
    loss = tr.faults.spike(step, loss, tr.params.values())
    if tr.scaler is not None:
        tr.scaler.unscale_(tr.optimizer)
    clip_to = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(list(tr.params.values()), clip_to))
    lr = float(tr.optimizer.param_groups[0]["lr"])  # a tensor for torchao optimizers
    # An fp16 overflow (finite loss, inf gradients) is the scaler's business: it skips the
    # update and lowers the scale. Everything else goes through the guard, here and only here.
    overflow = tr.scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm)
    decision = Decision("step") if overflow else decide(tr.history, loss, grad_norm, tr.guard)
    if not overflow:
        tr.history = remember(tr.history, loss, grad_norm, decision, tr.guard.window)
    stepped = False
    if decision.applies_update:
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
    elif tr.scaler is not None:
        tr.scaler.update()  # closes this iteration's unscale_ without stepping
    tr.optimizer.zero_grad(set_to_none=True)
    tr.samples_seen += len(window)
    tr.state.micro_batches_seen += len(batches)
    elapsed = time.perf_counter() - start
    tokens = sum(len(tr.data.rows[i].input_ids) for i in window)
    record = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "supervised_tokens": sum(count_supervised(b["labels"]) for b in batches),
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        **memory_stats(tr.device),
        "optimizer_stepped": stepped,
        "micro_batch_size": tr.micro_batch_size,
        "grad_accum": tr.grad_accum,
    }
    return StepResult(record, decision, window, tr.samples_seen)


@dataclass
class RunFiles:
    """Where a run writes, and what every checkpoint carries."""

    run_dir: Path
    ckpt_dir: Path
    keep_last: int
    config_yaml: str
    write_config: bool = True
    """False when `config.yaml` already holds `config_yaml` (it may be the input config)."""


def act_on_guard(tr: Trainer, result: StepResult, files: RunFiles, g: GuardConfig) -> bool:
    """Carry out a guard decision other than a clean step; True when the state was rolled back.

    Raises:
        TrainingPaused: action pause (after a checkpoint and the PAUSED marker).
        TrainingStopped: action stop, or a rollback beyond `guard.max_rollbacks`.
    """
    d = result.decision
    step, action, reason = result.record["step"], d.action, d.reason
    rollbacks = tr.progress.rollbacks
    if action == "rollback" and rollbacks >= g.max_rollbacks:
        action, reason = "stop", f"{reason}; guard.max_rollbacks={g.max_rollbacks} reached"
    kind = d.detector or "guard"
    info = {"action": action, "loss": result.record["loss"], **d.details}
    info["grad_norm"] = result.record["grad_norm"]
    if action == "warn":
        tr.events.emit(kind, step, f"{reason}; update applied (guard.{kind}=warn)", **info)
        return False
    info.update(rows=result.rows, lines=source_lines(tr.data, result.rows))
    if action == "skip":
        tr.events.emit(kind, step, f"{reason}; update skipped", **info)
        return False
    if action == "rollback":
        tr.events.emit(kind, step, f"{reason}; rolling back", **info)
        rollback(tr, result.end, files, g.lr_factor)
        return True
    tr.events.emit(kind, step, f"{reason}; update skipped", **info)
    try:
        path = checkpoint(tr, files.ckpt_dir, files.keep_last, files.config_yaml)
    except WeightsDiverged as exc:  # no resume point to offer: pause and stop both end here
        tr.events.emit("stop", step, f"stopped; {exc}", checkpoint=None)
        raise WeightsDiverged(f"training stopped at step {step}: {reason}. Also, {exc}") from None
    if action == "pause":
        marker = {"reason": reason, "detector": kind, "step": step, "checkpoint": str(path)}
        (files.run_dir / PAUSED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
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


def rollback(tr: Trainer, bad_end: int, files: RunFiles, lr_factor: float) -> None:
    """Reload the last checkpoint exactly, scale the LR by `lr_factor` and skip the data from
    that checkpoint up to and including the bad window (`bad_end` is the position after it)."""
    before = tr.progress
    micro_batch_size = tr.micro_batch_size  # an OOM since the checkpoint still applies
    # Verified like a resume: a damaged newest checkpoint gives way to an older one.
    ckpt = resume_checkpoint(files.ckpt_dir, warn=lambda m: tr.events.log(f"warning: {m}"))
    assert ckpt is not None, "train() writes a step-0 checkpoint when rollback is configured"
    path = ckpt.path
    load_into(tr, ckpt)
    tr.micro_batch_size = min(micro_batch_size, tr.micro_batch_size)
    restored_scale = tr.progress.lr_scale
    tr.progress = before.rolled_back(tr.progress, lr_factor)  # the fields say what survives
    scale = tr.progress.lr_scale
    ratio = scale / restored_scale
    for group in tr.optimizer.param_groups:
        group["lr"] *= ratio
    # The scheduler's base LRs are checkpointed, so a resumed run keeps the lower LR.
    tr.scheduler.base_lrs = [lr * ratio for lr in tr.scheduler.base_lrs]
    skipped = tr.stream.rows(tr.samples_seen, bad_end - tr.samples_seen)
    tr.samples_seen = bad_end
    tr.events.emit(
        "rollback", tr.state.step + 1,
        f"restored {path.name} (step {tr.state.step}), learning rate x{scale:g}, skipped "
        f"{len(skipped)} samples: rows {skipped}, lines {source_lines(tr.data, skipped)}",
        checkpoint=str(path), lr_scale=scale, skipped_rows=skipped,
        skipped_lines=source_lines(tr.data, skipped), source=tr.data.records[0].source,
    )  # fmt: skip


def source_lines(data: PreparedData, rows: list[int]) -> list[int]:
    """The source-file lines of the examples in `rows`, in order."""
    return [data.records[e].line for r in rows for e in data.rows[r].examples]


def train(cfg: Config, log: Log = print, config_file: Path | None = None) -> dict[str, Any]:
    """Run (or resume) a fine-tune described by `cfg`; returns the run summary.

    Args:
        cfg: The run's config.
        log: Where progress lines go.
        config_file: The YAML file `cfg` came from; it is never overwritten.

    Raises:
        UserError: the run directory is not this run's to write (`RunDirError`), or holds a
            run that this config does not describe (`RunMismatch`); exit code 2.
        TrainingHalted: the guard paused or stopped the run, or one sequence does not fit in
            memory; its `exit_code` is what the CLI returns.
        Interrupted: SIGTERM or SIGINT; during training after a checkpoint of the last applied
            step. Exit code 143 or 130.
    """
    started = time.perf_counter()
    for warning in validate(cfg):
        log(f"warning: {warning}")
    cfg = copy.deepcopy(cfg)  # what the run resolves (its name, lengths, steps) stays its own
    source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    cfg = named_run(cfg, source.location, source.gguf_file)
    log(f"run directory: {cfg.run_dir}")  # a derived name changes with the settings
    with StopSignals() as stop, claim_run_dir(cfg.run_dir, cfg.run.resume == "never", log) as run:
        try:
            inputs = [config_file] if config_file else []
            return _train(cfg, source, log, stop, run, inputs, started)
        except Interrupted as exc:
            raise _explained(exc, cfg.run_dir / "checkpoints") from None


def _train(
    cfg: Config,
    source: ModelSource,
    log: Log,
    stop: StopSignals,
    run: RunDir,
    inputs: list[Path],
    started: float,
) -> dict[str, Any]:
    """`train` inside its claimed run directory, with the stop signals handled."""
    signal_at_start()
    device, cfg.train, why = _device(cfg)  # before the fingerprint: it records the resolved value
    check_resumable(cfg, source.location, source.gguf_file)  # before anything is written
    if why:
        log(why)  # once the run directory's run is known to be this one
    files = _run_files(cfg, inputs)
    events = EventLog(files.run_dir / EVENTS_FILE, log)
    faults = FaultHooks()
    seed_everything(cfg.train.seed)
    tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    for warning in apply_chat_template(tokenizer, cfg.data.chat_template):  # saved with final/
        log(f"warning: {warning}")
    setup = set_up_run(cfg, source, tokenizer, device.type, log)
    cfg, plan, train_data, eval_data = setup.cfg, setup.plan, setup.train_data, setup.eval_data
    t = cfg.train
    quantization = base_quantization(cfg.method, t.precision)
    model: nn.Module = load_model(
        source,
        cfg.model.dtype,
        cfg.model.trust_remote_code,
        cfg.model.attn_implementation,
        cfg.model.rope_scaling,
        quantization,
        device,
    )
    model.to(device)
    base_exact_match = None
    if t.eval_exact_match and t.eval_base and eval_data is not None and plan.action == "fresh":
        # On the bare base model, before any adapter exists (an untrained adapter is a no-op
        # that would only cost time).
        base_exact_match = exact_match_before(
            model, tokenizer, eval_data, t.precision, t.eval_batch_size, t.max_new_tokens,
            events, faults, log,
        )  # fmt: skip
    seed_everything(t.seed)
    model = apply_method(model, cfg.method)
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = trainable_named_parameters(model)
    trainable, total = count_parameters(model)
    log(
        f"method {cfg.method.name}: {trainable:,} of {total:,} parameters train "
        f"({100 * trainable / total:.3f}%)"
    )
    pad_id = int(tokenizer.pad_token_id)
    trainer = build_trainer(
        cfg, model, params, train_data, pad_id, device, events, faults, stop, setup.global_batch
    )
    start_state(trainer, cfg, files, plan, log)
    if base_exact_match is not None and trainer.progress.base_exact_match is None:
        trainer.progress.base_exact_match = base_exact_match

    evaluator = None
    if t.eval_every and eval_data is not None:
        sample = t.eval_every_sample if cfg.data.format != "text" else 0
        evaluator = PeriodicEval(
            model, tokenizer, eval_data, pad_id, t.precision, t.eval_batch_size,
            t.max_new_tokens, sample, events, faults,
        )  # fmt: skip
    run.started = True
    run_loop(trainer, cfg, files, log, evaluator)
    save_final(
        model, tokenizer, files.run_dir / "final", _base_path(cfg.model.path),
        cfg.model.gguf_file, cfg.model.rope_scaling, quantization,
    )  # fmt: skip
    results: dict[str, Any] = {"final_train_loss": trainer.progress.last_loss}
    if eval_data is not None:
        merge_for_inference(model)
        preds = files.run_dir / "eval_predictions.jsonl" if t.eval_exact_match else None
        results |= evaluate_after(
            model, tokenizer, eval_data, pad_id, t.precision, t.eval_batch_size,
            t.max_new_tokens, preds, events, faults, trainer.state.step,
        )  # fmt: skip
    results["wall_time_s"] = round(time.perf_counter() - started, 2)  # this invocation
    return write_summary(
        files.run_dir, trainer.state, trainer.progress, trainable, total, results, log
    )


def _run_files(cfg: Config, inputs: list[Path]) -> RunFiles:
    """The run's paths and resolved config (written by `start_state`, never over an input)."""
    run_dir = cfg.run_dir
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    write = check_config_writable(run_dir, text, inputs)
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    return RunFiles(run_dir, ckpt_dir, cfg.train.keep_last, text, write)


def _device(cfg: Config) -> tuple[torch.device, TrainConfig, str | None]:
    """The device, `cfg.train` with train.precision=auto resolved for it (a resumed run keeps
    the precision it started with), and the line that says what auto chose and why."""
    device = pick_device(cfg.train.device)
    compute = cfg.method.compute_dtype if cfg.method.name == "qlora" else "auto"
    recorded = recorded_precision(cfg.run_dir)
    choice = resolve_precision(cfg.train.precision, device.type, recorded, compute)
    return device, replace(cfg.train, precision=choice.precision), choice.note


def _explained(exc: Interrupted, ckpt_dir: Path) -> Interrupted:
    """A signal that stopped `train` at once, with where the run can go on from."""
    if exc.message:
        return exc
    done = list_complete_checkpoints(ckpt_dir)
    where = (
        f"the newest checkpoint is {done[-1]}; the same command resumes from it"
        if done
        else "no checkpoint was written; the same command starts over"
    )
    return Interrupted(exc.signum, exc.at_boundary, f"{exc.name}: stopped at once; {where}.")


def build_trainer(
    cfg: Config,
    model: nn.Module,
    params: dict[str, nn.Parameter],
    train_data: PreparedData,
    pad_id: int,
    device: torch.device,
    events: EventLog,
    faults: FaultHooks,
    stop: StopSignals | None = None,
    global_batch: int | None = None,
) -> Trainer:
    """Optimizer, schedule, scaler, sample stream and guard around the wrapped model.

    `cfg.train` has its steps and micro-batch resolved; `global_batch` (default micro-batch x
    grad_accum, or every row when there are fewer) is the rows per step.
    """
    t = cfg.train
    assert t.max_steps is not None and t.micro_batch_size != "auto", "resolved by train()"
    rows = len(train_data.rows)
    global_batch = global_batch or min(t.micro_batch_size * t.grad_accum, rows)
    lr = t.lr if t.lr is not None else DEFAULT_LR[cfg.method.name]
    optimizer = build_optimizer(params, lr, t.weight_decay, t.optimizer, device.type)
    budget = parse_memory_size(t.memory_budget, "train.memory_budget") if t.memory_budget else None
    schedule = default_schedule(t.max_steps, t.warmup_ratio, t.min_lr_ratio)
    return Trainer(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, t.max_steps, t.warmup_ratio, t.min_lr_ratio),
        scaler=make_grad_scaler(t.precision, device.type),
        stream=SampleStream(rows, t.seed),
        data=train_data,
        pad_id=pad_id,
        device=device,
        state=TrainingState(step=0, micro_batches_seen=0),
        progress=RunProgress(schedule=schedule),
        global_batch=global_batch,
        micro_batch_size=min(t.micro_batch_size, global_batch),
        events=events,
        guard=guard_settings(cfg.guard),
        budget=MemoryBudget(budget),
        faults=faults,
        levers=levers_message(int(cfg.data.max_seq_len), t.gradient_checkpointing, cfg.method.name),
        stop=stop if stop is not None else StopSignals(),
    )


def start_state(tr: Trainer, cfg: Config, files: RunFiles, plan: ResumePlan, log: Log) -> None:
    """Resume or continue as `plan` says, record the run, lift a pause, and make sure a
    rollback has a checkpoint to go to."""
    if plan.action != "fresh":
        check_weights_fit(plan, tr.params)
        restore(tr, files.ckpt_dir, log)
        use_schedule(tr.scheduler, recorded_schedule(tr.progress, cfg.train))
        if plan.action == "force":
            lr = cfg.train.lr if cfg.train.lr is not None else DEFAULT_LR[cfg.method.name]
            apply_force(
                tr.optimizer, tr.scheduler, tr.params, tr.state, tr.progress, cfg.train, lr, plan,
                log,
            )  # fmt: skip
    if files.write_config:
        write_file(files.run_dir / "config.yaml", files.config_yaml)
    if plan.action == "force":
        # The checkpoint holds the forced settings before the record says the run has them.
        checkpoint(tr, files.ckpt_dir, files.keep_last, files.config_yaml)
    write_record(files.run_dir, plan.fingerprint, plan.split)
    lift_pause(files.run_dir / PAUSED_MARKER, tr.events, tr.state.step, log)
    g = cfg.guard
    rollback_on = "rollback" in (g.nonfinite, g.loss_spike, g.grad_norm)
    if rollback_on and latest_checkpoint(files.ckpt_dir) is None:
        checkpoint(tr, files.ckpt_dir, files.keep_last, files.config_yaml)


def run_loop(
    tr: Trainer, cfg: Config, files: RunFiles, log: Log, evaluator: PeriodicEval | None = None
) -> None:
    """Steps until `train.max_steps` updates are applied; evaluates and checkpoints as
    configured. A stop signal ends it with a checkpoint of the last applied step.

    Raises:
        Interrupted: SIGTERM or SIGINT arrived (the message says where the checkpoint is).
    """
    t = cfg.train
    assert t.max_steps is not None, "resolved by train()"
    metrics = MetricsLog(files.run_dir / "metrics.jsonl", tr.state.step)
    eval_path = files.run_dir / "eval.jsonl"
    eval_log = MetricsLog(eval_path, tr.state.step) if evaluator is not None else None
    bar = progress_bar(t.max_steps, tr.state.step, cfg.run.progress)
    tr.model.train()
    try:
        with tr.stop.deferred():
            while tr.state.step < t.max_steps:
                try:
                    result = train_step(tr, t.precision, t.max_grad_norm, t.kl_coef)
                except OutOfMemoryAtMinimum as exc:
                    path = checkpoint(tr, files.ckpt_dir, t.keep_last, files.config_yaml)
                    tr.events.emit("oom", tr.state.step + 1, f"{exc} Checkpoint {path}.")
                    raise
                # tr.progress, not a local alias: a rollback replaces it.
                tr.progress.train_time_s += result.record["step_time_s"]
                if result.decision.action != "step" and act_on_guard(tr, result, files, cfg.guard):
                    metrics = MetricsLog(files.run_dir / "metrics.jsonl", tr.state.step)
                    eval_log = (
                        MetricsLog(eval_path, tr.state.step) if eval_log is not None else None
                    )
                    bar.n = tr.state.step
                    bar.refresh()
                    continue
                if not result.decision.applies_update:
                    continue
                record = result.record
                tr.progress.last_loss = record["loss"]
                metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
                step = tr.state.step
                if evaluator is not None and eval_log is not None and step % t.eval_every == 0:
                    row = evaluator(step)
                    eval_log.write(row)
                    log(", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
                if (t.save_every and step % t.save_every == 0) or step == t.max_steps:
                    _periodic_checkpoint(tr, files)
    except Interrupted as exc:
        if not exc.at_boundary:
            raise
        raise _stopped(tr, files, exc) from None
    finally:
        bar.close()


def _periodic_checkpoint(tr: Trainer, files: RunFiles) -> None:
    """A scheduled save; weights gone NaN/inf stop the run, and events.jsonl says so."""
    try:
        checkpoint(tr, files.ckpt_dir, files.keep_last, files.config_yaml)
    except WeightsDiverged as exc:
        tr.events.emit("stop", tr.state.step, f"stopped; {exc}", checkpoint=None)
        raise


def _stopped(tr: Trainer, files: RunFiles, exc: Interrupted) -> Interrupted:
    """Checkpoint the last applied step after a stop signal; the error to exit with."""
    path = checkpoint(tr, files.ckpt_dir, files.keep_last, files.config_yaml)
    step = tr.state.step
    message = f"{exc.name}: stopped before step {step + 1}; checkpoint {path} (step {step})"
    tr.events.emit("signal", step + 1, message, checkpoint=str(path))
    return Interrupted(exc.signum, True, f"{message}. Run the same command to resume from it.")


def _base_path(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path
