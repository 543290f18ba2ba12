"""LoRA through peft: low-rank adapters on the chosen linear layers, base weights frozen."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from peft import LoraConfig, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from leantune.methods.coverage import adapted_sites, is_router, unmatched_target
from leantune.methods.errors import MethodError
from leantune.methods.freeze import decoder_layers

LINEAR = (nn.Linear, Conv1D)
"""What "all-linear" adapts, as peft's own "all-linear" does (GPT-2-style blocks use Conv1D)."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters."""

    r: int = 16
    """Rank of the update."""
    alpha: int = 32
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input. Off by default: it costs a copy of every adapted layer's
    input (measured +35% forward time on CPU) and short fine-tunes rarely overfit."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt; ("all-linear",) = every weight of the blocks (see
    `resolve_targets`): linear layers and fused expert weights, not the MoE routers, not lm_head."""
    use_dora: bool = False
    """DoRA: split each weight into magnitude and direction and adapt the direction with LoRA."""
    init: str = "default"
    """How the adapters start: default (B = 0) here; loftq is QLoRA's (`methods.qlora`)."""
    init_required: bool = True
    """The start was asked for by name: one that cannot run fails the run. False where
    method.init=auto chose it: QLoRA then keeps its default start and says why."""


LORA_PRESETS: dict[str, LoraSettings] = {
    # The QLoRA paper found all linear layers necessary to match full fine-tuning.
    "default": LoraSettings(),
    # The source articles' setting.
    "seed": LoraSettings(r=8, alpha=32, dropout=0.1, target_modules=("q_proj", "v_proj")),
}


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a peft LoRA (or DoRA) model; only adapter weights train (kept in fp32).

    Raises:
        MethodError: a target name matches nothing, DoRA on fused expert weights (peft has no
            DoRA for them), or peft adapted other weights than those `resolve_targets` chose.
    """
    if settings.init != "default":
        raise MethodError(
            f"method.init={settings.init} does not work with this method's LoRA: use "
            "method.init=default (loftq is method.name=qlora's)"
        )
    modules, parameters = resolve_targets(model, settings.target_modules)
    if settings.use_dora and parameters:
        raise MethodError(
            "method.name=dora: peft's DoRA cannot adapt fused expert weights "
            f"({', '.join(sorted({p.rsplit('.', 1)[-1] for p in parameters}))}, the routed "
            "experts of this MoE model); use method.name=lora, or name the layers to adapt in "
            "method.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj])"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=modules,
        target_parameters=parameters or None,
        bias="none",
        use_dora=settings.use_dora,
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        # autocast_adapter_dtype: the adapter weights in fp32 on a bf16/fp16 base, so their
        # small updates are not rounded away.
        wrapped = get_peft_model(model, config, autocast_adapter_dtype=True)
    # peft 0.21 rewrites the targets of some MoE families (its transformers-4 compatibility
    # mapping moves `*.down_proj`, `*.gate_proj`, ... to `target_parameters`), which would drop
    # dense layers of the same name: the wrapping is checked against what was asked.
    _check_adapted(wrapped, set(modules) | {p.removesuffix(".weight") for p in parameters})
    return wrapped


def resolve_targets(model: nn.Module, names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The full names of the modules and of the parameters (peft `target_parameters`) LoRA
    adapts, whatever the family.

    ("all-linear",): every linear layer inside the decoder blocks and every fused expert weight
    there (a 3-D `experts x out x in` parameter), shared experts included; MoE routers (`gate`,
    `shared_expert_gate`) stay frozen in every family unless named.

    Other names: the linear and embedding layers and fused expert weights whose name is, or
    ends with, the name (anywhere in the model: `embed_tokens`, `lm_head` too).

    Raises:
        MethodError: a name that matches nothing, with the names the blocks have.
    """
    blocks = _block_prefix(model)
    # The model's own layers only: on an already wrapped model, lora_A/lora_B are nn.Linear too.
    own = [(n, m) for n, m in model.named_modules() if not _inside_tuner(n)]
    linear = [n for n, m in own if isinstance(m, LINEAR) and n.startswith(blocks)]
    # transformers 5 stores the routed experts of Mixtral, Qwen2-MoE and Qwen3-MoE as 3-D
    # parameters, where peft's own "all-linear" finds no nn.Linear (and, for Qwen2-MoE, skips
    # them): they are found here and passed as target_parameters.
    fused = [n for n, p in model.named_parameters() if p.dim() == 3 and n.startswith(blocks)]
    if names == ("all-linear",):
        # Routers stay frozen: the training loss has no load-balancing term, so a trained
        # router may send every token to a few experts.
        return [n for n in linear if not is_router(n)], fused
    wrappable = [n for n, m in own if isinstance(m, (*LINEAR, nn.Embedding))]
    # transformers 5 routers are custom modules around a 2-D weight: peft wraps the weight.
    router_weights = [
        f"{n}.weight"
        for n, m in own
        if n.startswith(blocks)
        and is_router(n)
        and not isinstance(m, LINEAR)
        and isinstance(getattr(m, "weight", None), nn.Parameter)
    ]
    modules, parameters = [], []
    for name in names:
        hit_modules = [n for n in wrappable if n == name or n.endswith(f".{name}")]
        hit_params = [n for n in fused if n == name or n.endswith(f".{name}")] + [
            w for w in router_weights if w.endswith((f".{name}.weight", f".{name}"))
        ]
        if not hit_modules and not hit_params:
            takes = "linear or embedding layer or expert weight"
            raise MethodError(unmatched_target(model, name, takes, linear + fused))
        # No duplicates: two names may match one layer (`q_proj` and `self_attn.q_proj`).
        modules += [n for n in hit_modules if n not in modules]
        parameters += [n for n in hit_params if n not in parameters]
    return modules, parameters


def _block_prefix(model: nn.Module) -> str:
    """The name prefix of the decoder blocks' weights (`model.layers.`)."""
    layers = decoder_layers(model)
    return next(f"{n}." for n, m in model.named_modules() if m is layers)


def _inside_tuner(name: str) -> bool:
    """A layer peft added (lora_A, lora_B, ...), not one of the model's own."""
    return any(part.startswith(("lora_", "ia3_")) for part in name.split("."))


def _check_adapted(model: nn.Module, asked: set[str]) -> None:
    """Refuse a wrapping whose adapted sites are not `asked`.

    Raises:
        MethodError: naming the sites missing and unexpected.
    """
    got = adapted_sites(model)
    if got != asked:
        missing, extra = sorted(asked - got), sorted(got - asked)
        raise MethodError(
            f"method.target_modules: peft adapted other weights than asked (missing "
            f"{missing[:4]}, unexpected {extra[:4]}); name the layers to adapt in "
            "method.target_modules"
        )


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence peft 0.21's call of transformers' deprecated `is_gradient_checkpointing`: a
    FutureWarning users can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield
