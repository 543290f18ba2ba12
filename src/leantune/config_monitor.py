"""The `monitor:` section of a config: where a run's metrics go besides metrics.jsonl.

Every sink here is optional and off by default except the run report; nothing in this
section changes a run's trajectory, so it is free to change on resume.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MonitorConfig:
    """Live metrics and the run report (metrics.jsonl and the progress bar are always on)."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port at /metrics (and /health); off when unset."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds to (127.0.0.1: this machine only)."""
    tensorboard: bool = False
    """Write TensorBoard event files under <run dir>/tensorboard (needs the tensorboard extra)."""
    report: bool = True
    """Write <run dir>/report.html at the end of the run (`leantune report` rebuilds it)."""
