"""The loop's records as Prometheus metrics, served on /metrics while a run trains.

Naming follows Prometheus' rules: one ``leantune_`` prefix, base units as suffixes
(``_seconds``, ``_bytes``), ``_total`` on counters, ratios in 0-1 (``_ratio``), the run's
identity in one ``leantune_run_info`` metric, and labels only with a few fixed values (the event
``kind``). Every metric the dashboard and the alert rules under deploy/ query is in `METRICS`;
a value the run does not have (eval loss before the first evaluation, GPU figures on CPU, the
planner's prediction when it could not model the run) is NaN.

In a distributed run only the main process (rank 0) builds the sink, and it reports its own
figures: memory, MFU and padding are rank 0's (loss and grad norm are the reduced ones).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from leantune.layout import CHECKPOINT_MARKER, checkpoint_step
from leantune.monitor.hosts import exposure_warning
from leantune.monitor.server import MetricsServer, check_port

PREFIX = "leantune_"
GUARD_KINDS = ("nonfinite", "loss_spike", "grad_norm", "rollback", "pause", "stop")
"""The guard's detectors and its actions, as `events.jsonl` names them."""
EVENT_KINDS = (*GUARD_KINDS, "oom", "oom_eval", "resume", "signal")

# Gauges set from each metrics record: name -> (record field, help).
RECORD_GAUGES: dict[str, tuple[str, str]] = {
    "leantune_step": ("step", "Optimizer steps applied (the step of the last metrics record)"),
    "leantune_train_loss": ("loss", "Training loss of the last applied step"),
    "leantune_learning_rate": ("lr", "Learning rate of the last applied step"),
    "leantune_grad_norm": ("grad_norm", "Gradient norm before clipping, last applied step"),
    "leantune_tokens_per_second": ("tokens_per_s", "Non-pad tokens per second, last step"),
    "leantune_mfu_ratio": ("mfu", "Model FLOPs utilisation against the measured matmul peak"),
    "leantune_padding_ratio": ("padding_ratio", "Pad share of the last step's batch elements"),
    "leantune_data_wait_ratio": ("data_wait_ratio", "Share of the last step spent on data"),
    "leantune_step_duration_seconds": ("step_time_s", "Wall time of the last step"),
    "leantune_eta_seconds": ("eta_s", "Estimated time to the last step (mean step time)"),
    "leantune_cpu_utilization_ratio": ("cpu_utilization", "Process CPU use per available core"),
    "leantune_gpu_utilization_ratio": ("gpu_utilization", "GPU busy share (NVML)"),
    "leantune_gpu_memory_used_bytes": ("gpu_memory_used_bytes", "GPU memory in use (NVML)"),
    "leantune_memory_peak_bytes": ("peak_mem_bytes", "Peak memory: CUDA allocated or CPU RSS"),
    "leantune_memory_reserved_bytes": ("mem_reserved_bytes", "CUDA memory reserved by torch"),
    "leantune_micro_batch_size": ("micro_batch_size", "Micro-batch size (an OOM halves it)"),
    # Preference objectives (train.objective=dpo, ...); NaN in an SFT run.
    "leantune_rewards_chosen": ("rewards/chosen", "Mean implicit reward of the chosen answers"),
    "leantune_rewards_rejected": ("rewards/rejected", "Mean implicit reward of the rejected"),
    "leantune_rewards_accuracy_ratio": (
        "rewards/accuracies",
        "Share of pairs whose chosen reward exceeds the rejected one, last step",
    ),
    "leantune_rewards_margin": ("rewards/margins", "Mean chosen minus rejected reward"),
    # Summed over each answer's tokens, in nats: no unit suffix, as for the loss.
    "leantune_logps_chosen": ("logps/chosen", "Mean log-probability of the chosen answers"),
    "leantune_logps_rejected": ("logps/rejected", "Mean log-probability of the rejected"),
}


@dataclass(frozen=True)
class RunFacts:
    """What a run knows about itself at set-up, for the info and the constant gauges."""

    run_name: str
    method: str
    model: str
    device: str
    precision: str
    max_steps: int
    trainable_params: int
    total_params: int
    planned_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None
    peak_flops: float | None = None


def _value(x: Any) -> float:
    return float("nan") if x is None else float(x)


class _CheckpointCollector(Collector):
    """Age and step of the newest complete checkpoint, read from the run's checkpoints/ at each
    scrape: it counts checkpoints of earlier invocations too, and needs no hook in the loop."""

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir

    def collect(self) -> Iterator[GaugeMetricFamily]:
        newest = newest_checkpoint_time(self.ckpt_dir)
        step, when = newest if newest is not None else (math.nan, math.nan)
        age = GaugeMetricFamily(
            "leantune_checkpoint_age_seconds", "Seconds since the newest complete checkpoint"
        )
        age.add_metric([], time.time() - when)
        last = GaugeMetricFamily("leantune_checkpoint_step", "Step of the newest checkpoint")
        last.add_metric([], step)
        yield age
        yield last


def newest_checkpoint_time(ckpt_dir: Path) -> tuple[int, float] | None:
    """(step, time written) of the newest ``step-*`` checkpoint with its COMPLETE marker.

    Read only (a scrape runs beside a save); no checksums, which resume verifies.
    """
    best: tuple[int, float] | None = None
    try:
        entries = list(ckpt_dir.iterdir())
    except OSError:
        return None
    for path in entries:
        step = checkpoint_step(path.name)
        if step is None:
            continue
        try:
            # The marker is written last: its time is when the checkpoint became complete.
            when = (path / CHECKPOINT_MARKER).stat().st_mtime
        except OSError:  # incomplete, or removed by keep_last since the listing
            continue
        if best is None or step > best[0]:
            best = (step, when)
    return best


class PrometheusSink:
    """A `Sink` that keeps the latest figures of a run in Prometheus metrics and serves them.

    The port is checked when the sink is built (at set-up: a taken port stops the run with
    exit 2 before any step); the server starts with the loop (`start`) and stops at `close`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        facts: RunFacts,
        ckpt_dir: Path,
        log: Callable[[str], None],
        allowed_hosts: Iterable[str] = (),
    ):
        check_port(host, port)
        self.host, self.port, self.log = host, port, log
        self.allowed_hosts = tuple(allowed_hosts)
        # Its own registry, not the global one: two runs in one process never share a metric.
        self.registry = CollectorRegistry()
        self.lock = threading.Lock()
        """Held while one record's values are written, and by each scrape (`server`)."""
        self.server: MetricsServer | None = None
        self._last_step = 0
        self._last_time = math.nan
        self._define(facts, ckpt_dir)

    def _define(self, facts: RunFacts, ckpt_dir: Path) -> None:
        r = self.registry
        info = Info("leantune_run", "The run: name, method, model, device, precision", registry=r)
        info.info(
            {
                "run": facts.run_name,
                "method": facts.method,
                "model": facts.model,
                "device": facts.device,
                "precision": facts.precision,
            }
        )
        self.gauges = {
            name: Gauge(name, doc, registry=r) for name, (_, doc) in RECORD_GAUGES.items()
        }
        # NaN until a record sets them: a value the run does not have must not read as a real 0.
        for gauge in self.gauges.values():
            gauge.set(math.nan)
        self.memory = Gauge(
            "leantune_memory_used_bytes", "Memory now: CUDA allocated or CPU RSS", registry=r
        )
        self.memory.set(math.nan)
        self.eval_loss = Gauge(
            "leantune_eval_loss", "Loss on the eval rows, last evaluation", registry=r
        )
        self.eval_loss.set(math.nan)
        self.last_step_time = Gauge(
            "leantune_last_step_timestamp_seconds",
            "Unix time of the last applied step (or of the loop's start)",
            registry=r,
        )
        # prometheus_client appends the counters' `_total` suffix itself.
        self.tokens = Counter("leantune_tokens", "Non-pad tokens trained on", registry=r)
        constants = {
            "leantune_max_steps": ("Steps the run trains for", facts.max_steps),
            "leantune_trainable_parameters": ("Parameters that train", facts.trainable_params),
            "leantune_parameters": ("Parameters of the model", facts.total_params),
            "leantune_memory_planned_peak_bytes": (
                "The memory planner's predicted peak",
                facts.planned_peak_bytes,
            ),
            "leantune_memory_budget_bytes": (
                "train.memory_budget, else the device's default budget at the start",
                facts.memory_budget_bytes,
            ),
            "leantune_device_peak_flops": ("Matmul FLOP/s measured at set-up", facts.peak_flops),
        }
        for name, (doc, value) in constants.items():
            Gauge(name, doc, registry=r).set(_value(value))
        self.guard = Counter(
            "leantune_guard_events", "Guard detections and actions", ["kind"], registry=r
        )
        self.oom = Counter(
            "leantune_oom_recoveries",
            "Out-of-memory errors recovered from (train: micro-batch halved; eval: batch halved)",
            ["kind"],
            registry=r,
        )
        self.events = Counter("leantune_events", "Events of events.jsonl", ["kind"], registry=r)
        # Every label value exists at 0 from the first scrape: a series that first appears at 1
        # shows no increase(), and the alert rules would miss the first event of a kind.
        for kind in GUARD_KINDS:
            self.guard.labels(kind=kind)
        for kind in ("train", "eval"):
            self.oom.labels(kind=kind)
        for kind in EVENT_KINDS:
            self.events.labels(kind=kind)
        r.register(_CheckpointCollector(ckpt_dir))
        # A private registry lacks the default process metrics (CPU, memory, open files).
        ProcessCollector(namespace="leantune", registry=r)

    @property
    def url(self) -> str:
        """http://host:port of the running server."""
        assert self.server is not None, "start() first"
        return self.server.url

    def health(self) -> dict[str, Any]:
        """/health: the server is up; the last step and when it was applied."""
        return {
            "status": "ok",
            "step": self._last_step,
            "last_step_time": None if math.isnan(self._last_time) else self._last_time,
        }

    def start(self, step: int) -> None:
        # The loop's (re)start stands for the last step's time, so a stall alert measures from
        # here rather than from a step of an earlier attempt, or from nothing (NaN).
        with self.lock:
            self._last_step, self._last_time = step, time.time()
            self.gauges["leantune_step"].set(step)
            self.last_step_time.set(self._last_time)
        if self.server is None:
            self.server = MetricsServer(
                self.registry, self.health, self.lock, self.host, self.port, self.allowed_hosts
            )
            self.log(f"metrics: {self.server.url}/metrics (Prometheus), {self.server.url}/health")
            warning = exposure_warning(
                self.host,
                self.server.port,
                "the run's name, model path and metrics",
                "monitor.metrics_host",
                "monitor.metrics_allowed_hosts",
            )
            if warning is not None:
                self.log(warning)

    def metrics(self, record: dict[str, Any]) -> None:
        with self.lock:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        for name, (key, _) in RECORD_GAUGES.items():
            if key in record:
                self.gauges[name].set(_value(record[key]))
        used = record.get("mem_allocated_bytes", record.get("rss_bytes"))
        self.memory.set(_value(used))
        self.tokens.inc(record.get("tokens", 0))
        self._last_step, self._last_time = int(record["step"]), time.time()
        self.last_step_time.set(self._last_time)

    def eval(self, row: dict[str, Any]) -> None:
        if "eval_loss" in row:
            with self.lock:
                self.eval_loss.set(_value(row["eval_loss"]))

    def event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("kind", ""))
        if kind not in EVENT_KINDS:
            return  # a kind this version does not know: no new label value
        with self.lock:
            self._count(kind, event)

    def _count(self, kind: str, event: dict[str, Any]) -> None:
        self.events.labels(kind=kind).inc()
        if kind in GUARD_KINDS:
            self.guard.labels(kind=kind).inc()
        elif kind == "oom_eval":
            self.oom.labels(kind="eval").inc()
        elif kind == "oom" and "micro_batch_size" in event:  # not the one that gives up
            self.oom.labels(kind="train").inc()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
