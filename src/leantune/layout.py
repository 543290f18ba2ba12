"""The names of everything in a run directory, a prepared data directory and a model folder:
one owner.

`train` writes these files and `report`, the dashboard, `export`, resume and the benchmarks read
them back; each of those names them through `RunPaths` (`PreparedPaths`, `ModelPaths`), never by
a string of its own. This module imports nothing, torch included, so that a reader of a run's files
never loads the training code.

    paths = RunPaths(Path("runs/mine"))
    paths.summary           # Path("runs/mine/summary.json")
    RunPaths.summary        # "summary.json": the name, for readers that join it themselves
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import overload


class _Entry:
    """One file or folder of a directory: read on the class it is the name, on an instance
    the path under that instance's root."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> str: ...

    @overload
    def __get__(self, obj: _Dir, owner: type) -> Path: ...

    def __get__(self, obj: _Dir | None, owner: type) -> str | Path:
        # A descriptor, so one declaration gives both the name and the path: they cannot drift.
        return self.name if obj is None else obj.root / self.name


@dataclass(frozen=True)
class _Dir:
    """A directory whose entries are `_Entry` attributes: one line names each, so a name and
    its path cannot drift apart."""

    root: Path

    @classmethod
    def names(cls) -> dict[str, str]:
        """Every entry's attribute and file name: ``{"summary": "summary.json", ...}``."""
        entries: dict[str, _Entry] = {}
        # Base classes first, so that a subclass's entry of the same attribute wins.
        for klass in reversed(cls.__mro__):
            entries.update((k, v) for k, v in vars(klass).items() if isinstance(v, _Entry))
        return {attr: entry.name for attr, entry in entries.items()}


@dataclass(frozen=True)
class RunPaths(_Dir):
    """A run directory (``run.dir``) and every file and folder leantune writes into it (but
    ``crash-<time>-<pid>.log``, which `leantune.cli.crash` puts in an existing run directory
    when a command fails with an internal error)."""

    lock = _Entry(".leantune.lock")
    """An ``fcntl.flock`` held while a process trains here, with its pid inside."""
    record = _Entry("leantune_run.json")
    """The run's fingerprint: what marks the folder as a run, and what a resume must match."""
    config = _Entry("config.yaml")
    """The resolved config (overrides applied)."""
    memory_plan = _Entry("memory_plan.json")
    """The planner's predicted peak and budget, when the planner models the run."""
    metrics = _Entry("metrics.jsonl")
    """One row per optimizer step."""
    eval = _Entry("eval.jsonl")
    """One row per periodic evaluation (``train.eval_every``)."""
    events = _Entry("events.jsonl")
    """The guard's and OOM recovery's decisions, append-only (written on the first event)."""
    paused = _Entry("PAUSED")
    """The guard's pause marker (JSON: step, detector, reason); the next ``train`` lifts it."""
    eval_predictions = _Entry("eval_predictions.jsonl")
    """Each held-out answer and whether it matched (``train.eval_exact_match``)."""
    summary = _Entry("summary.json")
    """What the finished run achieved (`leantune.monitor.summary`)."""
    report = _Entry("report.html")
    """``monitor.report``: charts, events and the data report."""
    monitor_ids = _Entry("monitor_runs.json")
    """The W&B / MLflow run ids, so that a resume continues the same remote run."""
    tensorboard = _Entry("tensorboard")
    """The TensorBoard sink's event files."""
    wandb = _Entry("wandb")
    """W&B's own files (``wandb.init(dir=run dir)``)."""
    checkpoints = _Entry("checkpoints")
    """``step-NNNNNN/`` folders (`checkpoint_name`)."""
    final = _Entry("final")
    """The trained model (or adapter) when training finishes."""
    prepared = _Entry("prepared")
    """The tokenise-once cache of data.train / data.eval when ``data.cache_dir`` is unset."""
    start_model = _Entry("start_model")
    """model.path an adapter run's: its adapter merged into its base, the model trained from
    (`leantune.training.start_model`)."""

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint of `step`."""
        return self.checkpoints / checkpoint_name(step)

    def is_run(self) -> bool:
        """Whether the folder holds a leantune run: its record, or checkpoints of a leantune
        older than the record."""
        # Checkpoints alone also count: a run from before the record existed must still resume.
        return self.record.is_file() or any(self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*"))


@dataclass(frozen=True)
class PreparedPaths(_Dir):
    """A prepared data directory (``leantune prepare --out``, or one under the data cache)."""

    report = _Entry("prepare_report.json")
    """What preparation kept and dropped; written last, so it marks the directory complete."""
    rejected = _Entry("rejected.jsonl")
    """Each rejected record with its file, line and reason."""


@dataclass(frozen=True)
class ModelPaths(_Dir):
    """A model folder: an HF model, a peft adapter or a leantune bottleneck adapter (a run's
    ``final/`` is one of them). The HF and peft names are those libraries'; they are named here
    so that telling the kinds apart (`models.paths`) and saving them (`methods.artifacts`)
    agree."""

    config = _Entry("config.json")
    """The HF model config: a folder with it holds a whole model."""
    tokenizer_config = _Entry("tokenizer_config.json")
    generation_config = _Entry("generation_config.json")
    weights = _Entry("model.safetensors")
    """The weights in one file."""
    weights_index = _Entry("model.safetensors.index.json")
    """The weights in shards: which file holds each tensor."""
    adapter_config = _Entry("adapter_config.json")
    """A peft adapter's config: a folder with it holds a peft adapter."""
    adapter_weights = _Entry("adapter_model.safetensors")
    bottleneck_config = _Entry("bottleneck_adapter.json")
    """A leantune bottleneck adapter's settings (`methods.adapter`)."""
    bottleneck_weights = _Entry("bottleneck_adapter.safetensors")
    base_pointer = _Entry("leantune_base.json")
    """Beside an adapter: the base model it was trained on, and how to load it."""


CHECKPOINT_PREFIX = "step-"
CHECKPOINT_MARKER = "COMPLETE"
"""Written last into a checkpoint folder: without it the checkpoint is unfinished."""
# Anchored: a folder such as step-000012.tmp or step-12-old is not a checkpoint.
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_name(step: int) -> str:
    """``step-000012``: zero-padded, so that names sort as steps do."""
    # Names sort as steps only up to 999,999 (step-1000000 sorts first): resume orders
    # checkpoints by checkpoint_step, not by name.
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name, None when the name is not one."""
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None
