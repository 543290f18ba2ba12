"""The `monitor:` section of a config: where a run's metrics go besides metrics.jsonl.

Every sink here is optional and off by default except the run report; nothing in this
section changes a run's trajectory, so it is free to change on resume.
"""

from __future__ import annotations

from dataclasses import dataclass

from leantune.config_parse import ConfigError


@dataclass
class MonitorConfig:
    """Live metrics and the run report (metrics.jsonl and the progress bar are always on)."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port at /metrics (and /health) while the run trains;
    off when unset, 0 picks a free port (logged). Only rank 0 serves in a distributed run."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds to (127.0.0.1: this machine only; 0.0.0.0: all)."""
    tensorboard: bool = False
    """Write TensorBoard event files under <run dir>/tensorboard (needs the tensorboard extra)."""
    report: bool = True
    """Write <run dir>/report.html at the end of the run (`leantune report` rebuilds it)."""


def check_monitor(m: MonitorConfig) -> None:
    """Refuse a port outside 0..65535 or an empty host (a taken port is found at set-up)."""
    if m.metrics_port is not None and not 0 <= m.metrics_port <= 65535:
        raise ConfigError(
            f"monitor.metrics_port: must be a TCP port in 0..65535 (0: any free port), "
            f"got {m.metrics_port}"
        )
    if not m.metrics_host.strip():
        raise ConfigError("monitor.metrics_host: must be an address, e.g. 127.0.0.1 or 0.0.0.0")
