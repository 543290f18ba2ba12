"""The config's checks within and across fields, needing nothing but the config itself.

Checks that need a registry (which methods take kl_coef, what an objective reads, whether a
template exists) are their owners' (`methods.checks`, `objectives.checks`, `data.templates`,
`monitor.backends`), run with these by `training.checks.check_config`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from leantune.config.dist import check_dist
from leantune.config.limits import check_compiler, check_sizes
from leantune.config.monitor import check_monitor
from leantune.config.parse import ConfigError, ParseError, memory_size
from leantune.config.schema import (
    DEFAULT_BATCH_EXAMPLES,
    Config,
    GuardConfig,
    RunConfig,
    TrainConfig,
)

COMPILE_ONE_PROCESS = (
    "train.compile=true runs in one process; with dist.strategy={strategy} set train.compile=false"
)


def validate(cfg: Config) -> list[str]:
    """Cross-field checks: raises ConfigError when invalid, returns warnings for risky settings."""
    t, d = cfg.train, cfg.data
    # First: NaN passes every range check below (all its comparisons are false).
    _check_finite(cfg)
    check_sizes(cfg)
    # None for auto: set-up resolves it (from the data or the memory), so no bound applies yet.
    positive = {
        "train.max_steps": t.max_steps,
        "train.epochs": t.epochs,
        "train.micro_batch_size": None if t.micro_batch_size == "auto" else t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "train.grad_accum": t.grad_accum,
        "train.keep_last": t.keep_last,
        "train.eval_batch_size": t.eval_batch_size,
        "train.max_new_tokens": None if t.max_new_tokens == "auto" else t.max_new_tokens,
        "data.max_seq_len": None if d.max_seq_len == "auto" else d.max_seq_len,
    }
    for key, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if t.eval_every < 0 or t.eval_every_sample < 0:
        raise ConfigError("train.eval_every and train.eval_every_sample must be >= 0")
    if t.eval_every and d.eval is None:
        raise ConfigError("train.eval_every: needs data.eval (a held-out file)")
    if t.save_every < 0:
        raise ConfigError(
            f"train.save_every: must be >= 0 (0 = only at the end), got {t.save_every}"
        )
    if t.lr is not None and not 0 < t.lr < 1:
        raise ConfigError(f"train.lr: must be in (0, 1), got {t.lr}")
    for key, ratio in {
        "train.warmup_ratio": t.warmup_ratio,
        "train.min_lr_ratio": t.min_lr_ratio,
        "data.max_bad_fraction": d.max_bad_fraction,
    }.items():
        if not 0 <= ratio <= 1:
            raise ConfigError(f"{key}: must be in [0, 1], got {ratio}")
    if t.kl_coef < 0:
        raise ConfigError(f"train.kl_coef: must be >= 0, got {t.kl_coef}")
    if t.weight_decay < 0 or t.max_grad_norm < 0:
        raise ConfigError("train.weight_decay and train.max_grad_norm must be >= 0")
    _validate_data(cfg)
    if t.precision == "fp16" and t.device == "cpu":
        raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); use bf16 on CPU")
    if t.memory_budget is not None:
        # Parsed only to refuse a bad size now; the run parses it again where it is used.
        parse_memory_size(t.memory_budget, "train.memory_budget")
    _validate_guard(cfg.guard)
    _validate_run(cfg.run)
    check_monitor(cfg.monitor)
    _validate_method(cfg)
    check_dist(cfg.dist, t.device, t.eval_every)
    if t.compile and cfg.dist.strategy != "auto":
        raise ConfigError(COMPILE_ONE_PROCESS.format(strategy=cfg.dist.strategy))
    if t.compile:
        check_compiler()  # last: the one check that looks outside the config (PATH)
    warnings: list[str] = []
    # Under 30 steps even 3% is less than one warmup step, so the advice would not apply.
    if (t.max_steps or 0) >= 30 and 0 < t.warmup_ratio < 0.03:
        warnings.append(f"train.warmup_ratio={t.warmup_ratio:g} is short; 0.03..0.1 is usual")
    return warnings


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Refuse NaN and infinity in every float field of `obj` and its nested sections."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        # is_dataclass is true of a dataclass class too; only an instance holds values.
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_finite(value, f"{key}.")


def _validate_data(cfg: Config) -> None:
    t, d = cfg.train, cfg.data
    if d.train is None:
        raise ConfigError("data.train: required; set it to a JSONL file (data.train=path.jsonl)")
    for key, file in (("data.train", d.train), ("data.eval", d.eval)):
        # A directory is a prepared dataset (from `leantune prepare`).
        if file is not None and not _exists(Path(file)):
            raise ConfigError(f"{key}: file {file} does not exist")
    if not 0 < d.near_dup_threshold <= 1:
        raise ConfigError(f"data.near_dup_threshold: must be in (0, 1], got {d.near_dup_threshold}")
    if d.min_tokens < 0 or (d.partition_mb is not None and d.partition_mb <= 0):
        raise ConfigError("data.min_tokens must be >= 0 and data.partition_mb > 0")
    # Exact match compares generated answers with the reference ones: text records have none.
    if t.eval_exact_match and (d.eval is None or d.format == "text"):
        raise ConfigError(
            "train.eval_exact_match: needs data.eval and a chat or alpaca data.format"
        )


def _exists(path: Path) -> bool:
    """True for an existing file or directory; False also for names the OS refuses (too long)."""
    try:
        return path.is_file() or path.is_dir()
    except (OSError, ValueError):
        return False


def _validate_method(cfg: Config) -> None:
    m = cfg.method
    if m.last_blocks < 0:
        raise ConfigError(f"method.last_blocks: must be >= 0, got {m.last_blocks}")
    if m.r is not None and m.r < 1:
        raise ConfigError(f"method.r: must be >= 1, got {m.r}")
    if m.dropout is not None and not 0 <= m.dropout < 1:
        raise ConfigError(f"method.dropout: must be in [0, 1), got {m.dropout}")
    sizes: dict[str, int | None] = {
        "method.adapter_reduction": m.adapter_reduction,
        "method.num_virtual_tokens": m.num_virtual_tokens,
        "method.prefix_hidden_size": m.prefix_hidden_size,
    }
    for key, size in sizes.items():
        if size is not None and size < 1:
            raise ConfigError(f"{key}: must be >= 1, got {size}")


def _validate_guard(g: GuardConfig) -> None:
    for key, value in {
        "guard.loss_sigmas": g.loss_sigmas,
        "guard.grad_sigmas": g.grad_sigmas,
    }.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key, value in {
        "guard.loss_min_ratio": g.loss_min_ratio,
        "guard.grad_min_ratio": g.grad_min_ratio,
    }.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1 (a multiple of the median), got {value}")
    if not 2 <= g.warmup <= g.window:
        raise ConfigError(
            f"guard.warmup={g.warmup}, guard.window={g.window}: need 2 <= warmup <= window"
        )
    if g.max_consecutive_skips < 1 or g.max_rollbacks < 0:
        raise ConfigError("guard.max_consecutive_skips must be >= 1 and guard.max_rollbacks >= 0")
    if not 0 < g.lr_factor < 1:
        raise ConfigError(f"guard.lr_factor: must be in (0, 1), got {g.lr_factor}")


RUN_NAME_MAX = 100
# No '/': a name never leaves runs/. Not starting with '.' or '-': no hidden directory, no
# name a shell command reads as an option.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_NAME_BYTES = 255  # the longest file name ext4, xfs, btrfs, APFS and NTFS allow


def configured_global_batch(t: TrainConfig) -> int:
    """Rows per optimizer step as configured (DEFAULT_BATCH_EXAMPLES rows for
    micro_batch_size=auto without train.global_batch_size)."""
    # The value before the data is read: run_setup resolves auto from the data first, and a
    # smaller dataset lowers it.
    if t.micro_batch_size == "auto":
        return t.global_batch_size or DEFAULT_BATCH_EXAMPLES
    return t.micro_batch_size * t.grad_accum


def _validate_run(r: RunConfig) -> None:
    """run.name is a name (not a path), run.dir a path whose every component a file system can
    hold."""
    # A path as a name (`../../x`) would write outside runs/.
    if len(r.name) > RUN_NAME_MAX or not _RUN_NAME.fullmatch(r.name):
        # Cut: the message must stay readable whatever was given.
        shown = repr(r.name) if len(r.name) <= 40 else f"{r.name[:40]!r}... ({len(r.name)} chars)"
        raise ConfigError(
            f"run.name={shown}: a run name is 1 to {RUN_NAME_MAX} letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (no '/', no '..'); for a path use run.dir"
        )
    if r.dir is None:
        return
    if not r.dir.strip():
        raise ConfigError("run.dir: empty; leave it unset for runs/<run.name>")
    for part in Path(r.dir).parts:
        # The limit is in bytes, and a non-ASCII character takes several.
        if len(part.encode()) > _MAX_NAME_BYTES:
            raise ConfigError(
                f"run.dir: the component {part[:40]!r}... is {len(part.encode())} bytes; file "
                f"systems allow at most {_MAX_NAME_BYTES}"
            )


def parse_memory_size(text: str, key: str = "memory size") -> int:
    """Bytes in a size such as "20GiB", "512 MiB", "1.5GB" or "1000000" (binary and SI units).

    Raises:
        ConfigError: not a positive size, naming `key`.
    """
    try:
        return memory_size(text, key)
    except ParseError as e:
        raise ConfigError(str(e)) from None
