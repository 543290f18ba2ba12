"""The `monitor:` section of a config: where a run's metrics go besides metrics.jsonl.

Every sink here is optional and off by default except the run report; nothing in this
section changes a run's trajectory, so it is free to change on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from leantune.config.parse import ConfigError
from leantune.config.roles import FREE


@dataclass
class WandbConfig:
    """Weights & Biases: one W&B run per leantune run (a resume continues it)."""

    project: str | None = None
    """W&B project to log to (required)."""
    entity: str | None = None
    """W&B team or user (default: the logged-in user's default entity)."""
    name: str | None = None
    """Display name of the W&B run (default: run.name)."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (files under <run dir>/wandb; `wandb sync` uploads them later) or
    disabled; unset = W&B's own default (WANDB_MODE, else online)."""


@dataclass
class MlflowConfig:
    """MLflow tracking: one MLflow run per leantune run (a resume continues it)."""

    uri: str | None = None
    """Tracking URI (required): http(s)://server:5000, or file:/path for a local store."""
    experiment: str = "leantune"
    """Experiment the run is logged under (created when missing)."""
    run_name: str | None = None
    """Name of the MLflow run (default: run.name)."""


@dataclass
class MonitorConfig:
    """Live metrics and the run report (metrics.jsonl and the progress bar are always on)."""

    metrics_port: int | None = field(default=None, metadata=FREE)
    """Serve Prometheus metrics on this port at /metrics (and /health) while the run trains;
    off when unset, 0 picks a free port (logged). Only rank 0 serves in a distributed run."""
    metrics_host: str = field(default="127.0.0.1", metadata=FREE)
    """Address the metrics endpoint binds to (127.0.0.1: this machine only; 0.0.0.0: all)."""
    metrics_allowed_hosts: list[str] = field(default_factory=list, metadata=FREE)
    """Host names a scrape may name besides localhost, IP addresses and this machine's host name
    (e.g. [metrics.example.org]); other names are refused (403) against DNS rebinding."""
    tensorboard: bool = field(default=False, metadata=FREE)
    """Write TensorBoard event files under <run dir>/tensorboard (needs the tensorboard extra)."""
    wandb: WandbConfig | None = field(default=None, metadata=FREE)
    """Log to Weights & Biases (needs the wandb extra), e.g. monitor.wandb.project=my-project;
    keys: project (required), entity, name (default run.name), mode (online | offline |
    disabled; default W&B's own). Off when unset."""
    mlflow: MlflowConfig | None = field(default=None, metadata=FREE)
    """Log to MLflow (needs the mlflow extra), e.g. monitor.mlflow.uri=file:/tmp/mlruns; keys:
    uri (required), experiment (default leantune), run_name (default run.name). Off when unset."""
    report: bool = field(default=True, metadata=FREE)
    """Write <run dir>/report.html at the end of the run (`leantune report` rebuilds it)."""


def check_monitor(m: MonitorConfig) -> None:
    """A metrics port in 0..65535, a host and host names; a configured W&B or MLflow section
    names its target (whether a backend's package is installed is `monitor.backends`' check).

    Raises:
        ConfigError: naming the setting.
    """
    # Only the range: a port another process holds is found at set-up, when the server binds.
    if m.metrics_port is not None and not 0 <= m.metrics_port <= 65535:
        raise ConfigError(
            f"monitor.metrics_port: must be a TCP port in 0..65535 (0: any free port), "
            f"got {m.metrics_port}"
        )
    if not m.metrics_host.strip():
        raise ConfigError("monitor.metrics_host: must be an address, e.g. 127.0.0.1 or 0.0.0.0")
    # Names only: they are compared with the name in a request's Host header (monitor.hosts),
    # so one given with a scheme, port or path would never match.
    for name in m.metrics_allowed_hosts:
        if not name or not all(c.isalnum() or c in "-._" for c in name):
            raise ConfigError(
                f"monitor.metrics_allowed_hosts: {name!r} is not a host name; give names only "
                "(metrics.example.org), without scheme, port or path"
            )
    if m.wandb is not None and not m.wandb.project:
        raise ConfigError("monitor.wandb.project: required; the W&B project to log to")
    if m.mlflow is not None and not m.mlflow.uri:
        raise ConfigError(
            "monitor.mlflow.uri: required; the tracking URI (http://host:5000, file:/path)"
        )
