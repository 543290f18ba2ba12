"""The run's components, built by the recipe's `set_up` in dependency order: the run's files,
the tokenizer, the base model, the method's wrapping around it, the periodic evaluator, the
`Trainer` (optimizer, schedule, scaler, sample stream, guard), a preference objective's step,
and the trainer's start state (fresh, resumed or forced, as the run directory's record allows).

`Session` is what set-up hands the loop and `training.finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import COMPILE_ONE_PROCESS, Config, parse_memory_size, to_dict
from leantune.config.parse import ConfigError
from leantune.core.optim import build_optimizer, build_scheduler, default_schedule, use_schedule
from leantune.core.precision import AUTOCAST_DTYPES, make_grad_scaler
from leantune.core.signals import StopSignals
from leantune.core.threads import ThreadGovernor
from leantune.data.dataset import PreparedData
from leantune.data.loader import SampleStream
from leantune.data.templates import apply_chat_template
from leantune.layout import RunPaths
from leantune.methods.coverage import Coverage, coverage_of
from leantune.methods.frozen import store_frozen_linears
from leantune.methods.registry import (
    DEFAULT_LR,
    METHODS,
    apply_method,
    init_line,
    trainable_named_parameters,
)
from leantune.models.loading import (
    ModelSource,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
)
from leantune.models.output_head import output_head
from leantune.models.quantize import Quantization
from leantune.monitor.events import EventLog, lift_pause
from leantune.monitor.sinks import Sinks
from leantune.monitor.step_stats import StepStats
from leantune.objectives.batch import with_reference
from leantune.objectives.registry import reference_kind
from leantune.training.evaluation import (
    EvalInputs,
    EvalSettings,
    Evaluator,
    PeriodicEval,
    PreferenceEval,
)
from leantune.training.guard.oom import MemoryBudget, levers_message
from leantune.training.hooks import StepHooks
from leantune.training.parallel.strategy import ParallelStrategy, SingleProcess
from leantune.training.preference_setup import reference_for
from leantune.training.run.resume import (
    ResumePlan,
    apply_force,
    check_weights_fit,
    recorded_schedule,
)
from leantune.training.run.rundir import check_config_writable, write_file, write_record
from leantune.training.run_setup import (
    RunSetup,
    check_ids_fit,
    guard_settings,
    seed_everything,
)
from leantune.training.state.checkpoint import TrainingState, latest_checkpoint
from leantune.training.state.progress import RunProgress
from leantune.training.trainer import RunFiles, StepSettings, Trainer

Log = Callable[[str], None]


def quiet(_: str) -> None:
    """The log of every rank but 0, and of set-up work done a second time."""


@dataclass(frozen=True)
class LoopSettings:
    """When the loop ends, evaluates and saves."""

    max_steps: int
    eval_every: int
    save_every: int


@dataclass
class Session:
    """Everything `set_up` built, for the loop and `finish`."""

    cfg: Config
    """The resolved config: run name, precision, lengths, steps and micro-batch filled in."""
    tokenizer: PreTrainedTokenizerBase
    model: nn.Module
    quantization: Quantization | None
    trainer: Trainer
    loop: LoopSettings
    eval_inputs: EvalInputs | None
    eval_settings: EvalSettings
    evaluator: Evaluator | None
    coverage: Coverage
    """What the method adapts, with the (trainable, total) parameter counts."""
    load_peak_bytes: int | None = None
    """CPU: the process's peak before training (loading; `start_training_memory`)."""
    preference_eval: PreferenceEval | None = None
    """A preference objective with data.eval: its held-out evaluation (the closing one too)."""


def run_files(cfg: Config, inputs: list[Path], main: bool = True) -> RunFiles:
    """The run's paths and resolved config (written by `start_state`, never over an input,
    and only by the main process)."""
    run_dir = cfg.run_dir
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    write = check_config_writable(run_dir, text, inputs) and main
    ckpt_dir = RunPaths(run_dir).checkpoints
    ckpt_dir.mkdir(exist_ok=True)
    return RunFiles(run_dir, ckpt_dir, cfg.train.keep_last, text, write)


def tokenizer_for(cfg: Config, source: ModelSource, log: Log) -> PreTrainedTokenizerBase:
    """The model's tokenizer with data.chat_template in place (saved with final/)."""
    tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    for warning in apply_chat_template(tokenizer, cfg.data.chat_template):
        log(f"warning: {warning}")
    return tokenizer


def base_model(
    cfg: Config,
    source: ModelSource,
    quantization: Quantization | None,
    device: torch.device,
    run: RunSetup | None = None,
    log: Log = quiet,
) -> nn.Module:
    """The base model on `device`; with `run`, its embedding checked against the run's ids;
    `log` hears why the loss must use the model's own forward when the loader's check found
    so (once per run: the rebuilt final model stays quiet)."""
    m = cfg.model
    model: nn.Module = load_model(
        source,
        dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        attn_implementation=m.attn_implementation,
        rope_scaling=m.rope_scaling,
        quantization=quantization,
        device=device,
    )
    model.to(device)  # in place (the quantised load is already there)
    note = output_head(model).note
    if note:
        log(f"warning: {note}")
    if run is not None:
        check_ids_fit(model, run)
    return model


def wrap_method(
    cfg: Config, model: nn.Module, strategy: ParallelStrategy, log: Log
) -> tuple[nn.Module, nn.Module, dict[str, nn.Parameter], Coverage]:
    """The method's wrapping, checkpointing, then the strategy's.

    Returns:
        The model with the method; the model as the loop trains it (the strategy's wrapping
        around it, or the same model); its trainable parameters; and what the method adapts,
        with the (trainable, total) counts.
    """
    # Seeded here: the method's new weights start from the seed, the same on every rank.
    seed_everything(cfg.train.seed)
    model = apply_method(model, cfg.method)
    if (line := init_line(model, cfg.method)) is not None:
        log(line)
    _store_frozen(cfg, model, strategy, log)
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    coverage = coverage_of(model, cfg.method.name)
    for line in coverage.lines():  # the counts, and what is adapted in which family
        log(line)
    if cfg.train.compile:
        _compile(model, strategy, log)
    trained = strategy.wrap_model(model)  # in place, or around it: `model` stays unwrapped
    # Read after the strategy's wrapping: FSDP2 replaces the parameters with shards.
    return model, trained, trainable_named_parameters(model), coverage


def _store_frozen(cfg: Config, model: nn.Module, strategy: ParallelStrategy, log: Log) -> None:
    """Under autocast, the frozen base's linear weights in the autocast dtype
    (`methods.frozen`): the same products without a cast per forward or a copy per layer."""
    low = AUTOCAST_DTYPES.get(cfg.train.precision)
    # A method that trains base weights saves them; sharded strategies flatten each unit's
    # parameters into one buffer of one dtype.
    if low is None or METHODS[cfg.method.name].trains_base_weights or strategy.shards_parameters:
        return
    if freed := store_frozen_linears(model, low):
        log(
            f"frozen linear weights stored in {cfg.train.precision}, the dtype their matmuls "
            f"run in: {freed / 2**20:.0f} MiB less, no cast per forward"
        )


def _compile(model: nn.Module, strategy: ParallelStrategy, log: Log) -> None:
    """train.compile: the blocks' training forward compiled (one process only).

    Raises:
        ConfigError: under torchrun (`validate` refuses the other strategies).
    """
    # Deferred: it loads FSDP2's module (and through it torchao), ~3.5 s that only
    # train.compile needs.
    from leantune.training.compile import compile_blocks

    if not isinstance(strategy, SingleProcess):
        raise ConfigError(COMPILE_ONE_PROCESS.format(strategy="auto (ddp under torchrun)"))
    blocks = compile_blocks(model)
    log(f"train.compile: {blocks} blocks compile on their first training steps")


def periodic_eval(
    cfg: Config, model: nn.Module, inputs: EvalInputs | None, settings: EvalSettings
) -> PeriodicEval | None:
    """train.eval_every's evaluator, on the unwrapped model (None when it is off)."""
    if not cfg.train.eval_every or inputs is None:
        return None
    # Plain text has no prompt to answer, so its periodic evaluation is the loss only.
    sample = cfg.train.eval_every_sample if cfg.data.format != "text" else 0
    return PeriodicEval(model, inputs, settings, sample)


def evaluators(
    cfg: Config,
    run: RunSetup,
    model: nn.Module,
    inputs: EvalInputs | None,
    settings: EvalSettings,
    pad_id: int,
    *,
    events: EventLog,
    hooks: StepHooks,
    log: Log,
) -> tuple[Evaluator | None, PreferenceEval | None]:
    """train.eval_every's evaluator (None when it is off) and a preference objective's
    held-out evaluation, which also closes the run (None without data.eval)."""
    scored = preference_eval(cfg, run, model, pad_id, settings, events, hooks, log)
    if scored is not None:
        return (scored if cfg.train.eval_every else None), scored
    return periodic_eval(cfg, model, inputs, settings), None


def preference_eval(
    cfg: Config,
    run: RunSetup,
    model: nn.Module,
    pad_id: int,
    settings: EvalSettings,
    events: EventLog,
    hooks: StepHooks,
    log: Log,
) -> PreferenceEval | None:
    """A preference objective's evaluation on data.eval (None without it); for full and freeze
    with the reference's log-probs of the eval sequences computed now, before training."""
    step = run.preference.eval_step(cfg) if run.preference is not None else None
    if step is None:
        return None
    if step.spec.needs_reference and METHODS[cfg.method.name].trains_base_weights:
        # Before start_state, as the train sequences' (`preference_objective`): the model
        # before a resume restores its trained weights is the reference.
        device = next(model.parameters()).device
        step = with_reference(step, model, device, cfg.train.precision, pad_id)
        log(f"reference: the log-probs of {len(step.rows)} held-out examples, computed once")
    return PreferenceEval(model, step, pad_id, settings, events, hooks)


def build_trainer(
    cfg: Config,
    *,
    model: nn.Module,
    params: dict[str, nn.Parameter],
    data: PreparedData,
    pad_id: int,
    device: torch.device,
    events: EventLog,
    hooks: StepHooks,
    files: RunFiles,
    sinks: Sinks,
    stop: StopSignals,
    global_batch: int,
    strategy: ParallelStrategy,
    stats: StepStats | None = None,
) -> Trainer:
    """Optimizer, schedule, scaler, sample stream and guard around the wrapped model.

    `cfg.train` has its steps and micro-batch resolved; `global_batch` is the rows per step.
    """
    t = cfg.train
    assert t.max_steps is not None and t.micro_batch_size != "auto", "resolved by set_up_run"
    # Unset, the method's own rate: the methods' best rates span 1e-4 (full) to 3e-2 (prompt
    # tuning), so no one default serves them all.
    lr = t.lr if t.lr is not None else DEFAULT_LR[cfg.method.name]
    optimizer = build_optimizer(params, lr, t.weight_decay, t.optimizer, device.type)
    optimizer = strategy.prepare_optimizer(optimizer)  # DeepSpeed's engine takes it over
    budget = parse_memory_size(t.memory_budget, "train.memory_budget") if t.memory_budget else None
    # Kept in the run's progress: a resume follows the schedule its checkpoint records
    # (`recorded_schedule`).
    schedule = default_schedule(t.max_steps, t.warmup_ratio, t.min_lr_ratio)
    return Trainer(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, t.max_steps, t.warmup_ratio, t.min_lr_ratio),
        scaler=make_grad_scaler(t.precision, device.type),
        # The order is the seed's alone: a resume at `samples_seen` reads the same rows.
        stream=SampleStream(len(data.rows), t.seed),
        data=data,
        pad_id=pad_id,
        device=device,
        state=TrainingState(step=0, micro_batches_seen=0),
        progress=RunProgress(schedule=schedule),
        global_batch=global_batch,
        # Data with fewer rows than the configured batch shrinks the window below it.
        micro_batch_size=min(t.micro_batch_size, global_batch),
        events=events,
        guard=guard_settings(cfg.guard),
        settings=StepSettings(t.precision, t.max_grad_norm, t.kl_coef),
        files=files,
        sinks=sinks,
        strategy=strategy,
        budget=MemoryBudget(budget),
        hooks=hooks,
        levers=levers_message(
            int(cfg.data.max_seq_len), t.gradient_checkpointing is True, cfg.method.name
        ),
        stop=stop,
        stats=stats if stats is not None else StepStats(),
        threads=ThreadGovernor.for_process() if device.type == "cpu" else None,
    )


def preference_objective(
    cfg: Config,
    run: RunSetup,
    trainer: Trainer,
    trained: nn.Module,
    device: torch.device,
    pad_id: int,
    log: Log,
) -> None:
    """Give the trainer its preference objective's step (and the reference it needs).

    Under torchrun every rank computes the reference's log-probs of every sequence, through
    `trained` (FSDP2's forward is collective, so all ranks run the same forwards); each then
    reads those of its own shard of each window."""
    assert run.preference is not None
    trainer.objective = run.preference.step(cfg)
    spec = trainer.objective.spec
    kind = reference_kind(spec, METHODS[cfg.method.name].trains_base_weights, cfg.train.reference)
    if kind in ("precomputed", "live"):
        # Before start_state: a resume's restore has not yet put the trained weights in.
        fingerprint = run.plan.fingerprint.fields
        trainer.objective = reference_for(
            cfg, fingerprint, trainer.objective, trained, device, pad_id, log
        )


def start_state(
    tr: Trainer, cfg: Config, plan: ResumePlan, log: Log, base_exact_match: float | None = None
) -> None:
    """Resume or continue as `plan` says, record the run, lift a pause, and make sure a
    rollback has a checkpoint to go to; `base_exact_match` is kept unless a resume restored
    the one measured on the first start."""
    files = tr.files
    if plan.action != "fresh":
        check_weights_fit(plan, tr.params)  # before restore: a mismatch would fail half-way
        tr.restore(log)
        use_schedule(tr.scheduler, recorded_schedule(tr.progress, cfg.train))
        if plan.action == "force":
            lr = cfg.train.lr if cfg.train.lr is not None else DEFAULT_LR[cfg.method.name]
            apply_force(
                optimizer=tr.optimizer,
                scheduler=tr.scheduler,
                params=tr.params,
                state=tr.state,
                progress=tr.progress,
                t=cfg.train,
                lr=lr,
                plan=plan,
                log=log,
            )
    if files.write_config:
        write_file(RunPaths(files.run_dir).config, files.config_yaml)
    if plan.action == "force":
        # The checkpoint holds the forced settings before the record says the run has them.
        tr.save()
    main = tr.strategy.is_main_process
    if main:
        write_record(files.run_dir, plan.fingerprint, plan.split, files.started_from)
        lift_pause(RunPaths(files.run_dir).paused, tr.events, tr.state.step, log)
    # A rollback before the first periodic save would have nowhere to go: save the start.
    g = cfg.guard
    rollback_on = "rollback" in (g.nonfinite, g.loss_spike, g.grad_norm)
    none_yet = rollback_on and main and latest_checkpoint(files.ckpt_dir) is None
    if tr.strategy.agree(int(none_yet)):  # every rank saves, or none
        tr.save()
    if tr.progress.base_exact_match is None:
        tr.progress.base_exact_match = base_exact_match
