"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2020), our own small module.

peft 0.21 has no bottleneck adapter (huggingface/peft#244 is still open, #2657 was closed
unmerged) and adapter-hub's `adapters` (1.3.0, the newest on PyPI) pins transformers ~=4.57.6
while leantune runs on transformers 5, so leantune carries these ~200 lines.

Each adapter is `x + up(act(down(x)))` with `down: hidden -> hidden / reduction_factor` and `up`
initialised to zero, so a fresh adapter is an exact identity and the wrapped model starts as the
base. Adapters sit on the output of a block's sub-layer, before the block's residual add:
`houlsby` places one after the attention and one after the MLP of every block, `pfeiffer` one
after the MLP only (found on par with Houlsby at half the adapters). They are non-linear, so they
cannot be merged into the base weights; inference runs them as they are.

On-disk layout (a directory, next to the tokenizer files and `leantune_base.json`):
- `bottleneck_adapter.json`: `{"method": "bottleneck_adapter", "placement": "houlsby"|"pfeiffer",
  "reduction_factor": int, "activation": "relu", "hidden_size": int, "num_layers": int}`
- `bottleneck_adapter.safetensors`: fp32 tensors named
  `layers.{i}.{attn|mlp}.{down|up}.{weight|bias}` (`i` = block index; `down.weight` is
  (bottleneck, hidden), `up.weight` is (hidden, bottleneck)).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from leantune.layout import ModelPaths
from leantune.methods.errors import MethodError
from leantune.methods.freeze import decoder_layers

# Attribute under which each block holds its adapters (a ModuleDict keyed by site).
BLOCK_ATTR = "bottleneck_adapters"
# The sub-layer each site follows, as named in Llama/Qwen2/Mistral-style blocks.
SITE_MODULES = {"attn": "self_attn", "mlp": "mlp"}
PLACEMENTS: dict[str, tuple[str, ...]] = {"houlsby": ("attn", "mlp"), "pfeiffer": ("mlp",)}


@dataclass(frozen=True)
class AdapterSettings:
    """What defines a set of bottleneck adapters (saved as `bottleneck_adapter.json`)."""

    placement: Literal["houlsby", "pfeiffer"] = "pfeiffer"
    """houlsby: after attention and MLP; pfeiffer: after the MLP only."""
    reduction_factor: int = 16
    """hidden size / bottleneck size."""
    activation: Literal["relu"] = "relu"
    """Non-linearity between the projections."""


class BottleneckAdapter(nn.Module):
    """`x + up(relu(down(x)))`, computed in the adapter's dtype; an identity at initialisation."""

    def __init__(self, hidden_size: int, bottleneck: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, bottleneck)
        self.act = nn.ReLU()
        self.up = nn.Linear(bottleneck, hidden_size)
        # `up` starts at zero, so a fresh adapter is an exact identity and the wrapped model
        # starts as the base; `down` keeps its random init, or `up.weight` would get no gradient.
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.enabled = True  # a flag, not hook removal: disable_adapter toggles it per KL pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        # The bottleneck in the adapter's (fp32) dtype; the residual stream keeps the base's.
        delta = self.up(self.act(self.down(x.to(self.down.weight.dtype))))
        return x + delta.to(x.dtype)


def _after_sublayer(adapter: BottleneckAdapter) -> Any:
    """A forward hook that passes a sub-layer's output (or its first element) through `adapter`."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        # Attention returns (hidden, weights, ...); only the hidden states are adapted. The
        # output goes on to the block's residual add, so the adapter sits before it.
        if isinstance(output, tuple):
            return (adapter(output[0]), *output[1:])
        return adapter(output)

    return hook


def _hidden_size(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    return int(config.hidden_size)


def apply_adapter(model: nn.Module, settings: AdapterSettings) -> nn.Module:
    """Add bottleneck adapters to every block of `model` in place; only they train.

    Raises:
        MethodError: a reduction factor the hidden size cannot take.
        ValueError: blocks without the expected sub-layers.
    """
    hidden = _hidden_size(model)
    if settings.reduction_factor < 1 or hidden // settings.reduction_factor < 1:
        raise MethodError(
            f"method.adapter_reduction={settings.reduction_factor}: must be in 1..{hidden} "
            f"(hidden size {hidden})"
        )
    bottleneck = hidden // settings.reduction_factor
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    # Adapters train in fp32 like peft's adapter weights, whatever the base dtype.
    adapter_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    for p in model.parameters():
        p.requires_grad_(False)
    for block in decoder_layers(model):
        sites = nn.ModuleDict()
        for site in PLACEMENTS[settings.placement]:
            sublayer = getattr(block, SITE_MODULES[site], None)
            if not isinstance(sublayer, nn.Module):
                raise ValueError(
                    f"method.name=adapter: block {type(block).__name__} has no "
                    f"'{SITE_MODULES[site]}' sub-layer to place an adapter after"
                )
            adapter = BottleneckAdapter(hidden, bottleneck).to(device, adapter_dtype)
            # A hook, not a replaced sub-layer: the base's module names (and its state_dict's
            # keys) stay as they are.
            sublayer.register_forward_hook(_after_sublayer(adapter))
            sites[site] = adapter
        # Registered on the block, so the adapters' parameters are the model's (optimizer,
        # .to(), named_parameters).
        block.add_module(BLOCK_ATTR, sites)
    model.leantune_adapter = settings  # type: ignore[assignment]
    # The same context-manager name as peft's, so the KL term finds the base the same way.
    model.disable_adapter = functools.partial(disable_adapter, model)  # type: ignore[assignment]
    return model


def adapter_settings(model: nn.Module) -> AdapterSettings | None:
    """The settings of the bottleneck adapters on `model`, or None if it has none."""
    settings = getattr(model, "leantune_adapter", None)
    return settings if isinstance(settings, AdapterSettings) else None


def _adapters(model: nn.Module) -> Iterator[tuple[str, BottleneckAdapter]]:
    for i, block in enumerate(decoder_layers(model)):
        sites = getattr(block, BLOCK_ATTR, None)
        if isinstance(sites, nn.ModuleDict):
            for site, adapter in sites.items():
                assert isinstance(adapter, BottleneckAdapter)
                yield f"layers.{i}.{site}", adapter


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights under the on-disk names (see the module docstring)."""
    return {
        f"{prefix}.{name}": t.detach().contiguous()  # safetensors refuses non-contiguous
        for prefix, adapter in _adapters(model)
        for name, t in adapter.state_dict().items()
    }


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base inside the block (the adapters become identities)."""
    adapters = [a for _, a in _adapters(model)]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True


def save_adapter(model: nn.Module, out_dir: Path) -> None:
    """Write `bottleneck_adapter.json` and `bottleneck_adapter.safetensors` into `out_dir`."""
    settings = adapter_settings(model)
    if settings is None:
        raise ValueError("the model has no bottleneck adapters to save")
    info = {
        "method": "bottleneck_adapter",
        **asdict(settings),
        "hidden_size": _hidden_size(model),
        "num_layers": len(decoder_layers(model)),
    }
    files = ModelPaths(out_dir)
    files.bottleneck_config.write_text(json.dumps(info, indent=2) + "\n")
    save_file(adapter_state_dict(model), str(files.bottleneck_weights))


def load_adapter(model: nn.Module, path: Path) -> nn.Module:
    """Add the adapters saved in `path` to the base `model` and load their weights.

    Raises:
        ValueError: the saved adapters do not fit the model (other size or block count).
    """
    files = ModelPaths(path)
    info = json.loads(files.bottleneck_config.read_text())
    # The adapters are rebuilt from their settings, then filled: apply_adapter also freezes
    # the base and installs the hooks.
    settings = AdapterSettings(
        placement=info["placement"],
        reduction_factor=int(info["reduction_factor"]),
        activation=info.get("activation", "relu"),
    )
    apply_adapter(model, settings)
    weights = load_file(str(files.bottleneck_weights))
    expected = adapter_state_dict(model)
    if set(weights) != set(expected):
        missing, extra = set(expected) - set(weights), set(weights) - set(expected)
        raise ValueError(
            f"{files.bottleneck_weights}: adapters do not fit the base model "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})"
        )
    with torch.no_grad():  # an in-place copy into a leaf that requires grad raises otherwise
        for prefix, adapter in _adapters(model):
            for name, t in adapter.state_dict().items():
                saved = weights[f"{prefix}.{name}"]
                if saved.shape != t.shape:
                    raise ValueError(
                        f"{files.bottleneck_weights}: {prefix}.{name} has shape "
                        f"{tuple(saved.shape)}, the model needs {tuple(t.shape)}"
                    )
                t.copy_(saved)
    return model
