"""The config checks a method owns: what its spec allows (kl_coef, gradient checkpointing,
packed rows, DeepSpeed with a quantised base), its own settings (`MethodSpec.check`), the
libraries and devices qlora and the low-bit optimizers need, and the learning-rate advice.

Run by `training.checks.check_config` after the config's own checks (`config.validate`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from leantune.config.dist import check_deepspeed
from leantune.config.parse import ConfigError, MissingPackage
from leantune.methods.registry import METHODS

if TYPE_CHECKING:
    from leantune.config.schema import Config

LOWBIT_INSTALL = "pip install 'leantune[lowbit]'"
"""What installs bitsandbytes for a 4-bit base (the `lowbit` extra: bitsandbytes>=0.50)."""


def effective_pack(pack: bool | str, method: str) -> bool:
    """data.pack as the run uses it: auto packs unless `method` needs one example per row."""
    if pack == "auto":
        spec = METHODS.get(method)
        # An unknown method name is config validation's to report; packing is the default.
        return spec is None or not spec.needs_unpacked_data
    return bool(pack)


def check_method(cfg: Config) -> list[str]:
    """The method's rules against the rest of the config; returns warnings for risky settings.

    Raises:
        ConfigError: naming the field and the fix.
    """
    t, d, m = cfg.train, cfg.data, cfg.method
    spec = METHODS[m.name]
    if t.kl_coef > 0 and not spec.kl_capable:
        adapters = ", ".join(name for name, s in METHODS.items() if s.kl_capable)
        raise ConfigError(
            f"train.kl_coef needs an adapter method ({adapters}), not method.name={m.name}: "
            "the base is the same model with its adapters disabled"
        )
    if not spec.lora_settings and (m.init not in ("auto", "default") or m.loftq_iter != 1):
        lora = ", ".join(name for name, s in METHODS.items() if s.lora_settings)
        raise ConfigError(
            f"method.init and method.loftq_iter set how LoRA adapters start ({lora}); "
            f"method.name={m.name} has none: leave them unset"
        )
    if spec.check is not None and (error := spec.check(m)) is not None:
        raise ConfigError(error)
    if not spec.supports_gradient_checkpointing and t.gradient_checkpointing is True:
        raise ConfigError(
            f"train.gradient_checkpointing does not work with method.name={m.name}: transformers "
            "drops the KV cache, which holds the prefix, in checkpointed blocks; set it to false"
        )
    if spec.needs_unpacked_data and d.pack is True:
        raise ConfigError(
            f"method.name={m.name} needs data.pack=false (or auto, the default): in a packed row "
            "every example after the first would be computed differently from the same example "
            "alone"
        )
    quantized = spec.base_quantization is not None
    check_deepspeed(cfg.dist, t.precision, t.optimizer, m.name, quantized)
    warnings = check_libraries(cfg)
    lr, advice = t.lr, spec.lr_advice
    if advice is not None and lr is not None and lr >= advice.high:
        warnings.append(
            f"train.lr={lr:g} is high for {advice.what}; the usual range is {advice.usual}"
        )
    # A warning, not an error: large ranks cost memory and rarely help, but are not wrong.
    if spec.lora_settings and m.r is not None and m.r > 64:
        warnings.append(f"method.r={m.r}: LoRA ranks above 64 rarely help; 8..64 is usual")
    return warnings


def check_libraries(cfg: Config) -> list[str]:
    """qlora, low-bit optimizers and RoPE scaling: what their libraries and devices allow."""
    m, t, rope = cfg.method, cfg.train, cfg.model.rope_scaling
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
        # MissingPackage: `bench methods` skips the method with this install line.
        raise MissingPackage(
            f"method.name={m.name} needs bitsandbytes (>=0.50, CUDA and CPU) for the 4-bit "
            f"base: {LOWBIT_INSTALL}, or use method.name=lora",
            LOWBIT_INSTALL,
        )
    if quantized and (cfg.model.gguf_file or cfg.model.path.lower().endswith(".gguf")):
        raise ConfigError(
            f"method.name={m.name} cannot start from a GGUF model: transformers refuses to "
            "quantise GGUF weights with bitsandbytes; use an HF safetensors directory or "
            "method.name=lora"
        )
    if quantized and m.compute_dtype == "fp16" and t.precision == "bf16":
        raise ConfigError("method.compute_dtype=fp16 with train.precision=bf16: use bf16 or auto")
    # Neither a low-bit optimizer nor fp16 4-bit matmuls: nothing below applies, and the
    # early return keeps torch unloaded.
    if t.optimizer == "adamw" and not (quantized and m.compute_dtype == "fp16"):
        return []
    # Imported only here: torch (is CUDA there?) loads only for a low-bit optimizer or compute
    # dtype, so validating a plain config stays torch-free (quick `leantune validate`).
    import torch

    from leantune.core.optim import OptimizerUnavailable, resolve_optimizer  # torch: see above

    # The device the run will train on, as train.device=auto will resolve it on this machine.
    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    warnings: list[str] = []
    if quantized and m.compute_dtype == "fp16" and not cuda:
        warnings.append(
            "method.compute_dtype=fp16: 4-bit matmuls in fp16 are emulated (slow) on most CPUs; "
            "method.compute_dtype=fp32 is faster there"
        )
    # compute_dtype=bf16 on a CPU without bf16 units: `core.precision.resolve_precision` warns
    # at set-up, where measuring the matmul belongs (not in validation).
    try:
        backend = resolve_optimizer(t.optimizer, "cuda" if cuda else "cpu")
    except OptimizerUnavailable as e:
        raise ConfigError(str(e)) from e
    return [*warnings, backend.note] if backend.note else warnings
