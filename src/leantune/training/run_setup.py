"""What a run derives before it trains: its name, and the settings its model and data decide.

- ``run.name=auto`` (the default without run.dir) becomes ``<data file stem>-<method>-<8 hex>``
  (`default_run_name`).
- ``data.pack=auto`` packs unless the method needs one example per row (`effective_pack`).
- ``data.max_seq_len=auto``: the longest train example, within the model's context
  (`load_datasets`).
- The global batch, unset with micro_batch_size=auto: `default_global_batch`; never more than
  the data's rows.
- ``train.epochs`` and ``train.max_steps`` give the number of steps (`steps_for`).

`set_up_run` does all of this at the start of `train` and returns the config with these values
resolved (``data.max_seq_len`` and ``data.pack`` concrete, ``train.max_steps`` the steps,
``train.global_batch_size`` the global batch with micro_batch_size=auto), which is what the
run's fingerprint records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import (
    AUTO_RUN_NAME,
    DEFAULT_BATCH_EXAMPLES,
    Config,
    DataConfig,
    GuardConfig,
    ModelConfig,
    TrainConfig,
    configured_global_batch,
)
from leantune.config.limits import MAX_SEQ_LEN
from leantune.core.allocator import mapped_allocator
from leantune.data.dataset import PreparedData, check_token_range, prepared_data
from leantune.data.packing import longest_example, rows_for
from leantune.data.prepare.pipeline import read_report
from leantune.data.prepare.settings import engine_options, settings_from_config
from leantune.layout import RunPaths
from leantune.memory.resolve import PlannedMemory, plan_for_run
from leantune.methods.checks import effective_pack
from leantune.models.loading import ModelSource
from leantune.objectives.checks import objective_data_format
from leantune.training.guard.detect import GuardSettings
from leantune.training.planning import plan_inputs
from leantune.training.preference_setup import PreferenceRun, load_preference_data
from leantune.training.run.fingerprint import run_fingerprint
from leantune.training.run.resume import ResumePlan, plan_run
from leantune.training.run.rundir import read_record

Log = Callable[[str], None]

FALLBACK_CONTEXT = 2048
"""The length limit for data.max_seq_len=auto when the model's config names no context."""
_STEM_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_STEM_MAX = 60  # leaves room for -<method>-<hash> within a run name's 100 characters


@dataclass
class RunSetup:
    """The run's config with its derived values resolved, its data, and what to do with its
    run directory."""

    cfg: Config
    plan: ResumePlan
    train_data: PreparedData
    eval_data: PreparedData | None
    global_batch: int
    """Rows per optimizer step: the configured global batch, or all rows when fewer."""
    memory: PlannedMemory | None = None
    """The memory planner's prediction and budget (shown against the measured memory)."""
    preference: PreferenceRun | None = None
    """train.objective other than sft: the preference data and its packed rows (`train_data`
    holds the same rows as the loop reads them)."""


# ---------------------------------------------------------------------------------------------
# The run's name


def default_run_name(cfg: Config, model_location: str, gguf_file: str | None) -> str:
    """``<data file stem>-<method>-<8 hex digits of the configured fingerprint>``."""
    assert cfg.data.train is not None
    # The hash of the fingerprint as configured (the settings, the digests of the model's files
    # and of the train data): another run gets another directory, and the same command the
    # same one, so that it resumes.
    fields = run_fingerprint(cfg, model_location, gguf_file).fields
    text = json.dumps(fields, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{_stem(cfg.data.train)}-{cfg.method.name}-{digest}"


def _stem(path: str) -> str:
    """A data file's name without its suffixes, as run-name characters."""
    name = Path(path).name
    for compressed in (".gz", ".zst"):
        name = name.removesuffix(compressed)
    stem = Path(name).stem if Path(name).suffix else name
    # Stripped again after the cut, which may end on a separator; "run" when nothing is left.
    return _STEM_CHARS.sub("_", stem).strip("._-")[:_STEM_MAX].strip("._-") or "run"


def named_run(cfg: Config, model_location: str, gguf_file: str | None) -> Config:
    """`cfg` with run.name=auto replaced by its default name (a copy; as is with run.dir)."""
    if cfg.run.dir or cfg.run.name != AUTO_RUN_NAME:
        return cfg
    name = default_run_name(cfg, model_location, gguf_file)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))


def with_objective_format(cfg: Config) -> Config:
    """`cfg` with data.format=chat (the default) replaced by the format its preference
    objective reads, so `train.objective=dpo` alone reads pairs; as is for sft."""
    fmt = objective_data_format(cfg.train.objective, cfg.data.format)
    if fmt == cfg.data.format:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, format=fmt))


def check_resumable(cfg: Config, location: str, gguf_file: str | None) -> None:
    """Refuse a run directory that holds another run before anything is tokenised or written.

    Raises:
        RunMismatch: the recorded run's fingerprint differs (see `resume_policy.plan_resume`).
    """
    record = read_record(cfg.run_dir)
    if record is None or cfg.run.resume == "never":
        return
    recorded, d, t = record.fingerprint, cfg.data, cfg.train
    # What this config leaves to the data (data.max_seq_len=auto, data.pack=auto, unset
    # train.max_steps, unset train.global_batch_size with micro_batch_size=auto) is not known
    # before the data is read: take the recorded run's values, so that only what the config
    # sets can mismatch here. What they resolve to is compared in `set_up_run`'s `plan_run`.
    data = dataclasses.replace(
        d,
        max_seq_len=recorded.get("data.max_seq_len", "auto")
        if d.max_seq_len == "auto"
        else d.max_seq_len,
        pack=recorded.get("data.pack", "auto") if d.pack == "auto" else d.pack,
    )
    steps = recorded.get("train.max_steps") if t.max_steps is None else t.max_steps
    batch = t.global_batch_size
    if t.micro_batch_size == "auto" and batch is None:
        batch = recorded.get("train.global_batch")
    train = dataclasses.replace(t, max_steps=steps, global_batch_size=batch)
    assumed = dataclasses.replace(cfg, data=data, train=train)
    plan_run(assumed, location, gguf_file, lambda _message: None)


# ---------------------------------------------------------------------------------------------
# Steps


def steps_for(rows: int, global_batch: int, epochs: int | None, max_steps: int | None) -> int:
    """Optimizer steps of a run: `epochs` passes of ceil(rows / global batch) steps, capped at
    `max_steps`; `max_steps` alone is the number of steps; neither is one pass."""
    # Rounded up: a step never crosses an epoch boundary (`SampleStream.window`), so an
    # epoch's last step takes the rows left.
    per_epoch = -(-rows // global_batch)
    if epochs is None:
        return max_steps if max_steps is not None else per_epoch
    total = epochs * per_epoch
    return total if max_steps is None else min(total, max_steps)


def describe_steps(rows: int, batch: int, epochs: int | None, max_steps: int | None) -> str:
    """The log line saying how the run's steps follow from its data."""
    per_epoch = -(-rows // batch)
    steps = steps_for(rows, batch, epochs, max_steps)
    shape = f"{per_epoch} steps each ({rows} rows / global batch {batch}, rounded up)"
    if epochs is None and max_steps is not None:
        return f"{steps} steps (train.max_steps): {steps / per_epoch:.3g} epochs of {shape}"
    count = epochs or 1
    line = f"{steps} steps: {count} epoch{'s' if count != 1 else ''} of {shape}"
    if max_steps is not None and max_steps < count * per_epoch:
        line += f", capped at train.max_steps={max_steps}"
    if epochs is None:
        line += "; train.epochs or train.max_steps train longer"
    return line


def default_global_batch(rows: int, examples: int, processes: int = 1) -> int:
    """The global batch with micro_batch_size=auto and train.global_batch_size unset: the rows
    that hold DEFAULT_BATCH_EXAMPLES examples on average, at least one row per process and a
    multiple of `processes`."""
    # Counted in examples, as HF Trainer's default batch is: a packed row holds several, so
    # 8 packed rows would be several times its tokens per update and a fraction of its updates.
    rows_per_example = rows / max(examples, 1)
    batch = max(1, round(DEFAULT_BATCH_EXAMPLES * rows_per_example))
    # Rounded up to a multiple of the processes: each takes an equal share of the window.
    return -(-batch // processes) * processes


def resolved_global_batch(t: TrainConfig, rows: int, examples: int, processes: int = 1) -> int:
    """The configured global batch; with micro_batch_size=auto and train.global_batch_size
    unset, the default for data of `examples` examples in `rows` rows."""
    if t.micro_batch_size != "auto" or t.global_batch_size is not None:
        return configured_global_batch(t)
    return default_global_batch(rows, examples, processes)


def _global_batch(t: TrainConfig, data: PreparedData, processes: int, log: Log) -> int:
    """`resolved_global_batch` for `data`; the log says how a default one follows from it."""
    rows, examples = len(data.rows), len(data.examples)
    batch = resolved_global_batch(t, rows, examples, processes)
    default = t.micro_batch_size == "auto" and t.global_batch_size is None
    if default and (rows != examples or batch != DEFAULT_BATCH_EXAMPLES):
        per_process = f", a multiple of the {processes} processes" if processes > 1 else ""
        log(
            f"global batch {batch} row{'s' if batch != 1 else ''} (train.global_batch_size "
            f"unset): the {examples} examples are in {rows} rows, so {batch} hold about "
            f"{batch * examples / max(rows, 1):.3g} examples, near the default of "
            f"{DEFAULT_BATCH_EXAMPLES} per step{per_process}"
        )
    return batch


def _batch_and_steps(
    t: TrainConfig, data: PreparedData, processes: int, log: Log
) -> tuple[int, int, int]:
    """(configured global batch, the batch the steps take, steps) for `data`; says so when the
    data is smaller than one batch."""
    rows = len(data.rows)
    configured = _global_batch(t, data, processes, log)
    # A window never crosses an epoch (`SampleStream.window`): with fewer rows than the batch,
    # each step is one pass over all of them, and the steps are counted so.
    batch = min(configured, rows)
    if batch < configured:
        log(
            f"warning: data: {rows} row{'s' if rows != 1 else ''} ({len(data.examples)} "
            f"examples), fewer than the global batch of {configured}: every step is one pass "
            f"over all of them (global batch {batch}), never a row twice"
        )
    log(describe_steps(rows, batch, t.epochs, t.max_steps))
    return configured, batch, steps_for(rows, batch, t.epochs, t.max_steps)


# ---------------------------------------------------------------------------------------------
# Data


def model_context(location: str, gguf_file: str | None, model: ModelConfig) -> int | None:
    """The longest input the model takes: max_position_embeddings, times a RoPE scaling
    factor when model.rope_scaling is set; None when its config does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            location, gguf_file=gguf_file, trust_remote_code=model.trust_remote_code
        )
    except Exception:  # loading the model reports what is wrong with it
        return None
    # n_positions: the GPT-2 family's name for it.
    context = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if not isinstance(context, int) or context < 1:
        return None
    rope = model.rope_scaling
    if rope is not None:
        # The factor stretches the length the model was pretrained at, which the scaling may
        # name apart from max_position_embeddings.
        context = int((rope.original_max_position_embeddings or context) * rope.factor)
    # Some configs name a context of millions of tokens: the limit stays one leantune takes.
    return min(context, MAX_SEQ_LEN)


def auto_context(cfg: Config, source: ModelSource) -> int | None:
    """The model's context (`model_context`) when data.max_seq_len=auto needs it, else None."""
    if cfg.data.max_seq_len != "auto":
        return None
    return model_context(source.location, source.gguf_file, cfg.model)


def tokenise_limit(d: DataConfig, context: int | None) -> int:
    """The longest example the data is tokenised with: data.max_seq_len; with auto, the length
    a prepared train directory was packed with, else the model's `context`, else
    FALLBACK_CONTEXT (the rows are then packed up to the longest example found)."""
    if d.max_seq_len != "auto":
        return int(d.max_seq_len)
    prepared = Path(d.train) if d.train is not None and Path(d.train).is_dir() else None
    return (_prepared_len(prepared) if prepared else None) or context or FALLBACK_CONTEXT


def _prepared_len(path: Path) -> int | None:
    """The max_seq_len a prepared directory was packed with."""
    try:
        value = ((read_report(path) or {}).get("settings") or {}).get("max_seq_len")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def load_datasets(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, context: int | None, log: Log
) -> tuple[PreparedData, PreparedData | None, int]:
    """Tokenise the train (and eval) files once (cached); bad lines are reported.

    Returns (train, eval, max_seq_len). With data.max_seq_len=auto the limit is the model's
    `context` and the rows are packed up to the longest train example, which is the
    max_seq_len returned; a prepared directory keeps its rows and its length.
    """
    d = cfg.data
    assert d.train is not None
    pack = effective_pack(d.pack, cfg.method.name)
    auto = d.max_seq_len == "auto"
    train_path = Path(d.train)
    limit = tokenise_limit(d, context)
    # auto: tokenise one example per row, so the cache does not depend on the length found.
    settings = settings_from_config(
        dataclasses.replace(d, max_seq_len=limit, pack=pack and not auto)
    )
    cache = d.cache_dir or RunPaths(cfg.run_dir).prepared

    def prepare(path: str, eval_limit: int | None) -> PreparedData:
        data = prepared_data(
            path,
            settings=settings,
            tokenizer=tokenizer,
            cache_dir=cache,
            max_bad_fraction=d.max_bad_fraction,
            limit=eval_limit,
            log=log,
            engine=engine_options(d),
        )
        # The first 20 only: data in the wrong format makes every line a bad one.
        for bad in data.bad[:20]:
            log(f"bad line skipped: {bad}")
        if len(data.bad) > 20:
            log(f"... {len(data.bad) - 20} more bad lines in {path}")
        return data

    train = prepare(d.train, None)
    max_seq_len = limit
    # A prepared directory keeps the rows and length it was packed with.
    if auto and not train_path.is_dir():
        max_seq_len = longest_example(train.examples)
        train.rows = rows_for(train.examples, pack, max_seq_len)
        where = (
            f"the model's context is {context}"
            if context
            else (f"the model's config names no context; {limit} was the limit")
        )
        log(
            f"data.max_seq_len=auto: {max_seq_len} tokens, the longest example ({where}; longer "
            "examples are bad lines)"
        )
    evaluation = prepare(d.eval, cfg.train.eval_limit) if d.eval is not None else None
    if evaluation is not None and auto and pack:
        # Tokenised one example per row like the train data; packed to the longer of the train
        # length and its own longest example, since the packer refuses an example longer than
        # a row.
        length = max(max_seq_len, longest_example(evaluation.examples))
        evaluation.rows = rows_for(evaluation.examples, True, length)
    for path, data in ((d.train, train), (d.eval, evaluation)):
        if data is not None and path is not None:
            log(
                f"data {Path(path).name}: {len(data.examples)} examples, {len(data.rows)} rows, "
                f"{data.supervised_tokens} supervised tokens, {len(data.bad)} bad lines"
            )
    return train, evaluation, max_seq_len


def _describe_pack(pack: bool | str, method: str) -> str | None:
    """The log line for data.pack=auto (None when it was set)."""
    if pack != "auto":
        return None
    if effective_pack(pack, method):
        return f"data.pack=auto: packed rows (method.name={method} allows packing)"
    return (
        f"data.pack=auto: one example per row (method.name={method} needs unpacked rows: its "
        "virtual tokens would join the examples of a packed row)"
    )


def set_up_run(
    cfg: Config,
    source: ModelSource,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    log: Log,
    processes: int = 1,
) -> RunSetup:
    """Tokenise the data, resolve what follows from it and the method (data.pack,
    data.max_seq_len, the global batch, the steps), decide fresh / resume / force on the
    fingerprint of those values, then let the memory planner resolve micro_batch_size=auto.

    Raises:
        RunMismatch: the run directory holds a run with other settings (exit 2).
    """
    d = cfg.data
    note = _describe_pack(d.pack, cfg.method.name)
    if note is not None:
        log(note)
    location, gguf_file = source.location, source.gguf_file
    context = auto_context(cfg, source)
    preference = None
    if cfg.train.objective == "sft":
        train_data, eval_data, max_seq_len = load_datasets(cfg, tokenizer, context, log)
    else:  # data.eval is the preference run's too (`PreferenceRun.eval_step`)
        train_data, preference, max_seq_len = load_preference_data(cfg, tokenizer, context, log)
        eval_data = None
    configured, batch, steps = _batch_and_steps(cfg.train, train_data, processes, log)
    data = dataclasses.replace(
        d, max_seq_len=max_seq_len, pack=effective_pack(d.pack, cfg.method.name)
    )
    train = dataclasses.replace(cfg.train, max_steps=steps)
    if train.micro_batch_size == "auto":  # the fingerprint records the default as resolved
        train = dataclasses.replace(train, global_batch_size=configured)
    cfg = dataclasses.replace(cfg, data=data, train=train)
    # The fingerprint holds the configured micro-batch split (auto, or the numbers given).
    plan = plan_run(cfg, location, gguf_file, log)
    labels = [r.labels for r in train_data.rows]
    split, memory = plan_for_run(plan_inputs(cfg), device, labels, batch, mapped_allocator()[0])
    log(memory.note)
    train = dataclasses.replace(
        cfg.train,
        micro_batch_size=split.micro_batch_size,
        grad_accum=split.grad_accum,
        gradient_checkpointing=split.gradient_checkpointing,
    )
    cfg = dataclasses.replace(cfg, train=train)
    return RunSetup(cfg, plan, train_data, eval_data, batch, memory, preference)


def check_ids_fit(model: nn.Module, run: RunSetup) -> None:
    """No token id past the model's embedding reaches it: prepared data is checked against
    the model's tokenizer first, but a model whose embedding is smaller than its own tokenizer
    is only caught here (with exit 2, not an IndexError mid-step)."""
    embedding = cast(PreTrainedModel, model).get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if not isinstance(rows, int):  # not an nn.Embedding: its size is not known here
        return
    d = run.cfg.data
    assert d.train is not None
    check_token_range(run.train_data, rows, d.train)
    if run.eval_data is not None and d.eval is not None:
        check_token_range(run.eval_data, rows, d.eval)


def seed_everything(seed: int) -> None:
    """Seed python, numpy (if present) and torch."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)  # numpy's legacy seed takes 32 bits only
    except ImportError:
        pass


def guard_settings(g: GuardConfig) -> GuardSettings:
    """The guard's settings from its config section."""
    return GuardSettings(
        nonfinite=g.nonfinite,
        loss_spike=g.loss_spike,
        grad_norm=g.grad_norm,
        loss_sigmas=g.loss_sigmas,
        loss_min_ratio=g.loss_min_ratio,
        grad_sigmas=g.grad_sigmas,
        grad_min_ratio=g.grad_min_ratio,
        window=g.window,
        warmup=g.warmup,
        max_consecutive_skips=g.max_consecutive_skips,
        max_rollbacks=g.max_rollbacks,
        lr_factor=g.lr_factor,
    )
