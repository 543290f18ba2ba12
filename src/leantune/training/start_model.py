"""What a run trains from when `model.path` is a leantune run: the two-stage recipe (SFT, then
a preference objective on the SFT model).

`model.path` may name a run directory or its `final/`. A full fine-tune's `final/` is a model
directory and is trained from as it is. An adapter's (LoRA, DoRA, IA3, QLoRA) is merged into its
base by the loader `leantune export` uses (`export.source`: the one `eval` and `generate` load
a run with, then peft's merge) and written once into the new run's `start_model/`, which is
then the run's model: its fingerprint hashes it, the planner reads it, and a LoRA run's
`final/` names it as its base, so `eval` of the new run needs no chain of adapters. The run
records the run it started from (`started_from` in `leantune_run.json` and `summary.json`).

`start_sources` says what that model is without loading or writing anything, for the commands
that only read it (`leantune plan`, `leantune inspect`): the config and weights (a full run's
`final/`, an adapter's base) and the tokenizer (an adapter's own when saved with one), as the
merge's loader reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peft import PEFT_TYPE_TO_CONFIG_MAPPING, PeftType, PromptLearningConfig

from leantune.config import Config
from leantune.config.parse import ConfigError
from leantune.core.digests import model_digest
from leantune.core.writes import replacing_dir
from leantune.export.hf import write_hf
from leantune.export.source import ExportError, load_source, merge_into_base
from leantune.layout import RunPaths
from leantune.methods.artifacts import config_and_tokenizer_sources
from leantune.models.loading import ModelSource, resolve_model
from leantune.models.paths import (
    ModelPaths,
    is_adapter_dir,
    is_bottleneck_adapter_dir,
    model_of_run,
)
from leantune.training.parallel.strategy import ParallelStrategy
from leantune.training.run.rundir import read_record

Log = Callable[[str], None]

MADE_FROM = "leantune_start.json"
"""In `start_model/`: the digest of the adapter it was merged from (a resume reuses it)."""


@dataclass(frozen=True)
class StartRun:
    """The leantune run `model.path` names."""

    run: Path
    """Its run directory (absolute)."""
    final: Path
    """Its `final/`: the model, or the adapter, it trained."""
    fingerprint: str
    """sha256 of its record's fingerprint (`fingerprint_digest`)."""

    def as_dict(self) -> dict[str, str]:
        """What the new run's record and summary say under ``started_from``."""
        return {
            "run": str(self.run),
            "name": self.run.name,
            "final": str(self.final),
            "fingerprint": self.fingerprint,
        }


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """sha256 of a run's fingerprint fields, as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def start_run(model_path: str) -> StartRun | None:
    """The run `model_path` names (its directory, or its `final/`); None for a model that is
    no run's (a model directory, a hub id, a demo name)."""
    given = Path(model_path).expanduser()
    final = Path(model_of_run(model_path)).expanduser()
    if final != given:  # a run directory: model_of_run went into its final/
        run = given
    elif given.name == RunPaths.final and given.is_dir():
        run = given.parent
    else:
        return None
    record = read_record(run)
    if record is None:  # a folder named final/ that no leantune run wrote
        return None
    return StartRun(run.resolve(), final.resolve(), fingerprint_digest(record.fingerprint))


@dataclass(frozen=True)
class StartSources:
    """What a run with a given `model.path` trains from, found without loading anything."""

    run: StartRun | None
    """The leantune run model.path names (None: a model that is no run's)."""
    model: ModelSource
    """Its config and weights: the model, a full run's `final/`, an adapter run's base."""
    tokenizer: ModelSource
    """Its tokenizer: an adapter's own when saved with one (what `start_model/` gets)."""
    merged: bool
    """`train` merges the run's adapter into `model`, in its run directory's `start_model/`."""


def needs_merge(start: StartRun) -> bool:
    """Whether `start`'s `final/` is an adapter, merged into its base before training."""
    return is_adapter_dir(start.final) or is_bottleneck_adapter_dir(start.final)


STARTABLE = "a run can start from a LoRA, DoRA, IA3 or QLoRA run, or a full fine-tune"
"""What a refused start says a run can start from."""


def check_mergeable(start: StartRun, model_path: str) -> None:
    """Refuse, without loading anything, a run whose adapter cannot be merged into its base:
    `train` (before merging), `leantune plan` and `leantune inspect` say the same.

    Raises:
        ConfigError: `start`'s `final/` is a bottleneck adapter or a prompt-learning one.
    """
    where = f"model.path={model_path}"
    if is_bottleneck_adapter_dir(start.final):
        raise ConfigError(
            f"{where}: {start.final} is a bottleneck adapter, which cannot be merged into its "
            f"base; {STARTABLE}"
        )
    if not is_adapter_dir(start.final):
        return
    config = json.loads(ModelPaths(start.final).adapter_config.read_text())
    kind = config.get("peft_type")
    # Prompt tuning, prefix tuning, p-tuning: virtual tokens, not weight deltas to fold in.
    config_class = PEFT_TYPE_TO_CONFIG_MAPPING.get(kind) if kind in PeftType.__members__ else None
    if config_class is not None and issubclass(config_class, PromptLearningConfig):
        raise ConfigError(
            f"{where}: {start.final} is a prompt-learning adapter (peft {kind}), which cannot be "
            f"merged into its base; {STARTABLE}"
        )


def start_sources(model_path: str, gguf_file: str | None = None) -> StartSources:
    """What `start_model` would train from for `model_path`, read-only (`leantune plan`,
    `leantune inspect`): the sources the merge's loader (`export.load_source`) reads.

    Raises:
        ModelNotFoundError: model_path is no model.
        ModelPathError: an adapter run whose base cannot be found.
        ConfigError: a run whose adapter `train` cannot merge (`check_mergeable`).
    """
    start = start_run(model_path)
    if start is None:
        source = resolve_model(model_path, gguf_file)
        return StartSources(None, source, source, merged=False)
    if needs_merge(start):
        check_mergeable(start, model_path)
        model, tokenizer = config_and_tokenizer_sources(str(start.final))
        return StartSources(start, model, tokenizer, merged=True)
    final = ModelSource(str(start.final))
    return StartSources(start, final, final, merged=False)


def start_model(
    cfg: Config, strategy: ParallelStrategy, log: Log
) -> tuple[Config, StartRun | None]:
    """`cfg` with model.path the model a run from another run trains from: that run's `final/`
    model, or its adapter merged into its base in `<run dir>/start_model/`; as is otherwise.

    Under torchrun the main process merges while the others wait (`strategy.agree`), then every
    process reads the merged model from the run directory, as they read its checkpoints.

    Raises:
        ConfigError: the run's adapter cannot be merged (prompt tuning, bottleneck adapters),
            or the merge failed on the main process.
    """
    start = start_run(cfg.model.path)
    if start is None:
        return cfg, None
    path = _merged_once(cfg, start, strategy, log) if needs_merge(start) else start.final
    log(f"model.path={cfg.model.path}: starting from run {start.run.name} ({path})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path))), start


def _merged_once(cfg: Config, start: StartRun, strategy: ParallelStrategy, log: Log) -> Path:
    """`_merged` on the main process; the others wait for it and fail with it."""
    if strategy.is_main_process:
        try:
            out = _merged(cfg, start, log)
        except BaseException:
            strategy.agree(1)  # matches the others' agree below: they stop, not hang
            raise
        strategy.agree(0)
        return out
    where = f"model.path={cfg.model.path}"
    if strategy.agree(0):
        raise ConfigError(f"{where}: rank 0 could not merge {start.final}: see its error")
    out = RunPaths(cfg.run_dir).start_model
    if not (out / MADE_FROM).is_file():
        raise ConfigError(
            f"{where}: rank 0 merged {start.final} into {out}, which this process cannot see: "
            "run.dir must be a folder every process shares, or run `leantune export` with "
            "--format hf on that run and give model.path the exported folder"
        )
    return out


def _merged(cfg: Config, start: StartRun, log: Log) -> Path:
    """`start`'s adapter merged into its base, in this run's `start_model/` (made once)."""
    out = RunPaths(cfg.run_dir).start_model
    made_from = model_digest(start.final)
    marker = out / MADE_FROM
    if marker.is_file() and json.loads(marker.read_text()).get("adapter") == made_from:
        return out  # a resume, or a rerun: the same adapter, merged before
    where = f"model.path={cfg.model.path}"
    if out.exists() and read_record(cfg.run_dir) is not None:
        # Merging again would change the base the run's checkpoints and final/ were trained on.
        raise ConfigError(
            f"{where}: {start.final} has changed since the run in {cfg.run_dir} started from "
            f"it (merged into {out}). Give another run.dir, or run.resume=never to start over"
        )
    check_mergeable(start, cfg.model.path)  # before loading: plan and inspect refuse the same
    log(f"{where}: merging {start.final} into its base, into {out}")
    source = load_source(str(start.final))
    try:
        merged, _ = merge_into_base(source.model, source.adapter_dir)
    except ExportError as exc:
        raise ConfigError(
            f"{where}: {start.final}: {exc.args[0].split(';')[0]}; {STARTABLE}"
        ) from None
    with replacing_dir(out) as tmp:
        write_hf(merged, source.tokenizer, tmp)
        (tmp / MADE_FROM).write_text(json.dumps({"adapter": made_from}) + "\n")
    return out
