"""The one place that maps `method.name` to its `MethodSpec`: how it wraps a model, its default
learning rate, how its base loads, and what it needs from the data, the loop and the planner.

The training loop calls `apply_method` once and never branches on the method again: which
parameters train follows from `requires_grad`, and the saved artefact from the model's type.

The specs are declared here, in one table, rather than beside each method's code (as PEFT's
folder per method does): the config validates against them before anything heavy loads, and
the methods' modules import torch and peft at the top. So each `apply` below is a plain function
that imports its method's module when a model is wrapped.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

# Re-exported: the recipe, planner and tests count parameters through the registry.
from leantune.methods.counting import count_parameters as count_parameters
from leantune.methods.errors import MethodError
from leantune.methods.spec import INIT_REPORT, LrAdvice, MethodSpec

if TYPE_CHECKING:
    from torch import nn

    from leantune.config import MethodConfig
    from leantune.methods.lora import LoraSettings
    from leantune.methods.virtual_init import VirtualInit
    from leantune.models.quantize import Quantization


def _lora_settings(cfg: MethodConfig) -> LoraSettings:
    from leantune.methods.lora import LORA_PRESETS  # torch, peft: when a model is wrapped

    s = LORA_PRESETS[cfg.preset]
    # Each setting given overrides the preset's; unset ones (None) keep it.
    if cfg.r is not None:
        s = replace(s, r=cfg.r)
    if cfg.alpha is not None:
        s = replace(s, alpha=cfg.alpha)
    if cfg.dropout is not None:
        s = replace(s, dropout=cfg.dropout)
    if cfg.target_modules is not None:
        s = replace(s, target_modules=tuple(cfg.target_modules))
    return replace(s, init=resolved_init(cfg), init_required=cfg.init != "auto")


def resolved_init(cfg: MethodConfig) -> str:
    """method.init as the run uses it: auto is the method's `default_init`."""
    return METHODS[cfg.name].default_init if cfg.init == "auto" else cfg.init


def _full(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.full import apply_full  # torch, peft: when a model is wrapped

    return apply_full(model)


def _lora(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.lora import apply_lora  # torch, peft: when a model is wrapped

    return apply_lora(model, _lora_settings(cfg))


def _dora(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.lora import apply_lora  # torch, peft: when a model is wrapped

    return apply_lora(model, replace(_lora_settings(cfg), use_dora=True))


def _qlora(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.qlora import apply_qlora  # torch, peft: when a model is wrapped

    return apply_qlora(model, _lora_settings(cfg))


def _ia3(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.ia3 import apply_ia3  # torch, peft: when a model is wrapped

    if cfg.target_modules is None:
        return apply_ia3(model)
    return apply_ia3(model, tuple(cfg.target_modules))


def _freeze(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.freeze import apply_freeze  # torch, peft: when a model is wrapped

    return apply_freeze(model, cfg.last_blocks, cfg.norms)


def _adapter(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.adapter import (  # torch, peft: when a model is wrapped
        AdapterSettings,
        apply_adapter,
    )

    settings = AdapterSettings(
        placement=cfg.adapter_placement, reduction_factor=cfg.adapter_reduction
    )
    return apply_adapter(model, settings)


def _virtual_init(model: nn.Module, cfg: MethodConfig) -> VirtualInit | None:
    from leantune.methods.virtual_init import VirtualInit  # torch, peft: when a model is wrapped

    if cfg.prompt_init == "random":  # None: peft's own random initialisation
        return None
    # The text is tokenised with the tokenizer saved next to the model weights.
    return VirtualInit(cfg.prompt_init_text, getattr(model, "name_or_path", None))


def _prefix_with(model: nn.Module, cfg: MethodConfig, projection_default: bool) -> nn.Module:
    from leantune.methods.prompt import apply_prefix  # torch, peft: when a model is wrapped

    projection = projection_default if cfg.prefix_projection is None else cfg.prefix_projection
    init = _virtual_init(model, cfg)
    return apply_prefix(model, cfg.num_virtual_tokens, projection, cfg.prefix_hidden_size, init)


# Li & Liang 2021 train prefixes through an MLP; P-Tuning v2's reference code defaults to
# training them directly. Both are peft prefix tuning (see methods/prompt.py).
def _prefix(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    return _prefix_with(model, cfg, projection_default=True)


def _ptuning_v2(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    return _prefix_with(model, cfg, projection_default=False)


def _prompt(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    from leantune.methods.prompt import apply_prompt_tuning  # torch, peft: when a model is wrapped

    return apply_prompt_tuning(model, cfg.num_virtual_tokens, _virtual_init(model, cfg))


def _prompt_check(cfg: MethodConfig) -> str | None:
    if cfg.prompt_init_text is not None and not cfg.prompt_init_text.strip():
        return (
            "method.prompt_init_text: empty, so there are no tokens to start the virtual tokens "
            "from; give a text, or leave it unset to sample word-like vocabulary tokens"
        )
    if cfg.prompt_init == "random" and cfg.prompt_init_text is not None:
        return (
            "method.prompt_init_text is ignored with method.prompt_init=random: "
            "set prompt_init=tokens or drop the text"
        )
    return None


def _targets_check(cfg: MethodConfig, all_linear: bool = True) -> str | None:
    """`method.target_modules` that can only adapt nothing, or not what it says; `all_linear`:
    the method takes LoRA's ["all-linear"]."""
    names = cfg.target_modules
    if names is None:
        return None
    if not names:
        return (
            "method.target_modules: an empty list adapts nothing: name the layers to adapt "
            "(e.g. [q_proj, v_proj]), or leave it unset for the method's default"
        )
    if any(not isinstance(n, str) or not n.strip() for n in names):
        return "method.target_modules: an empty name matches no layer; name the layers to adapt"
    if "all-linear" in names and (len(names) > 1 or not all_linear):
        return (
            "method.target_modules: all-linear stands alone (every linear layer of the blocks) "
            "and is LoRA's; to adapt other layers too, or with method.name=ia3, name each layer"
        )
    return None


def _ia3_check(cfg: MethodConfig) -> str | None:
    return _targets_check(cfg, all_linear=False)


def _lora_check(cfg: MethodConfig) -> str | None:
    """LoRA's scaling alpha / r: alpha 0 makes every update 0 (every gradient 0: the run trains
    nothing and "succeeds"), a negative one negates it."""
    if cfg.alpha is not None and cfg.alpha < 1:
        return (
            f"method.alpha: must be >= 1 (LoRA scales its update by alpha / r, so {cfg.alpha} "
            "trains nothing or the opposite way); leave it unset for the preset's 32, or use "
            "2 x method.r"
        )
    return _init_check(cfg) or _targets_check(cfg)


# Why each LoRA initialisation other than the default is refused, by (init, 4-bit base).
_INIT_REFUSALS: dict[tuple[str, bool], str] = {
    ("loftq", False): "LoftQ fits the adapters to a 4-bit base's quantisation error, and a "
    "full-precision base has none; use method.name=qlora with it, or method.init=default",
    ("pissa", True): "PiSSA moves the top singular components of each float weight into the "
    "adapters, and a 4-bit base has no float weights (peft refuses them); use method.init=loftq, "
    "which fits the adapters to what the 4-bit base lost, or method.init=default",
    ("olora", True): "peft's OLoRA re-quantises each weight minus its adapter part, a 4-bit "
    "base leantune does not save: a saved adapter is reloaded onto the 4-bit form of the "
    "original weights, so eval and export would see another model than the one trained; use "
    "method.init=loftq, or method.init=default",
    ("pissa", False): "not supported yet: PiSSA moves part of each base weight into the "
    "adapters, so the saved adapter would need peft's conversion to plain LoRA and the base "
    "that train.kl_coef and preference objectives compare with (the model with its adapters "
    "off) would not be the base; use method.init=default",
    ("olora", False): "not supported yet: OLoRA moves part of each base weight into the "
    "adapters, so the saved adapter would need peft's conversion to plain LoRA and the base "
    "that train.kl_coef and preference objectives compare with (the model with its adapters "
    "off) would not be the base; use method.init=default",
}


def _init_check(cfg: MethodConfig) -> str | None:
    """method.init and method.loftq_iter against the method: what works on its base."""
    if cfg.loftq_iter < 1:
        return f"method.loftq_iter: must be >= 1, got {cfg.loftq_iter}"
    init = resolved_init(cfg)
    if cfg.loftq_iter != 1 and init != "loftq":
        return (
            f"method.loftq_iter={cfg.loftq_iter} is used only with method.init=loftq: set "
            "method.init=loftq, or drop method.loftq_iter"
        )
    if cfg.loftq_iter > 1:
        return (
            f"method.loftq_iter={cfg.loftq_iter}: passes after the first re-quantise the base "
            "(NF4(W - BA)), which a saved adapter cannot carry (it is reloaded onto NF4(W), so "
            "eval and export would see another model); use method.loftq_iter=1, which keeps "
            "the 4-bit base loading made and fits the adapters to its error"
        )
    why = _INIT_REFUSALS.get((init, METHODS_4BIT.get(cfg.name, False)))
    if why is None:
        return None
    return f"method.init={init} with method.name={cfg.name}: {why}"


def _qlora_quantization(cfg: MethodConfig, precision: str) -> Quantization:
    from leantune.models.quantize import Quantization  # torch, peft: when a model is wrapped

    # compute_dtype=auto follows the run's autocast precision, so the 4-bit matmuls and the rest
    # of the step share a dtype.
    compute = cfg.compute_dtype if cfg.compute_dtype != "auto" else precision
    if compute == "auto":
        raise ValueError(
            "base_quantization needs the resolved train.precision "
            "(core.precision.resolve_precision), not auto"
        )
    return Quantization(quant_type="nf4", double_quant=cfg.double_quant, compute_dtype=compute)


def _freeze_check(cfg: MethodConfig) -> str | None:
    if cfg.last_blocks == 0 and not cfg.norms:
        return "method.name=freeze trains nothing: set method.last_blocks or norms"
    return None


# Default learning rates are measured: `leantune bench methods --sweep` on two tasks with the
# demo model (the support desk and generated instructions; benchmarks/results/sweep-demo-cpu.md
# and sweep-instructions-cpu.md: 20 steps of 4 examples, log-spaced rates ~3.16x apart, scored by
# held-out loss on a validation split). Each default is the LOWER of the two tasks' best rates:
# a rate too low costs speed, one too high diverges, and larger models want lower rates (the
# seeds: LoRA ~3x a base rate, full ~0.1x LoRA). A task's best is the highest rate whose loss is
# within 3% of its lowest (one seed and 32 validation messages do not separate closer ones).
# The comment by each says what the sweeps chose.
METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "full",
            "every weight",
            _full,
            default_lr=1e-4,  # best: support desk 3e-4, instructions 1e-4 (3e-4 worse than 3e-5)
            trains_base_weights=True,
            mergeable=True,
            lr_advice=LrAdvice(high=3e-4, usual="1e-5..1e-4", what="full fine-tuning"),
        ),
        MethodSpec(
            "lora",
            "low-rank adapters (peft)",
            _lora,
            default_lr=2e-3,  # best: support desk 6e-3 (2e-3 within 3%), instructions 2e-3
            mergeable=True,
            lora_settings=True,
            check=_lora_check,
            lighter_fallback=True,
        ),
        MethodSpec(
            "dora",
            "weight-decomposed LoRA (peft `use_dora`)",
            _dora,
            default_lr=2e-3,  # best: support desk 2e-3, instructions 6e-4 (2e-3 within 2%)
            mergeable=True,
            lora_settings=True,
            check=_lora_check,
        ),
        MethodSpec(
            "qlora",
            "LoRA on a 4-bit NF4 base (bitsandbytes; CUDA and CPU)",
            _qlora,
            default_lr=6e-4,  # best: support desk >= 2e-3, instructions 6e-4 (2e-3 8% worse)
            base_quantization=_qlora_quantization,
            mergeable=True,  # into the dequantised base (export/source.py)
            lora_settings=True,
            # Better than B = 0 on both tasks at 40 steps (docs/guides/methods.md).
            default_init="loftq",
            check=_lora_check,
            # The same adapters as LoRA: the meta model cannot be quantised, `weight_quant` is.
            planned_as="lora",
            planned_weight_quant="nf4-dq",
            lighter_fallback=True,
        ),
        MethodSpec(
            "ia3",
            "learned rescaling vectors (peft)",
            _ia3,
            # best: support desk 3e-2, instructions 1e-2 (3e-3 far worse on both: in 20 steps
            # the scales moved 5% / 11% / 31% from 1 at 1e-2 / 3e-2 / 1e-1 on the support desk).
            default_lr=1e-2,
            mergeable=True,
            check=_ia3_check,
            lighter_than_fallbacks=True,
        ),
        MethodSpec(
            "freeze",
            "the last `method.last_blocks` blocks and/or the norms",
            _freeze,
            default_lr=1e-3,  # best: support desk 1e-3, instructions 3e-3
            trains_base_weights=True,
            mergeable=True,
            check=_freeze_check,
        ),
        MethodSpec(
            "adapter",
            "bottleneck adapters, our own module (peft has none)",
            _adapter,
            # best: support desk 6e-3, instructions 2e-3. Non-linear: nothing to merge.
            default_lr=2e-3,
        ),
        MethodSpec(
            "prefix",
            "prefix tuning (peft), prefixes through an MLP",
            _prefix,
            default_lr=3e-4,  # best: support desk 1e-3, instructions 3e-4 (1e-2 diverged)
            needs_unpacked_data=True,
            check=_prompt_check,
            supports_gradient_checkpointing=False,
        ),
        MethodSpec(
            "ptuning_v2",
            "deep prompt tuning on every layer (peft prefix tuning without the MLP)",
            _ptuning_v2,
            default_lr=3e-2,  # best: support desk 3e-2, instructions 3e-2
            needs_unpacked_data=True,
            check=_prompt_check,
            supports_gradient_checkpointing=False,
        ),
        MethodSpec(
            "prompt",
            "prompt tuning: learned input embeddings (peft)",
            _prompt,
            default_lr=3e-2,  # best: support desk 1e-1, instructions 3e-2
            needs_unpacked_data=True,
            check=_prompt_check,
        ),
    )
}

METHODS_4BIT = {name: spec.base_quantization is not None for name, spec in METHODS.items()}
"""Whether each method trains on a quantised base (what a LoRA initialisation can use)."""
PROMPT_LEARNING_METHODS = tuple(n for n, spec in METHODS.items() if spec.needs_unpacked_data)
"""The methods whose virtual tokens need one example per row."""
DEFAULT_LR: dict[str, float] = {name: spec.default_lr for name, spec in METHODS.items()}
"""`train.lr` when unset, by method (the specs' `default_lr`)."""

BASE_QUANTIZATION = {
    name: spec.base_quantization
    for name, spec in METHODS.items()
    if spec.base_quantization is not None
}
"""Methods whose base must be quantised while it loads: name -> (method config,
train.precision) -> how. The recipe passes the result to `load_model`; every other method loads
full precision."""


def base_quantization(cfg: MethodConfig, precision: str) -> Quantization | None:
    """How `load_model` must quantise the base for this method (None = not at all)."""
    make = METHODS[cfg.name].base_quantization
    return make(cfg, precision) if make is not None else None


def compute_dtype(cfg: MethodConfig) -> str:
    """The dtype the method asks the resolved train.precision for: `method.compute_dtype` for a
    quantised base (its 4-bit matmuls), else "auto"."""
    return cfg.compute_dtype if METHODS[cfg.name].base_quantization is not None else "auto"


def apply_method(model: nn.Module, cfg: MethodConfig) -> nn.Module:
    """Freeze the base and wrap `model` with the configured method.

    Raises:
        MethodError: the method's settings do not fit the model, or leave nothing to train on
            it (a run that trains nothing would "succeed" with every gradient 0).
    """
    # Frozen first, whatever the method: each method then turns on only what it trains, and
    # the loop learns what trains from requires_grad alone.
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = METHODS[cfg.name].apply(model, cfg)
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise MethodError(
            f"method.name={cfg.name} leaves nothing to train on this model: check the method.* "
            "settings against the model's layers (the log's coverage line lists what a method "
            "adapts), or use another method"
        )
    return wrapped


def init_line(model: nn.Module, cfg: MethodConfig) -> str | None:
    """The run log's line on how a LoRA method's adapters started (None for other methods)."""
    if not METHODS[cfg.name].lora_settings:
        return None
    init = resolved_init(cfg)
    # Which start auto picked is said, since it differs by method.
    how = f"method.init=auto, {cfg.name}'s default; " if cfg.init == "auto" else ""
    if init == "default":
        return f"LoRA initialisation: default ({how}B = 0: the model starts as its base)"
    report = getattr(model, INIT_REPORT, None)  # set by the method's apply (methods.qlora)
    detail = report.line() if report is not None else "no report"
    if getattr(report, "skipped", None) is not None:
        init = "default"
    return f"LoRA initialisation: {init} ({how}{detail})"


def trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters that train, by name (shared parameters appear once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def merge_for_inference(model: nn.Module) -> nn.Module:
    """Fold adapter weights into the base in place where peft can (LoRA: W + BA), so evaluation
    after training pays no adapter overhead. Call only after the trained model has been saved.

    A 4-bit base is left unmerged."""
    from leantune.models.quantize import is_quantized  # torch, peft: when a model is wrapped

    # Merging into a 4-bit base re-quantises W + BA: a different model from the one trained
    # and saved (the 4-bit base plus the fp32 adapter).
    if is_quantized(model):
        return model
    merge = getattr(model, "merge_adapter", None)
    if callable(merge):  # methods without merge_adapter (prompts, bottleneck adapters) run as is
        merge()
    return model
