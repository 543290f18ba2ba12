"""The on-disk format of a training checkpoint: its file names and marker, what it holds
(`TrainingState`, `Checkpoint`) and the errors about it. The layout, and why a checkpoint is
crash-safe and trusted: `leantune.training.state.checkpoint`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leantune.core.writes import OutputError
from leantune.errors import UserError
from leantune.layout import CHECKPOINT_MARKER, CHECKPOINT_PREFIX, ModelPaths, checkpoint_step

FORMAT_VERSION = 2
"""2: the marker records each file's size and SHA-256; 1: sizes only."""
MARKER = CHECKPOINT_MARKER
WEIGHTS_FILE = ModelPaths.weights  # a checkpoint's weights are named as a model folder's
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
STATE_JSON_FILE = "trainer_state.json"
DATA_FILES = (WEIGHTS_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, STATE_JSON_FILE)
SHARDED_LAYOUT = "sharded"
SHARDED_DIR = "dcp"
"""The torch.distributed.checkpoint folder of a sharded checkpoint."""
# Always vouched for in a sharded marker, whatever its list says: without them nothing loads.
SHARDED_FILES = (TRAINER_STATE_FILE, STATE_JSON_FILE, f"{SHARDED_DIR}/.metadata")

# No leftover with these prefixes parses as a ``step-*`` checkpoint; the dot hides it from ls.
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
OLD_RE = re.compile(rf"^\.old-({CHECKPOINT_PREFIX}\d+)-\d+$")  # group 1: the step it belongs to


Warn = Callable[[str], None]
"""Where non-fatal findings go (a damaged checkpoint skipped, an unverifiable old format)."""


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupt or holds objects unsafe to unpickle."""


class DamagedCheckpoints(CheckpointError, UserError):
    """Checkpoints exist but none can be resumed from; the message names each and why."""

    def __init__(self, root: Path, problems: list[str]) -> None:
        self.root = root
        self.problems = problems
        listed = "".join(f"\n  - {p}" for p in problems)
        super().__init__(
            f"no checkpoint in {root} can be resumed from:{listed}\n"
            "Training does not start over on its own, since that would overwrite them. Fix or "
            "remove the checkpoints named above, or start a new run with another run.dir or "
            "run.name, or start this run over with run.resume=never."
        )


class CheckpointWriteError(CheckpointError, OutputError):
    """The disk refused a save (full, read-only, I/O error); earlier checkpoints are intact."""


@dataclass
class TrainingState:
    """Where training stands; saved as ``trainer_state.json``.

    ``extra`` goes through JSON, so tuples come back as lists and non-string keys as strings.
    """

    step: int
    """Optimizer steps completed."""
    micro_batches_seen: int
    """Exact data position: micro-batches consumed so far."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras; the recipe keeps its run progress here
    (:meth:`leantune.training.state.progress.RunProgress.to_json`)."""


@dataclass
class Checkpoint:
    """Everything :func:`load_checkpoint` reads back from one checkpoint directory."""

    path: Path
    state: TrainingState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    """The safetensors header metadata (includes ``format: pt``)."""
    sharded: bool = False
    """A sharded checkpoint: `weights` and `optimizer` are empty, ``path/dcp`` holds them."""


def step_of(path: Path) -> int:
    """The step of a checkpoint folder, -1 for a name that is not one."""
    step = checkpoint_step(path.name)
    return -1 if step is None else step


def manifest_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The files a marker vouches for: the fixed four, or every file of a sharded one."""
    if manifest.get("layout") == SHARDED_LAYOUT and isinstance(manifest.get("files"), dict):
        # A marker is plain JSON a user may edit: a ".." entry must not reach outside the
        # checkpoint when its files are hashed.
        listed = {n for n in manifest["files"] if ".." not in Path(n).parts}
        return tuple(sorted(listed | set(SHARDED_FILES)))
    return DATA_FILES
