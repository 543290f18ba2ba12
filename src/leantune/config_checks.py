"""Config checks that need limits or installed libraries: sizes that would exhaust memory, and
what qlora, low-bit optimizers and RoPE scaling need from this machine.

Called by `config.validate`; kept apart so that config.py holds the schema and its cross-field
rules, and these stay importable without a Config instance at import time.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from leantune.config_parse import ConfigError
from leantune.methods.registry import METHODS

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
    if t.micro_batch_size != "auto" and micro * t.grad_accum > MAX_ROWS_PER_STEP:
        raise ConfigError(
            f"train.micro_batch_size x train.grad_accum = {micro * t.grad_accum} rows per "
            f"optimizer step: must be <= {MAX_ROWS_PER_STEP}"
        )
    # torch seeds are 64-bit and the data order seeds its generator with seed x 1,000,003.
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"train.seed: must be in [0, 2**32 - 1], got {t.seed}")


def check_libraries(cfg: Config) -> list[str]:
    """qlora, low-bit optimizers and RoPE scaling: what their libraries and devices allow."""
    import importlib.util

    m, t, rope = cfg.method, cfg.train, cfg.model.rope_scaling
    if t.compile:
        check_compiler()
    if rope is not None:
        if rope.factor <= 1:
            raise ConfigError(f"model.rope_scaling.factor: must be > 1, got {rope.factor}")
        original = rope.original_max_position_embeddings
        if original is not None and original < 1:
            raise ConfigError(
                f"model.rope_scaling.original_max_position_embeddings: must be >= 1, got {original}"
            )
    # A base quantised while it loads (qlora's 4-bit NF4) is bitsandbytes' work.
    quantized = METHODS[m.name].base_quantization is not None
    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"method.name={m.name} needs bitsandbytes for the 4-bit base: pip install "
            "'bitsandbytes>=0.50' (CUDA and CPU), or use method.name=lora"
        )
    if quantized and (cfg.model.gguf_file or cfg.model.path.lower().endswith(".gguf")):
        raise ConfigError(
            f"method.name={m.name} cannot start from a GGUF model: transformers refuses to "
            "quantise GGUF weights with bitsandbytes; use an HF safetensors directory or "
            "method.name=lora"
        )
    if quantized and m.compute_dtype == "fp16" and t.precision == "bf16":
        raise ConfigError("method.compute_dtype=fp16 with train.precision=bf16: use bf16 or auto")
    low_compute = m.compute_dtype in ("bf16", "fp16")
    if t.optimizer == "adamw" and not (quantized and low_compute):
        return []
    # Imported only here: the checks need torch (is CUDA there?) and the defaults need nothing.
    import torch

    from leantune.training.optim import OptimizerUnavailable, resolve_optimizer

    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    warnings: list[str] = []
    if quantized and m.compute_dtype == "fp16" and not cuda:
        warnings.append(
            "method.compute_dtype=fp16: 4-bit matmuls in fp16 are emulated (slow) on most CPUs; "
            "method.compute_dtype=fp32 is faster there"
        )
    if quantized and m.compute_dtype == "bf16" and not cuda:
        from leantune.training.precision import bf16_speed_on_cpu

        # bf16 is fast on CPUs with AVX512-BF16/AMX and emulated elsewhere: ask this one.
        if (speed := bf16_speed_on_cpu()).slowdown > 1:
            warnings.append(
                f"method.compute_dtype=bf16: 4-bit matmuls in bf16 are emulated here "
                f"({speed.describe()}); method.compute_dtype=fp32 is faster"
            )
    try:
        backend = resolve_optimizer(t.optimizer, "cuda" if cuda else "cpu")
    except OptimizerUnavailable as e:
        raise ConfigError(str(e)) from e
    return [*warnings, backend.note] if backend.note else warnings


def check_compiler() -> None:
    """Refuse `train.compile` where torch.compile cannot build its kernels (Inductor's CPU code
    is C++, and Triton's launcher on CUDA is compiled too), before anything loads.

    Raises:
        ConfigError: no C++ compiler ($CXX, default g++) on PATH.
    """
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise ConfigError(
            f"train.compile=true needs a C++ compiler for torch.compile's kernels: {cxx!r} is "
            "not on PATH (install g++, or set CXX to one); or set train.compile=false"
        )
