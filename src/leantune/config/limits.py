"""Config limits: sizes that would exhaust memory, and the C++ compiler `train.compile` needs.

Called by `config.validate`.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from leantune.config.parse import ConfigError

if TYPE_CHECKING:
    from leantune.config import Config

MAX_SEQ_LEN = 2**20
"""Longest data.max_seq_len: packing allocates per token of it (1,048,576 = a 1M context)."""
MAX_ROWS_PER_STEP = 2**20
"""Most rows in one optimizer step: the step's sample order is built in memory."""
MAX_METHOD_SIZE = 2**16
"""Largest LoRA rank, virtual-token count or prefix MLP width: each allocates that many rows."""


def check_sizes(cfg: Config) -> None:
    """Upper bounds on integers that would otherwise exhaust memory or overflow later."""
    t, d, m = cfg.train, cfg.data, cfg.method
    # auto is resolved at set-up: 1, its smallest value, stands in for it here.
    micro = 1 if t.micro_batch_size == "auto" else t.micro_batch_size
    limits: dict[str, tuple[int | None, int]] = {
        "data.max_seq_len": (None if d.max_seq_len == "auto" else d.max_seq_len, MAX_SEQ_LEN),
        "train.micro_batch_size": (micro, MAX_ROWS_PER_STEP),
        "train.grad_accum": (t.grad_accum, MAX_ROWS_PER_STEP),
        "train.global_batch_size": (t.global_batch_size, MAX_ROWS_PER_STEP),
        "method.r": (m.r, MAX_METHOD_SIZE),
        "method.num_virtual_tokens": (m.num_virtual_tokens, MAX_METHOD_SIZE),
        "method.prefix_hidden_size": (m.prefix_hidden_size, MAX_METHOD_SIZE),
    }
    for key, (value, limit) in limits.items():
        if value is not None and value > limit:
            raise ConfigError(f"{key}: must be <= {limit}, got {value}")
    # Each factor may be under the bound while their product is not.
    if t.micro_batch_size != "auto" and micro * t.grad_accum > MAX_ROWS_PER_STEP:
        raise ConfigError(
            f"train.micro_batch_size x train.grad_accum = {micro * t.grad_accum} rows per "
            f"optimizer step: must be <= {MAX_ROWS_PER_STEP}"
        )
    # torch seeds are 64-bit and the data order seeds its generator with seed x 1,000,003.
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"train.seed: must be in [0, 2**32 - 1], got {t.seed}")


def check_compiler() -> None:
    """Refuse `train.compile` where torch.compile cannot build its kernels.

    Raises:
        ConfigError: no C++ compiler ($CXX, default g++) on PATH.
    """
    # Inductor's CPU kernels are C++ and Triton's CUDA launcher is compiled too, so either
    # device needs one; checked here, before anything loads, not at the first compiled step.
    # $CXX, else g++: the compiler Inductor itself picks on Linux.
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise ConfigError(
            f"train.compile=true needs a C++ compiler for torch.compile's kernels: {cxx!r} is "
            "not on PATH (install g++, or set CXX to one); or set train.compile=false"
        )
