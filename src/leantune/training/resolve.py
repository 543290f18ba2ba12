"""What set-up resolves before anything is written: the device and train.precision=auto, the
model's attention implementation, method.init=auto on resume, and the parallel strategy
(`dist:`).

Each returns the config with its `auto` replaced (the run's fingerprint records the choice) and
the line that says what was chosen and why, for the recipe to print once the run directory is
known to be this run's.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from leantune.config import Config
from leantune.config.parse import ParseError, check_value, field_types
from leantune.config.schema import MethodConfig
from leantune.core.allocator import allocator_note
from leantune.core.kernel_caches import bound_kernel_caches
from leantune.core.precision import pick_device, resolve_precision
from leantune.core.threads import configure_threads
from leantune.methods.checks import effective_pack
from leantune.methods.registry import compute_dtype, resolved_init
from leantune.models.attention import resolve_attention
from leantune.models.loading import ModelSource, check_tokenizer_files, load_model_config
from leantune.training.parallel import build_strategy, launched_by_torchrun
from leantune.training.parallel.strategy import ParallelStrategy, SingleProcess
from leantune.training.run.resume import recorded_precision, recorded_setting


def parallel_strategy(cfg: Config) -> ParallelStrategy:
    """How this run is spread over processes (`dist:`): one process, the whole model and
    window, unless dist.strategy names one or torchrun started this process."""
    d = cfg.dist
    if d.strategy == "auto" and not launched_by_torchrun():
        return SingleProcess()
    # The strategy's mixed precision is the run's own, resolved as set-up resolves it (a
    # resumed run's recorded precision included).
    device, resolved, _ = device_and_precision(cfg)
    return build_strategy(
        "ddp" if d.strategy == "auto" else d.strategy,
        backend=d.backend,
        device_type=device.type,
        timeout_s=d.timeout_s,
        bf16=resolved.train.precision == "bf16",
        cpu_offload=d.cpu_offload,
        reshard_after_forward=d.reshard_after_forward,
        zero_stage=d.zero_stage,
        max_grad_norm=resolved.train.max_grad_norm,
    )


def resolved(cfg: Config, source: ModelSource) -> tuple[torch.device, Config, list[str]]:
    """The device, and `cfg` with its precision and attention resolved (`device_and_precision`,
    `attention_implementation`), with the lines that say what auto chose and why."""
    device, cfg, notes = device_and_precision(cfg)
    cfg, attention_note = attention_implementation(cfg, source)
    cfg, start_note = adapter_start(cfg)
    return device, cfg, notes + [n for n in (attention_note, start_note) if n]


def adapter_start(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` with method.init=auto set to the start a resumed run recorded, where auto now picks
    another (a QLoRA run started with B = 0 before LoftQ became its default), and the line that
    says so; otherwise `cfg` unchanged (auto resolves when the method wraps the model)."""
    m = cfg.method
    recorded = recorded_setting(cfg.run_dir, "method.init")
    now = resolved_init(m)
    # Only auto follows the record: an explicit start that differs is another run (refused).
    if m.init != "auto" or recorded is None or recorded == now:
        return cfg, None
    try:
        start = check_value("method.init", recorded, field_types(MethodConfig)["init"])
    except ParseError:  # an edited record: the fingerprint check says what differs
        return cfg, None
    note = (
        f"method.init=auto: the resumed run keeps the start it recorded ({recorded}; auto picks "
        f"{now} for a new {m.name} run)"
    )
    return replace(cfg, method=replace(m, init=start)), note


def device_and_precision(cfg: Config) -> tuple[torch.device, Config, list[str]]:
    """The device, `cfg` with train.precision=auto resolved for it (a resumed run keeps the
    precision it started with), and the lines that say how many CPU threads run and what auto
    chose for the precision and why."""
    device = pick_device(cfg.train.device)
    if device.type == "cpu":
        # Before the precision probe's bf16 matmul, where oneDNN reads the capacities; the
        # `leantune` command set them already, this is for the Python API.
        bound_kernel_caches(os.environ)
    # Threads before the precision probe: it measures (and caches by) the thread count.
    notes: list[str | None] = (
        [configure_threads(), allocator_note()] if device.type == "cpu" else []
    )
    compute = compute_dtype(cfg.method)
    # auto measures the device, and could choose otherwise on a second start: a resumed run
    # keeps the precision its checkpoints were trained in.
    recorded = recorded_precision(cfg.run_dir)
    choice = resolve_precision(cfg.train.precision, device.type, recorded, compute)
    resolved = replace(cfg, train=replace(cfg.train, precision=choice.precision))
    notes.append(choice.note)
    return device, resolved, [n for n in notes if n]


def attention_implementation(cfg: Config, source: ModelSource) -> tuple[Config, str | None]:
    """`cfg` with model.attn_implementation=auto resolved from the model's config (the
    fingerprint records it), and the line that says why auto fell back, if it did.

    Raises:
        UnsupportedAttention: an explicit model.attn_implementation the model cannot use.
    """
    m = cfg.model
    check_tokenizer_files(source, m.trust_remote_code)  # a folder that is no model, said so
    # A resumed run keeps the attention it recorded, even where auto now chooses another.
    recorded = recorded_setting(cfg.run_dir, "model.attn_implementation")
    choice = resolve_attention(
        m.attn_implementation,
        # Packed rows decide auto: only they gain from the segment attention.
        packed=effective_pack(cfg.data.pack, cfg.method.name),
        model_config=load_model_config(source, m.trust_remote_code),
        remote_code=m.trust_remote_code,
        recorded=recorded if isinstance(recorded, str) else None,
    )
    return replace(cfg, model=replace(m, attn_implementation=choice.name)), choice.note
