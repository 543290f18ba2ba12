"""The figures a metrics record holds besides loss, lr and grad norm.

`StepStats` lives on the `Trainer`: `begin()` at the start of each step, `data` around the
step's data work, `fields(...)` once the step is done. Each record gains:

- ``pad_tokens``, ``padding_ratio``: pad positions of the step's collated batches, and their
  share of the batches' tensor elements (``tokens``/``tokens_per_s`` count non-pad tokens only,
  so they are the useful throughput);
- ``mfu``: model FLOPs utilisation, 0-1 (`flops.flops_per_token` x non-pad tokens/s over the
  matmul peak: the best probe, `flops.best_peak_flops`); None when no peak was measured. A step
  that runs faster than that peak raises it to the rate observed (said once in the log), so
  MFU never exceeds 1;
- ``data_wait_s``, ``data_wait_ratio``: time spent picking the window and collating it, and its
  share of the step. The copy to the device is not in it: it waits in the stream behind the
  previous step's GPU work, so timing it would count that work as data;
- ``eta_s``: the mean of the last `ETA_WINDOW` step times x the steps left (evaluations and
  checkpoints are not in the step time);
- ``cpu_utilization``: this process's CPU time over the step (all threads) per second of wall
  time and per core it may run on, 0-1; ``rss_bytes``: its resident memory;
- on CUDA with nvidia-ml-py: ``gpu_utilization`` (0-1) and ``gpu_memory_used_bytes``.

Cost: a few microseconds per step (two `os.times` calls, one read of /proc/self/statm, and on
CUDA one NVML query), measured by benchmarks/monitor_overhead.py.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from leantune.core.process_memory import current_rss_bytes
from leantune.monitor.flops import best_peak_flops, flops_per_token, matmul_parameters
from leantune.monitor.gpu import GpuProbe, open_gpu_probe

ETA_WINDOW = 50
"""Steps whose mean time the ETA uses: recent enough to follow a change of speed."""
TIMING_FIELDS = (
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "rss_bytes",
    "rss_anon_bytes",
    "mfu",
    "data_wait_s",
    "data_wait_ratio",
    "eta_s",
    "cpu_utilization",
    "gpu_utilization",
    "gpu_memory_used_bytes",
)
"""Fields of a metrics record that depend on the machine's speed and load, not on the run's
arithmetic: two runs of the same config differ there and nowhere else."""


class DataClock:
    """A context manager that adds the time spent inside it to `seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.seconds += time.perf_counter() - self._start


def _cores() -> int:
    # The cores this process may run on (taskset, a container's cpuset), not the machine's.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class StepStats:
    """Per-step figures for the metrics record; the defaults report no MFU and no ETA."""

    flops_per_token: float | None = None
    peak_flops: float | None = None
    """Matmul FLOP/s measured at set-up (`flops.measure_peak_flops`)."""
    max_steps: int | None = None
    gpu: GpuProbe | None = None
    rss: bool = True
    """Report `rss_bytes` (off on CPU, where `metrics.memory_stats` already does)."""
    data: DataClock = field(default_factory=DataClock)
    cores: int = field(default_factory=_cores)
    log: Callable[[str], None] | None = None
    """Where the one line about a peak raised to the observed rate goes."""
    _peak_raised: bool = False
    _times: deque[float] = field(default_factory=lambda: deque(maxlen=ETA_WINDOW))
    _cpu_start: float = 0.0
    _wall_start: float = 0.0

    def begin(self) -> None:
        """A step starts: reset the data clock and note the process's CPU time."""
        self.data.seconds = 0.0
        self._cpu_start = _cpu_seconds()
        self._wall_start = time.perf_counter()

    def fields(self, step: int, tokens: int, elements: int, elapsed: float) -> dict[str, Any]:
        """The record's extra fields for step `step` (1-based), which took `elapsed` seconds and
        whose collated batches held `tokens` non-pad tokens in `elements` positions (this
        process's share of the window)."""
        elapsed = max(elapsed, 1e-9)  # a clock too coarse for the step reads 0
        cpu = (_cpu_seconds() - self._cpu_start) / max(time.perf_counter() - self._wall_start, 1e-9)
        self._times.append(elapsed)
        mfu = None
        if self.flops_per_token is not None and self.peak_flops:
            achieved = self.flops_per_token * tokens / elapsed
            if achieved > self.peak_flops:  # so that MFU never exceeds 1
                self._raise_peak(achieved)
            mfu = achieved / self.peak_flops
        eta = None
        if self.max_steps is not None:
            eta = max(0, self.max_steps - step) * sum(self._times) / len(self._times)
        out: dict[str, Any] = {
            "pad_tokens": elements - tokens,
            "padding_ratio": (elements - tokens) / elements if elements else 0.0,
            "mfu": mfu,
            "data_wait_s": self.data.seconds,
            "data_wait_ratio": min(1.0, self.data.seconds / elapsed),
            "eta_s": eta,
            # os.times counts in clock ticks (10 ms): over a short step the ratio can overshoot.
            "cpu_utilization": min(1.0, cpu / self.cores),
        }
        if self.rss:
            out["rss_bytes"] = current_rss_bytes()
        if self.gpu is not None:
            out.update(self.gpu.read())
        return out

    def _raise_peak(self, achieved: float) -> None:
        """A step outran the probed peak: the probe ran under load (or the FLOP count
        overstates the model); the observed rate is the peak from here on."""
        if not self._peak_raised and self.log is not None:
            self.log(
                f"MFU: a step ran at {achieved / 1e12:.3g} TFLOP/s, above the matmul peak of "
                f"{(self.peak_flops or 0) / 1e12:.3g} TFLOP/s probed at start-up (other work "
                "on the device then?); MFU is measured against the fastest rate seen from here on"
            )
        self._peak_raised = True
        self.peak_flops = achieved


def build_step_stats(
    model: nn.Module,
    device: torch.device,
    precision: str,
    max_steps: int | None,
    log: Callable[[str], None],
    measure: Callable[[torch.device, str], float | None] = best_peak_flops,
) -> StepStats:
    """The run's `StepStats`: FLOPs per token of the wrapped model, the device's matmul peak
    (probed now, ~50 ms, or the best probe before: `best_peak_flops`), the steps for the ETA
    and an NVML probe on CUDA."""
    matmul, trainable = matmul_parameters(model)
    peak = measure(device, precision)
    if peak is not None:
        log(f"MFU is measured against a {precision} matmul peak of {peak / 1e12:.3g} TFLOP/s")
    return StepStats(
        flops_per_token=flops_per_token(matmul, trainable),
        peak_flops=peak,
        max_steps=max_steps,
        gpu=open_gpu_probe(device),
        rss=device.type != "cpu",
        log=log,
    )
