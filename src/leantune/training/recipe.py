"""The training recipe: one lifecycle for every method and objective, in the order it runs.

    train(cfg)                      claim the run directory, handle stop signals
      set_up(...) -> Session        build every component, in dependency order:
                                    device/precision -> run check -> files/events -> tokenizer
                                    -> data -> base model -> method -> trainer -> start state
      run_loop(trainer, ...)        steps until max_steps: trainer.train_step, guard actions,
                                    sinks (metrics.jsonl, progress bar, ...), evals, saves
      finish(session, ...)          final/ weights, the closing evaluation, summary.json

The method only decides how the model is wrapped and which parameters train; the loop never
branches on it, nor on the parallel strategy or the sinks (`training.trainer`,
`training.strategy`, `training.sinks`). The objective forks the data (SFT rows, or packed
preference pairs: `training.preference_setup`) and the window's loss (`trainer.accumulate`:
the token loss, or the preference objective through its spec: `training.preference_step`).

Two things can interrupt a step. An out-of-memory error halves the micro-batch and replays the
same window of samples (`trainer.accumulate`). The stability guard may skip the update, pause
the run, roll back to the last checkpoint or stop (`training.guard_actions`). Every such
decision is an event in `events.jsonl`.

The run directory is claimed first (`training.rundir`: a lock, no foreign folder) and its
record decides whether the checkpoint there may be continued (`training.resume_policy`). A
SIGTERM, SIGINT or SIGHUP stops at the next micro-batch boundary with a checkpoint of the last
applied step (`training.signals`, checked in `trainer.accumulate` only).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import (
    COMPILE_ONE_PROCESS,
    Config,
    parse_memory_size,
    to_dict,
)
from leantune.config.parse import ConfigError
from leantune.core.allocator import allocator_note, mapped_allocator
from leantune.core.optim import build_optimizer, build_scheduler, default_schedule, use_schedule
from leantune.core.precision import (
    make_grad_scaler,
    pick_device,
    resolve_precision,
)
from leantune.core.signals import Interrupted, StopSignals
from leantune.core.threads import configure_threads
from leantune.data.dataset import PreparedData
from leantune.data.loader import SampleStream
from leantune.data.templates import apply_chat_template
from leantune.layout import RunPaths
from leantune.methods.artifacts import save_final
from leantune.methods.checks import effective_pack
from leantune.methods.coverage import Coverage, coverage_of
from leantune.methods.registry import (
    DEFAULT_LR,
    METHODS,
    apply_method,
    base_quantization,
    compute_dtype,
    merge_for_inference,
    trainable_named_parameters,
)
from leantune.models.attention import resolve_attention
from leantune.models.loading import (
    ModelSource,
    check_tokenizer_files,
    enable_gradient_checkpointing,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from leantune.models.output_head import output_head
from leantune.models.quantize import Quantization
from leantune.monitor.events import (
    EventLog,
    OutOfMemoryAtMinimum,
    TrainingHalted,
    lift_pause,
)
from leantune.monitor.metrics import memory_stats, start_training_memory
from leantune.monitor.report import report_at_end
from leantune.monitor.sinks import Sinks
from leantune.monitor.step_stats import StepStats
from leantune.objectives.batch import with_reference
from leantune.training.checks import check_config
from leantune.training.evaluation import (
    EvalInputs,
    EvalSettings,
    PeriodicEval,
    evaluate_after,
    exact_match_before,
)
from leantune.training.faults import KILL_ENV, FaultHooks, signal_at_start
from leantune.training.guard.actions import act_on_guard
from leantune.training.guard.divergence import WeightsDiverged
from leantune.training.guard.oom import MemoryBudget, levers_message
from leantune.training.parallel.launch import launched_world_size
from leantune.training.parallel.strategy import ParallelStrategy, SingleProcess
from leantune.training.run.refused_writes import (
    keep_trained_steps,
    refused_write,
    with_resume_point,
)
from leantune.training.run.resume import (
    ResumePlan,
    apply_force,
    check_weights_fit,
    recorded_precision,
    recorded_schedule,
    recorded_setting,
)
from leantune.training.run.rundir import (
    RunDir,
    RunDirError,
    check_config_writable,
    claim_run_dir,
    write_file,
    write_record,
)
from leantune.training.run.summary import write_summary
from leantune.training.run_monitoring import monitoring
from leantune.training.run_setup import (
    RunSetup,
    check_ids_fit,
    check_resumable,
    guard_settings,
    named_run,
    seed_everything,
    set_up_run,
    with_objective_format,
)
from leantune.training.state.checkpoint import (
    TrainingState,
    latest_checkpoint,
    list_complete_checkpoints,
)
from leantune.training.state.progress import RunProgress
from leantune.training.trainer import RunFiles, StepResult, StepSettings, Trainer, train_step

Log = Callable[[str], None]
# Test hook: SIGKILL this process right after the backward of this global micro-batch index.
FAULT_ENV = KILL_ENV

__all__ = ["FAULT_ENV", "Session", "StepResult", "Trainer", "train"]


# ---------------------------------------------------------------------------------------------
# The entry point and the lifecycle


def train(cfg: Config, log: Log = print, config_file: Path | None = None) -> dict[str, Any]:
    """Run (or resume) a fine-tune described by `cfg`; returns the run summary.

    Args:
        cfg: The run's config (never modified: the run resolves its own copy).
        log: Where progress lines go.
        config_file: The YAML file `cfg` came from; it is never overwritten.

    Raises:
        UserError: the run directory is not this run's to write (`RunDirError`), or holds a
            run that this config does not describe (`RunMismatch`); exit code 2.
        TrainingHalted: the guard paused or stopped the run, or one sequence does not fit in
            memory; its `exit_code` is what the CLI returns.
        Interrupted: SIGTERM, SIGINT or SIGHUP; during training after a checkpoint of the last
            applied step. Exit code 143, 130 or 129.
    """
    started = time.perf_counter()
    warnings = check_config(cfg)
    cfg = copy.deepcopy(cfg)  # what the run resolves (its name, lengths, steps) stays its own
    cfg = with_objective_format(cfg)  # in the run's name and record as the format it reads
    source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    cfg = named_run(cfg, source.location, source.gguf_file)
    strategy = parallel_strategy(cfg)  # run.dir known: a resumed run keeps its precision
    log = log if strategy.is_main_process else _quiet  # rank 0 speaks for the run
    for warning in warnings:
        log(f"warning: {warning}")
    log(f"run directory: {cfg.run_dir}")  # a derived name changes with the settings
    inputs = [config_file] if config_file else []
    with StopSignals() as stop, _claimed(cfg, strategy, log) as run:
        try:
            return _lifecycle(cfg, source, run, stop, inputs, log, started, strategy)
        except Interrupted as exc:
            raise _explained(exc, RunPaths(cfg.run_dir).checkpoints) from None


def _lifecycle(
    cfg: Config,
    source: ModelSource,
    run: RunDir,
    stop: StopSignals,
    inputs: list[Path],
    log: Log,
    started: float,
    strategy: ParallelStrategy,
) -> dict[str, Any]:
    """Set up, loop, finish: `train` inside its claimed run directory."""
    signal_at_start()
    try:
        session = set_up(cfg, source, stop=stop, inputs=inputs, log=log, strategy=strategy)
    except Exception as exc:  # a full disk while preparing data, writing the record, ...
        refused = refused_write(exc, cfg.run_dir)
        if refused is None:
            raise
        raise with_resume_point(refused, RunPaths(cfg.run_dir).checkpoints) from None
    if session.trainer.device.type == "cpu":  # the metrics' peaks are training's from here
        session.load_peak_bytes = start_training_memory()
    run.started = True  # from here on, a failure leaves the run directory as it is
    try:
        run_loop(session.trainer, session.loop, session.evaluator)
        return finish(session, log=log, started=started)
    except TrainingHalted:  # paused or stopped: the report shows why
        if session.cfg.monitor.report and strategy.is_main_process:
            report_at_end(cfg.run_dir, log)
        raise
    except Exception as exc:  # a full disk between saves: the trained steps are kept if they can
        refused = refused_write(exc, cfg.run_dir)
        if refused is None:
            raise
        raise keep_trained_steps(session.trainer, refused) from None


def _quiet(_: str) -> None:
    """The log of every rank but 0."""


@contextlib.contextmanager
def _claimed(cfg: Config, strategy: ParallelStrategy, log: Log) -> Iterator[RunDir]:
    """The main process claims the run directory (`claim_run_dir`); the others wait until it
    has, and learn whether it could."""
    if not strategy.is_main_process:
        if strategy.agree(0):
            raise RunDirError(f"rank 0 could not claim {cfg.run_dir}: see its error")
        yield RunDir(cfg.run_dir)
        return
    with contextlib.ExitStack() as stack:
        try:
            run = stack.enter_context(claim_run_dir(cfg.run_dir, cfg.run.resume == "never", log))
        except BaseException:
            strategy.agree(1)
            raise
        strategy.agree(0)
        yield run


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
    evaluator: PeriodicEval | None
    coverage: Coverage
    """What the method adapts, with the (trainable, total) parameter counts."""
    load_peak_bytes: int | None = None
    """CPU: the process's peak before training (loading; `start_training_memory`)."""


# ---------------------------------------------------------------------------------------------
# Set-up: every component, in the order each needs the last


def set_up(
    cfg: Config,
    source: ModelSource,
    *,
    stop: StopSignals,
    inputs: list[Path],
    log: Log,
    strategy: ParallelStrategy | None = None,
) -> Session:
    """Build the run's components in dependency order and put the trainer at its start state
    (fresh, resumed or forced, as the run directory's record allows)."""
    strategy = strategy if strategy is not None else parallel_strategy(cfg)
    main = strategy.is_main_process
    # Device and precision first: the fingerprint records the resolved precision.
    device, cfg, notes = _resolve_device(cfg)
    cfg, attention_note = _resolve_attention(cfg, source)  # refuses one the model cannot use
    notes += [attention_note] if attention_note else []
    check_resumable(cfg, source.location, source.gguf_file)  # before anything is written
    for note in notes:  # once the run directory's run is known to be this one
        log(note)
    files = _run_files(cfg, inputs, main)
    events = EventLog(RunPaths(files.run_dir).events if main else None, log)
    faults = FaultHooks()
    seed_everything(cfg.train.seed)
    # Tokenizer -> data: the data resolves the lengths, the steps and the micro-batch.
    tokenizer = _tokenizer(cfg, source, log)
    # Rank 0 first: it may prepare the data cache and tidy the checkpoints the others read.
    world = launched_world_size()
    run = _in_turn(strategy, lambda: set_up_run(cfg, source, tokenizer, device.type, log, world))
    cfg, t = run.cfg, run.cfg.train
    pad_id, held_out = int(tokenizer.pad_token_id), run.eval_data
    settings = EvalSettings(t.precision, t.eval_batch_size, t.max_new_tokens)
    eval_inputs = EvalInputs(tokenizer, held_out, pad_id, events, faults) if held_out else None
    # Base model -> its exact match -> the method's wrapping -> the trainer around it.
    quantization = base_quantization(cfg.method, t.precision)
    model = _base_model(cfg, source, quantization, device, run, log)
    base_exact_match = None
    if t.eval_exact_match and t.eval_base and eval_inputs and run.plan.action == "fresh":
        # On the bare base model, before any adapter exists (an untrained adapter is a no-op
        # that would only cost time). All ranks evaluate: none idles in a collective meanwhile.
        base_exact_match = exact_match_before(model, eval_inputs, settings, log)
    model, trained, params, coverage = _wrap(cfg, model, strategy, log)
    evaluator = _periodic_eval(cfg, model, eval_inputs, settings)  # on every rank, as above
    # The trainer, its sinks (events reach them too), then its start state.
    stats, sinks = monitoring(cfg, run, files, events, model, device, strategy, evaluator, log)
    trainer = build_trainer(
        cfg,
        model=trained,
        params=params,
        data=run.train_data,
        pad_id=pad_id,
        device=device,
        events=events,
        faults=faults,
        files=files,
        sinks=sinks,
        stop=stop,
        global_batch=run.global_batch,
        strategy=strategy,
        stats=stats,
    )
    if run.preference is not None:
        _preference_objective(cfg, run, trainer, trained, strategy, device, pad_id, log)
    strategy.agree(0)  # every rank has read the run directory before rank 0 writes to it
    start_state(trainer, cfg, run.plan, log)
    if base_exact_match is not None and trainer.progress.base_exact_match is None:
        trainer.progress.base_exact_match = base_exact_match
    assert t.max_steps is not None, "resolved by set_up_run"
    return Session(
        cfg=cfg,
        tokenizer=tokenizer,
        model=model,
        quantization=quantization,
        trainer=trainer,
        loop=LoopSettings(t.max_steps, t.eval_every, t.save_every),
        eval_inputs=eval_inputs,
        eval_settings=settings,
        evaluator=evaluator,
        coverage=coverage,
    )


def _preference_objective(
    cfg: Config,
    run: RunSetup,
    trainer: Trainer,
    trained: nn.Module,
    strategy: ParallelStrategy,
    device: torch.device,
    pad_id: int,
    log: Log,
) -> None:
    """Give the trainer its preference objective's step (and the reference it needs)."""
    assert run.preference is not None
    if not isinstance(strategy, SingleProcess):
        raise ConfigError(
            f"train.objective={cfg.train.objective}: not yet under torchrun (one process "
            "only in this version); run it without torchrun"
        )
    trainer.objective = run.preference.step(cfg)
    if trainer.objective.spec.needs_reference and METHODS[cfg.method.name].trains_base_weights:
        # Before start_state: a resume's restore has not yet put the trained weights in.
        trainer.objective = with_reference(
            trainer.objective, trained, device, cfg.train.precision, pad_id
        )
        log(
            f"reference: the log-probs of {len(run.train_data.examples)} sequences, "
            f"computed once by the model before training (method.name={cfg.method.name} "
            "keeps no second copy)"
        )


def _tokenizer(cfg: Config, source: ModelSource, log: Log) -> PreTrainedTokenizerBase:
    """The model's tokenizer with data.chat_template in place (saved with final/)."""
    tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    for warning in apply_chat_template(tokenizer, cfg.data.chat_template):
        log(f"warning: {warning}")
    return tokenizer


def _periodic_eval(
    cfg: Config, model: nn.Module, inputs: EvalInputs | None, settings: EvalSettings
) -> PeriodicEval | None:
    """train.eval_every's evaluator, on the unwrapped model (None when it is off)."""
    if not cfg.train.eval_every or inputs is None:
        return None
    sample = cfg.train.eval_every_sample if cfg.data.format != "text" else 0
    return PeriodicEval(model, inputs, settings, sample)


def parallel_strategy(cfg: Config) -> ParallelStrategy:
    """How this run is spread over processes (`dist:`): one process, the whole model and
    window, unless dist.strategy names one or torchrun started this process."""
    from leantune.training.parallel import build_strategy, launched_by_torchrun

    d = cfg.dist
    if d.strategy == "auto" and not launched_by_torchrun():
        return SingleProcess()
    device, resolved, _ = _resolve_device(cfg)
    return build_strategy(
        "ddp" if d.strategy == "auto" else d.strategy,
        backend=d.backend,
        device_type=device.type,
        timeout_s=d.timeout_s,
        bf16=resolved.train.precision == "bf16",
        cpu_offload=d.cpu_offload,
        reshard_after_forward=d.reshard_after_forward,
        zero_stage=d.zero_stage,
        max_grad_norm=resolved.train.max_grad_norm,
    )


def _in_turn(strategy: ParallelStrategy, work: Callable[[], RunSetup]) -> RunSetup:
    """`work()` on the main process, then on the others."""
    if strategy.is_main_process:
        done = work()
        strategy.agree(0)
        return done
    strategy.agree(0)
    return work()


def _resolve_device(cfg: Config) -> tuple[torch.device, Config, list[str]]:
    """The device, `cfg` with train.precision=auto resolved for it (a resumed run keeps the
    precision it started with), and the lines that say how many CPU threads run and what auto
    chose for the precision and why."""
    device = pick_device(cfg.train.device)
    # Threads before the precision probe: it measures (and caches by) the thread count.
    notes: list[str | None] = (
        [configure_threads(), allocator_note()] if device.type == "cpu" else []
    )
    compute = compute_dtype(cfg.method)
    recorded = recorded_precision(cfg.run_dir)
    choice = resolve_precision(cfg.train.precision, device.type, recorded, compute)
    resolved = replace(cfg, train=replace(cfg.train, precision=choice.precision))
    notes.append(choice.note)
    return device, resolved, [n for n in notes if n]


def _resolve_attention(cfg: Config, source: ModelSource) -> tuple[Config, str | None]:
    """`cfg` with model.attn_implementation=auto resolved from the model's config (the
    fingerprint records it), and the line that says why auto fell back, if it did.

    Raises:
        UnsupportedAttention: an explicit model.attn_implementation the model cannot use.
    """
    m = cfg.model
    check_tokenizer_files(source, m.trust_remote_code)  # a folder that is no model, said so
    recorded = recorded_setting(cfg.run_dir, "model.attn_implementation")
    choice = resolve_attention(
        m.attn_implementation,
        packed=effective_pack(cfg.data.pack, cfg.method.name),
        model_config=load_model_config(source, m.trust_remote_code),
        remote_code=m.trust_remote_code,
        recorded=recorded if isinstance(recorded, str) else None,
    )
    return replace(cfg, model=replace(m, attn_implementation=choice.name)), choice.note


def _run_files(cfg: Config, inputs: list[Path], main: bool = True) -> RunFiles:
    """The run's paths and resolved config (written by `start_state`, never over an input,
    and only by the main process)."""
    run_dir = cfg.run_dir
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    write = check_config_writable(run_dir, text, inputs) and main
    ckpt_dir = RunPaths(run_dir).checkpoints
    ckpt_dir.mkdir(exist_ok=True)
    return RunFiles(run_dir, ckpt_dir, cfg.train.keep_last, text, write)


def _base_model(
    cfg: Config,
    source: ModelSource,
    quantization: Quantization | None,
    device: torch.device,
    run: RunSetup | None = None,
    log: Log = _quiet,
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


def _wrap(
    cfg: Config, model: nn.Module, strategy: ParallelStrategy, log: Log
) -> tuple[nn.Module, nn.Module, dict[str, nn.Parameter], Coverage]:
    """The method's wrapping (seeded, so its initialisation is the seed's, on every rank),
    checkpointing, then the strategy's: the model with the method, as the loop trains it
    (the strategy's wrapping around it, or the same model), its trainable
    parameters (as the strategy left them: FSDP2 replaces them with shards) and what the method
    adapts, with the (trainable, total) counts."""
    seed_everything(cfg.train.seed)
    model = apply_method(model, cfg.method)
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    coverage = coverage_of(model, cfg.method.name)
    for line in coverage.lines():  # the counts, and what is adapted in which family
        log(line)
    if cfg.train.compile:
        _compile(model, strategy, log)
    trained = strategy.wrap_model(model)  # in place, or around it: `model` stays unwrapped
    return model, trained, trainable_named_parameters(model), coverage


def _compile(model: nn.Module, strategy: ParallelStrategy, log: Log) -> None:
    """train.compile: the blocks' training forward compiled (one process only).

    Raises:
        ConfigError: under torchrun (`validate` refuses the other strategies).
    """
    from leantune.training.compile import compile_blocks

    if not isinstance(strategy, SingleProcess):
        raise ConfigError(COMPILE_ONE_PROCESS.format(strategy="auto (ddp under torchrun)"))
    blocks = compile_blocks(model)
    log(f"train.compile: {blocks} blocks compile on their first training steps")


def build_trainer(
    cfg: Config,
    *,
    model: nn.Module,
    params: dict[str, nn.Parameter],
    data: PreparedData,
    pad_id: int,
    device: torch.device,
    events: EventLog,
    faults: FaultHooks,
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
    lr = t.lr if t.lr is not None else DEFAULT_LR[cfg.method.name]
    optimizer = build_optimizer(params, lr, t.weight_decay, t.optimizer, device.type)
    optimizer = strategy.prepare_optimizer(optimizer)  # DeepSpeed's engine takes it over
    budget = parse_memory_size(t.memory_budget, "train.memory_budget") if t.memory_budget else None
    schedule = default_schedule(t.max_steps, t.warmup_ratio, t.min_lr_ratio)
    return Trainer(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, t.max_steps, t.warmup_ratio, t.min_lr_ratio),
        scaler=make_grad_scaler(t.precision, device.type),
        stream=SampleStream(len(data.rows), t.seed),
        data=data,
        pad_id=pad_id,
        device=device,
        state=TrainingState(step=0, micro_batches_seen=0),
        progress=RunProgress(schedule=schedule),
        global_batch=global_batch,
        micro_batch_size=min(t.micro_batch_size, global_batch),
        events=events,
        guard=guard_settings(cfg.guard),
        settings=StepSettings(t.precision, t.max_grad_norm, t.kl_coef),
        files=files,
        sinks=sinks,
        strategy=strategy,
        budget=MemoryBudget(budget),
        faults=faults,
        levers=levers_message(
            int(cfg.data.max_seq_len), t.gradient_checkpointing is True, cfg.method.name
        ),
        stop=stop,
        stats=stats if stats is not None else StepStats(),
    )


def start_state(tr: Trainer, cfg: Config, plan: ResumePlan, log: Log) -> None:
    """Resume or continue as `plan` says, record the run, lift a pause, and make sure a
    rollback has a checkpoint to go to."""
    files = tr.files
    if plan.action != "fresh":
        check_weights_fit(plan, tr.params)
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
        write_record(files.run_dir, plan.fingerprint, plan.split)
        lift_pause(RunPaths(files.run_dir).paused, tr.events, tr.state.step, log)
    g = cfg.guard
    rollback_on = "rollback" in (g.nonfinite, g.loss_spike, g.grad_norm)
    none_yet = rollback_on and main and latest_checkpoint(files.ckpt_dir) is None
    if tr.strategy.agree(int(none_yet)):  # every rank saves, or none
        tr.save()


# ---------------------------------------------------------------------------------------------
# The loop


def run_loop(tr: Trainer, loop: LoopSettings, evaluator: PeriodicEval | None = None) -> None:
    """Steps until `loop.max_steps` updates are applied; evaluates and checkpoints as set.
    A stop signal ends it with a checkpoint of the last applied step.

    Raises:
        Interrupted: SIGTERM, SIGINT or SIGHUP arrived (the message says where the checkpoint
            is).
    """
    tr.sinks.start(tr.state.step)
    tr.model.train()
    try:
        with tr.stop.deferred():
            while tr.state.step < loop.max_steps:
                result = _step(tr)
                # tr.progress, not a local alias: a rollback replaces it.
                tr.progress.train_time_s += result.record["step_time_s"]
                if result.decision.action != "step" and act_on_guard(tr, result):
                    tr.sinks.start(tr.state.step)  # rolled back: what came after is gone
                    continue
                if result.decision.applies_update:
                    _after_update(tr, result, loop, evaluator)
    except Interrupted as exc:
        if not exc.at_boundary:
            raise
        raise _stopped(tr, exc) from None
    finally:
        tr.sinks.close()


def _step(tr: Trainer) -> StepResult:
    """One `train_step`; one sequence that does not fit is checkpointed before it stops."""
    try:
        return train_step(tr)
    except OutOfMemoryAtMinimum as exc:
        path = tr.save()
        tr.events.emit("oom", tr.state.step + 1, f"{exc} Checkpoint {path}.")
        raise


def _after_update(
    tr: Trainer, result: StepResult, loop: LoopSettings, evaluator: PeriodicEval | None
) -> None:
    """Report an applied step, then evaluate and save when they are due."""
    tr.progress.last_loss = result.record["loss"]
    tr.sinks.metrics(result.record)
    step = tr.state.step
    if evaluator is not None and step % loop.eval_every == 0:
        tr.sinks.eval(evaluator(step))
    if (loop.save_every and step % loop.save_every == 0) or step == loop.max_steps:
        _periodic_checkpoint(tr)


def _periodic_checkpoint(tr: Trainer) -> None:
    """A scheduled save; weights gone NaN/inf stop the run, and events.jsonl says so."""
    try:
        tr.save()
    except WeightsDiverged as exc:
        tr.events.emit("stop", tr.state.step, f"stopped; {exc}", checkpoint=None)
        raise


def _stopped(tr: Trainer, exc: Interrupted) -> Interrupted:
    """Checkpoint the last applied step after a stop signal; the error to exit with."""
    path = tr.save()
    step = tr.state.step
    message = f"{exc.name}: stopped before step {step + 1}; checkpoint {path} (step {step})"
    tr.events.emit("signal", step + 1, message, checkpoint=str(path))
    return Interrupted(exc.signum, True, f"{message}. Run the same command to resume from it.")


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


# ---------------------------------------------------------------------------------------------
# Finish


def finish(session: Session, *, log: Log, started: float) -> dict[str, Any]:
    """Write final/, run the closing evaluation and write summary.json."""
    s, tr = session, session.trainer
    cfg, files = s.cfg, tr.files
    memory = {"train_peak_mem_bytes": memory_stats(tr.device)["peak_mem_bytes"]}
    if s.load_peak_bytes is not None:
        memory["load_peak_mem_bytes"] = s.load_peak_bytes
    model = tr.strategy.final_model(s.model, lambda: _rebuilt(s))
    if model is None:  # not the main process: it helped gather the weights, and is done
        return {}
    save_final(
        model,
        s.tokenizer,
        RunPaths(files.run_dir).final,
        _base_path(cfg.model.path),
        base_gguf_file=cfg.model.gguf_file,
        rope_scaling=cfg.model.rope_scaling,
        quantization=s.quantization,
    )
    results: dict[str, Any] = {"final_train_loss": tr.progress.last_loss, **memory}
    if s.eval_inputs is not None:
        merge_for_inference(model)
        preds = RunPaths(files.run_dir).eval_predictions if cfg.train.eval_exact_match else None
        results |= evaluate_after(
            model, s.eval_inputs, s.eval_settings, predictions_file=preds, step=tr.state.step
        )
    results["wall_time_s"] = round(time.perf_counter() - started, 2)  # this invocation
    if pick_device(cfg.train.device).type == "cpu":
        results["allocator"] = mapped_allocator()[0]  # what ran, for comparing runs
    summary = write_summary(
        files.run_dir,
        tr.state,
        tr.progress,
        s.coverage.trainable,
        s.coverage.total,
        results,
        log,
        adapted=s.coverage.as_dict(),
    )
    if cfg.monitor.report:
        report_at_end(files.run_dir, log)
    return summary


def _rebuilt(s: Session) -> nn.Module:
    """The base model with the method applied again, unsharded (FSDP2's final/ on rank 0)."""
    device = pick_device(s.cfg.train.device)
    source = resolve_model(s.cfg.model.path, s.cfg.model.gguf_file)
    seed_everything(s.cfg.train.seed)
    return apply_method(_base_model(s.cfg, source, s.quantization, device), s.cfg.method)


def _base_path(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path
