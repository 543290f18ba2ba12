"""A run's monitoring, built at set-up: the per-step figures (MFU's matmul peak is measured
here) and the sinks the loop's records and events go to (metrics.jsonl, the progress bar, and
on the main process the Prometheus endpoint and the configured TensorBoard/W&B/MLflow sinks)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from torch import nn

from leantune.config import AUTO_RUN_NAME, Config, to_dict
from leantune.layout import RunPaths
from leantune.methods.registry import count_parameters
from leantune.monitor.backends import RunInfo, optional_sinks
from leantune.monitor.events import EventLog
from leantune.monitor.prometheus import PrometheusSink, RunFacts
from leantune.monitor.sinks import ConsoleSink, JsonlSink, Sink, Sinks
from leantune.monitor.step_stats import StepStats, build_step_stats
from leantune.training.evaluation import Evaluator
from leantune.training.parallel.strategy import ParallelStrategy
from leantune.training.run.rundir import write_file
from leantune.training.run_setup import RunSetup
from leantune.training.trainer import RunFiles

Log = Callable[[str], None]


def monitoring(
    cfg: Config,
    run: RunSetup,
    files: RunFiles,
    events: EventLog,
    model: nn.Module,
    device: torch.device,
    strategy: ParallelStrategy,
    evaluator: Evaluator | None,
    log: Log,
) -> tuple[StepStats, Sinks]:
    """The per-step figures (MFU's peak is measured here) and the sinks, which hear the events."""
    stats = build_step_stats(model, device, cfg.train.precision, cfg.train.max_steps, log)
    trainable, total = count_parameters(model)
    memory = run.memory
    facts = RunFacts(
        run_name=cfg.run_dir.name,
        method=cfg.method.name,
        model=cfg.model.path,
        device=device.type,
        precision=cfg.train.precision,
        max_steps=int(cfg.train.max_steps or 0),
        trainable_params=trainable,
        total_params=total,
        planned_peak_bytes=memory.peak_bytes if memory is not None else None,
        memory_budget_bytes=memory.budget_bytes if memory is not None else None,
        peak_flops=stats.peak_flops,
    )
    main = strategy.is_main_process
    if main and memory is not None and memory.peak_bytes is not None:
        # The report and the dashboard draw the measured memory against this.
        plan = {"peak_bytes": memory.peak_bytes, "budget_bytes": memory.budget_bytes}
        write_file(RunPaths(files.run_dir).memory_plan, json.dumps(plan) + "\n")
    sinks = sinks_for(cfg, files, with_eval=evaluator is not None, log=log, facts=facts, main=main)
    events.listeners.append(sinks.event)  # guard actions and OOMs reach the dashboards too
    return stats, sinks


def sinks_for(
    cfg: Config,
    files: RunFiles,
    *,
    with_eval: bool,
    log: Log,
    facts: RunFacts | None = None,
    main: bool = True,
) -> Sinks:
    """metrics.jsonl/eval.jsonl, the progress bar, with monitor.metrics_port the Prometheus
    endpoint, and the configured TensorBoard/W&B/MLflow sinks: the monitoring backends on the
    main process (rank 0) only.

    Raises:
        MetricsPortInUse: monitor.metrics_port cannot be bound (exit 2, before training).
    """
    assert cfg.train.max_steps is not None, "resolved by set_up_run"
    sinks: list[Sink] = []
    if main:  # one writer for the run's files and one progress bar, not one per rank
        sinks += [
            JsonlSink(files.run_dir, with_eval),
            ConsoleSink(cfg.train.max_steps, cfg.run.progress, log),
        ]
    m = cfg.monitor
    if m.metrics_port is not None and facts is not None and main:
        sinks.append(
            PrometheusSink(
                m.metrics_host, m.metrics_port, facts, files.ckpt_dir, log, m.metrics_allowed_hosts
            )
        )
    # The backends show the run by name: with run.dir set, run.name stays auto and the
    # directory's name stands for it.
    name = cfg.run.name if cfg.run.name != AUTO_RUN_NAME else files.run_dir.name
    sinks.extend(optional_sinks(m, RunInfo(files.run_dir, name, to_dict(cfg))) if main else [])
    return Sinks(sinks)
