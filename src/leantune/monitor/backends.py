"""The optional monitoring backends: one entry each, imported only when configured.

`BACKENDS` is the one list of them: the setting that turns each on, the package it needs and
the pip extra that installs it. `check_packages` (run by `config.validate`) refuses a backend
whose package is missing before anything loads; `optional_sinks` builds the configured ones
at set-up, importing each backend's module (and so its package) only then.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leantune.config.monitor import MonitorConfig
from leantune.config.parse import ConfigError

if TYPE_CHECKING:  # sinks imports torch; config validation (`check_packages`) needs none
    from leantune.monitor.sinks import Sink


@dataclass(frozen=True)
class RunInfo:
    """What a backend needs to know about the run it logs."""

    run_dir: Path
    name: str
    """run.name as resolved (the run directory's name when run.dir is set and run.name is
    auto): the default name of the backend's run."""
    config: dict[str, Any]
    """The resolved config (logged once as hyper-parameters)."""


def _tensorboard(m: MonitorConfig, run: RunInfo) -> Sink:
    from leantune.monitor.tensorboard_sink import TensorBoardSink  # an optional extra

    return TensorBoardSink(run.run_dir, run.config)


def _wandb(m: MonitorConfig, run: RunInfo) -> Sink:
    from leantune.monitor.wandb_sink import WandbSink  # an optional extra

    w = m.wandb
    assert w is not None and w.project is not None, "checked by config.validate"
    return WandbSink(
        run.run_dir,
        run.config,
        project=w.project,
        name=w.name or run.name,
        entity=w.entity,
        mode=w.mode,
    )


def _mlflow(m: MonitorConfig, run: RunInfo) -> Sink:
    from leantune.monitor.mlflow_sink import MlflowSink  # an optional extra

    f = m.mlflow
    assert f is not None and f.uri is not None, "checked by config.validate"
    return MlflowSink(
        run.run_dir, run.config, uri=f.uri, experiment=f.experiment, name=f.run_name or run.name
    )


@dataclass(frozen=True)
class Backend:
    """One optional backend."""

    setting: str
    """The setting that turns it on, as a user writes it."""
    package: str
    """The module it imports."""
    extra: str
    """The pip extra that installs it: pip install 'leantune[extra]'."""
    enabled: Callable[[MonitorConfig], bool]
    build: Callable[[MonitorConfig, RunInfo], Sink]


BACKENDS: dict[str, Backend] = {
    "tensorboard": Backend(
        "monitor.tensorboard=true",
        "tensorboard",
        "tensorboard",
        lambda m: m.tensorboard,
        _tensorboard,
    ),
    "wandb": Backend(
        "monitor.wandb.project", "wandb", "wandb", lambda m: m.wandb is not None, _wandb
    ),
    "mlflow": Backend(
        "monitor.mlflow.uri", "mlflow", "mlflow", lambda m: m.mlflow is not None, _mlflow
    ),
}


def _missing(backend: Backend) -> ConfigError:
    return ConfigError(
        f"{backend.setting} needs the {backend.package} package, which is not installed: "
        f"pip install 'leantune[{backend.extra}]'"
    )


def check_packages(m: MonitorConfig) -> None:
    """Every configured backend's package is installed (found, not imported).

    Raises:
        ConfigError: naming the setting and the pip extra to install.
    """
    for backend in BACKENDS.values():
        # find_spec, not import: validation stays quick and free of the package's import cost.
        if backend.enabled(m) and importlib.util.find_spec(backend.package) is None:
            raise _missing(backend)


def optional_sinks(m: MonitorConfig, run: RunInfo) -> list[Sink]:
    """The configured backends' sinks (none by default); each imports its package here.

    Raises:
        ConfigError: a configured backend's package cannot be imported.
    """
    sinks = []
    for backend in BACKENDS.values():
        if not backend.enabled(m):
            continue
        try:
            sinks.append(backend.build(m, run))
        except ImportError as e:
            # Some other module missing (a broken dependency of the package, or a bug) is no
            # missing extra: the install hint would mislead, so the error stays as it is.
            if e.name is None or e.name.split(".")[0] != backend.package:
                raise
            raise _missing(backend) from None
    return sinks
