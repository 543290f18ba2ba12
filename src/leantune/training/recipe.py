"""The training recipe: one lifecycle for every method and objective, in the order it runs.

    train(cfg)                      claim the run directory, handle stop signals
      set_up(...) -> Session        build every component, in dependency order:
                                    device/precision -> run check -> files/events -> tokenizer
                                    -> data -> base model -> method -> trainer -> start state
      run_loop(trainer, ...)        steps until max_steps: trainer.train_step, guard actions,
                                    sinks (metrics.jsonl, progress bar, ...), evals, saves
      finish(session, ...)          final/ weights, the closing evaluation, summary.json

What set-up resolves (device, precision, attention, the parallel strategy) is
`training.resolve`'s; the components it builds are `training.build`'s; the end is
`training.finish`'s. The method only decides how the model is wrapped and which parameters
train; the loop never branches on it, nor on the parallel strategy or the sinks. The objective
forks the data (SFT rows, or packed preference pairs: `training.preference_setup`) and the
window's loss (`trainer.backward_window` or `trainer.preference_window`).

Two things can interrupt a step. An out-of-memory error halves the micro-batch and replays the
same window of samples (`trainer.replay_on_oom`). The stability guard may skip the update, pause
the run, roll back to the last checkpoint or stop (`training.guard.actions`). Every such
decision is an event in `events.jsonl`.

The run directory is claimed first (`training.run.rundir`: a lock, no foreign folder) and its
record decides whether the checkpoint there may be continued (`training.run.resume`). A
SIGTERM, SIGINT or SIGHUP stops at the next micro-batch boundary with a checkpoint of the last
applied step (`core.signals`, checked by the step only).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from leantune.config import Config
from leantune.core.signals import Interrupted, StopSignals
from leantune.data.dataset import PreparedData
from leantune.layout import RunPaths
from leantune.methods.registry import base_quantization
from leantune.models.loading import ModelSource, resolve_model
from leantune.monitor.events import EventLog, OutOfMemoryAtMinimum, TrainingHalted
from leantune.monitor.metrics import start_training_memory
from leantune.monitor.report import report_at_end
from leantune.training.build import (
    LoopSettings,
    Session,
    build_trainer,
    evaluators,
    preference_objective,
    quiet,
    run_files,
    start_state,
    tokenizer_for,
    wrap_method,
)
from leantune.training.checks import check_config
from leantune.training.evaluation import (
    EvalInputs,
    EvalSettings,
    Evaluator,
    answer_cap,
    exact_match_before,
)
from leantune.training.finish import finish
from leantune.training.guard.actions import act_on_guard
from leantune.training.guard.divergence import WeightsDiverged
from leantune.training.hooks import StepHooks, new_step_hooks
from leantune.training.parallel.launch import launched_world_size
from leantune.training.parallel.strategy import ParallelStrategy
from leantune.training.quant_cost import load_base
from leantune.training.resolve import parallel_strategy, resolved
from leantune.training.run.refused_writes import (
    keep_trained_steps,
    refused_write,
    with_resume_point,
)
from leantune.training.run.rundir import RunDir, RunDirError, claim_run_dir
from leantune.training.run_monitoring import monitoring
from leantune.training.run_setup import (
    RunSetup,
    check_resumable,
    named_run,
    seed_everything,
    set_up_run,
    with_objective_format,
)
from leantune.training.start_model import start_model
from leantune.training.state.checkpoint import list_complete_checkpoints
from leantune.training.trainer import StepResult, Trainer, train_step

Log = Callable[[str], None]

__all__ = ["Session", "StepResult", "Trainer", "named_run", "set_up", "train"]


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
    log = log if strategy.is_main_process else quiet  # rank 0 speaks for the run
    for warning in warnings:
        log(f"warning: {warning}")
    log(f"run directory: {cfg.run_dir}")  # a derived name changes with the settings
    inputs = [config_file] if config_file else []
    try:
        with StopSignals() as stop, _claimed(cfg, strategy, log) as run:
            try:
                return _lifecycle(cfg, source, run, stop, inputs, log, started, strategy)
            except Interrupted as exc:
                raise _explained(exc, RunPaths(cfg.run_dir).checkpoints) from None
    finally:
        # The session that held the process group is gone with _lifecycle's frame: ended
        # here, in every rank, rather than by the interpreter's teardown (`end_world`).
        strategy.close()


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
    hooks = new_step_hooks()  # a test's faults, read once for this run
    hooks.at_start()
    # Once the run directory is claimed: an adapter run's merge is written into it.
    cfg, origin = start_model(cfg, strategy, log)
    if origin is not None:
        source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    try:
        session = set_up(
            cfg,
            source,
            stop=stop,
            inputs=inputs,
            log=log,
            strategy=strategy,
            hooks=hooks,
            started_from=origin.as_dict() if origin is not None else None,
        )
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


@contextlib.contextmanager
def _claimed(cfg: Config, strategy: ParallelStrategy, log: Log) -> Iterator[RunDir]:
    """The main process claims the run directory (`claim_run_dir`); the others wait until it
    has, and learn whether it could."""
    if not strategy.is_main_process:
        # Matches rank 0's agree below: a failed claim there fails every rank, not a hang.
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
    hooks: StepHooks | None = None,
    started_from: dict[str, str] | None = None,
) -> Session:
    """Build the run's components in dependency order and put the trainer at its start state
    (fresh, resumed or forced, as the run directory's record allows); `started_from` is the
    run model.path named (`training.start_model`), for the record."""
    strategy = strategy if strategy is not None else parallel_strategy(cfg)
    hooks = hooks if hooks is not None else new_step_hooks()
    main = strategy.is_main_process
    # Device, precision and attention first: the fingerprint records what they resolve to (an
    # attention the model cannot use is refused here).
    device, cfg, notes = resolved(cfg, source)
    check_resumable(cfg, source.location, source.gguf_file)  # before anything is written
    for note in notes:  # once the run directory's run is known to be this one
        log(note)
    files = replace(run_files(cfg, inputs, main), started_from=started_from)
    events = EventLog(RunPaths(files.run_dir).events if main else None, log)
    seed_everything(cfg.train.seed)
    # Tokenizer -> data: the data resolves the lengths, the steps and the micro-batch.
    tokenizer = tokenizer_for(cfg, source, log)
    # Rank 0 first: it may prepare the data cache and tidy the checkpoints the others read.
    world = launched_world_size()
    run = _in_turn(strategy, lambda: set_up_run(cfg, source, tokenizer, device.type, log, world))
    cfg, t = run.cfg, run.cfg.train
    pad_id, held_out = int(tokenizer.pad_token_id), run.eval_data
    settings = _eval_settings(cfg, main, tokenizer, held_out, log)
    eval_inputs = EvalInputs(tokenizer, held_out, pad_id, events, hooks) if held_out else None
    # Base model -> its exact match -> the method's wrapping -> the trainer around it.
    quantization = base_quantization(cfg.method, t.precision)
    model = load_base(cfg, source, quantization, device, run, pad_id, log)  # + 4-bit's cost
    base_exact_match = _base_exact_match(model, run, eval_inputs, settings, log)
    model, trained, params, coverage = wrap_method(cfg, model, strategy, log)
    # On every rank, as above; a preference objective's reference for data.eval is taken now.
    evaluator, scored = evaluators(
        cfg, run, model, eval_inputs, settings, pad_id, events=events, hooks=hooks, log=log
    )
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
        hooks=hooks,
        files=files,
        sinks=sinks,
        stop=stop,
        global_batch=run.global_batch,
        strategy=strategy,
        stats=stats,
    )
    if run.preference is not None:
        preference_objective(cfg, run, trainer, trained, device, pad_id, log)
    strategy.agree(0)  # every rank has read the run directory before rank 0 writes to it
    start_state(trainer, cfg, run.plan, log, base_exact_match)
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
        preference_eval=scored,
    )


def _eval_settings(
    cfg: Config,
    main: bool,
    tokenizer: PreTrainedTokenizerBase,
    held_out: PreparedData | None,
    log: Log,
) -> EvalSettings:
    """How evaluation computes; exact match's progress line on the main process only."""
    t = cfg.train
    exact = t.eval_exact_match or (t.eval_every > 0 and t.eval_every_sample > 0)
    # One cap for every exact match of the run (base, periodic, final), said once when used.
    cap = answer_cap(t.max_new_tokens, tokenizer, held_out, log if exact else None)
    return EvalSettings(t.precision, t.eval_batch_size, cap, cfg.run.progress and main)


def _base_exact_match(
    model: nn.Module,
    run: RunSetup,
    inputs: EvalInputs | None,
    settings: EvalSettings,
    log: Log,
) -> float | None:
    """train.eval_base: exact match on the bare base model, before any adapter exists (an
    untrained adapter is a no-op that would only cost time); a fresh run only."""
    t = run.cfg.train
    if not (t.eval_exact_match and t.eval_base and inputs and run.plan.action == "fresh"):
        return None
    # All ranks evaluate: none idles in a collective meanwhile.
    return exact_match_before(model, inputs, settings, log)


def _in_turn(strategy: ParallelStrategy, work: Callable[[], RunSetup]) -> RunSetup:
    """`work()` on the main process, then on the others."""
    if strategy.is_main_process:
        done = work()
        strategy.agree(0)
        return done
    strategy.agree(0)
    return work()


# ---------------------------------------------------------------------------------------------
# The loop


def run_loop(tr: Trainer, loop: LoopSettings, evaluator: Evaluator | None = None) -> None:
    """Steps until `loop.max_steps` updates are applied; evaluates and checkpoints as set.
    A stop signal ends it with a checkpoint of the last applied step.

    Raises:
        Interrupted: SIGTERM, SIGINT or SIGHUP arrived (the message says where the checkpoint
            is).
    """
    tr.sinks.start(tr.state.step)
    tr.model.train()
    try:
        # A signal is only recorded from here: the step acts on it at a micro-batch boundary,
        # where the last applied step can still be checkpointed.
        with tr.stop.deferred():
            while tr.state.step < loop.max_steps:
                result = _step(tr)
                _recheck_threads(tr)
                # tr.progress, not a local alias: a rollback replaces it.
                tr.progress.train_time_s += result.record["step_time_s"]
                if result.decision.action != "step" and act_on_guard(tr, result):
                    tr.sinks.start(tr.state.step)  # rolled back: what came after is gone
                    continue
                if result.decision.applies_update:
                    _after_update(tr, result, loop, evaluator)
    except Interrupted as exc:
        if not exc.at_boundary:  # a second signal: stop at once, without a checkpoint
            raise
        raise _stopped(tr, exc) from None
    finally:
        tr.sinks.close()


def _step(tr: Trainer) -> StepResult:
    """One `train_step`; one sequence that does not fit is checkpointed before it stops."""
    try:
        return train_step(tr)
    except OutOfMemoryAtMinimum as exc:
        # The weights are the last applied step's (the failed window's gradients are dropped):
        # a rerun with more memory, or a shorter max_seq_len, resumes from here.
        path = tr.save()
        tr.events.emit("oom", tr.state.step + 1, f"{exc} Checkpoint {path}.")
        raise


def _recheck_threads(tr: Trainer) -> None:
    """The CPU's load re-measured when due; a change of thread count is one event line."""
    note = tr.threads.check() if tr.threads is not None else None
    if note is not None:
        tr.events.emit("threads", tr.state.step, note)


def _after_update(
    tr: Trainer, result: StepResult, loop: LoopSettings, evaluator: Evaluator | None
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
