"""What a method adapts, said once per run: the weights each method trains, grouped by kind, and
their parameter counts, so that no family's coverage is a surprise (issue 31).

The report is read off the wrapped model, not off the method's settings: whatever peft resolved
(`target_modules`, `target_parameters`) or leantune trained is what it shows. Sites inside the
decoder blocks are grouped by kind (attention, MLP, shared expert, routed experts, router, other
block weights) and by the blocks they are in; sites outside the blocks are named in full.

Counts are of logical parameters: a 4-bit weight counts the values it stores (its
`quant_state.shape`), not the bytes of its packed storage, and entries a method holds fixed
(`counting.HELD_ATTR`) are not counted as training.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from leantune.methods.adapter import BLOCK_ATTR
from leantune.methods.counting import count_parameters, trained_numel
from leantune.methods.freeze import decoder_layers

SCALED_ATTR = "leantune_scaled"
"""On a peft IA3 layer: the part of its output it scales, when not all of it (e.g. "k, v")."""

# Kinds in the order the report lists them.
KINDS = (
    "attention",
    "mlp",
    "shared expert",
    "routed experts",
    "router",
    "bottleneck adapters after",
    "block",
    "outside blocks",
)
_ATTENTION = {"self_attn", "attn", "attention", "self_attention"}
_MLP = {"mlp", "feed_forward", "ffn", "block_sparse_moe"}
_PEFT_PREFIX = "base_model.model."
# (blocks' container).(block index).(path inside the block); lazy `.*?`: the first `.layers.N.`
# is the decoder's, even where a block holds a `layers` list of its own.
_LAYER = re.compile(r"^(.*?\.layers)\.(\d+)\.(.+)$")


def is_router(name: str) -> bool:
    """A routing gate of an MoE block, by its leaf name: `gate` (the router), `router`, or
    `*_gate` (Qwen2-MoE's `shared_expert_gate`); never `gate_proj` or `gate_up_proj`."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("gate", "router") or leaf.endswith("_gate")


@dataclass(frozen=True)
class Group:
    """Sites of one kind, adapted the same way, in the same blocks."""

    kind: str
    """One of KINDS."""
    names: tuple[str, ...]
    """Leaf names in model order (`q_proj`, `gate_up_proj`); full names outside the blocks."""
    via: str
    """How they are adapted when it is not by wrapping the module: "target_parameters" (peft
    wraps the parameter itself: fused experts), "output scales of k, v" (IA3), ..."""
    layers: int
    """Blocks the sites are in (0 outside the blocks)."""
    params: int
    """Trainable parameters the group adds or trains."""

    def text(self, blocks: int) -> str:
        via = f" via {self.via}" if self.via else ""
        where = "" if not self.layers else f" x {self.layers} layers"
        if self.layers and self.layers != blocks:
            where = f" x {self.layers} of {blocks} layers"
        return f"{self.kind} {', '.join(self.names)}{via}{where} ({self.params:,})"


@dataclass(frozen=True)
class Coverage:
    """What a method adapts on one model, as the run's log and summary.json state it."""

    method: str
    trainable: int
    total: int
    blocks: int
    adapted: tuple[Group, ...]
    routers_frozen: tuple[str, ...]
    """Router leaf names the method leaves frozen (see `lora.resolve_targets`)."""
    experts_missed: tuple[str, ...]
    """Fused expert parameters (leaf names) the method does not reach, though it adapts
    modules inside the blocks: a gap the log warns about."""

    def lines(self) -> list[str]:
        """The log lines: counts, what is adapted, routers kept frozen, experts missed."""
        share = 100 * self.trainable / self.total if self.total else 0.0
        out = [
            f"method {self.method}: {self.trainable:,} of {self.total:,} parameters train "
            f"({share:.3f}%)"
        ]
        if self.trainable == self.total:
            out.append(f"method {self.method} adapts: every parameter")
        elif self.adapted:
            groups = "; ".join(g.text(self.blocks) for g in self.adapted)
            out.append(f"method {self.method} adapts: {groups}")
        if self.routers_frozen:
            out.append(
                f"method {self.method} keeps the MoE routers frozen: "
                f"{', '.join(self.routers_frozen)} x {self.blocks} layers (the training loss has "
                "no load-balancing term to keep a trained router spreading tokens over experts)"
            )
        if self.experts_missed:
            out.append(
                f"warning: method {self.method} does not reach the routed experts "
                f"({', '.join(self.experts_missed)} x {self.blocks} layers: fused expert "
                "parameters, which it cannot adapt); method.name=lora adapts them"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        """summary.json's `adapted` entry."""
        return {
            "method": self.method,
            "groups": [asdict(g) | {"names": list(g.names)} for g in self.adapted],
            "routers_frozen": list(self.routers_frozen),
            "experts_missed": list(self.experts_missed),
        }


def unmatched_target(model: nn.Module, name: str, takes: str, linear: list[str]) -> str:
    """Why `method.target_modules` entry `name` adapts nothing, with what the model has: the
    module it names when that is not one the method takes (`mlp`, a norm), and the leaf names
    of the blocks' linear layers (`linear`: their full names, or fused expert weights too)."""
    leaves = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear})) or "none"
    found = next((m for n, m in model.named_modules() if n == name or n.endswith(f".{name}")), None)
    if found is not None:
        kind = type(found).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        why = f"is {article} {kind}, not a {takes}"
    else:
        why = f"matches no {takes} of this model"
    return (
        f"method.target_modules: {name!r} {why}; the linear layers of its blocks are {leaves} "
        "(or leave method.target_modules unset for the method's default)"
    )


def unwrapped_name(name: str) -> str:
    """A name in the base model's terms: no peft prefix, no `base_layer` hops."""
    name = name.removeprefix(_PEFT_PREFIX)
    return ".".join(part for part in name.split(".") if part != "base_layer")


def adapted_sites(model: nn.Module) -> set[str]:
    """The base model's modules and parameters that peft layers on `model` adapt (base names)."""
    return {site for site, _, _ in _tuner_sites(model)}


def _tuner_sites(model: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
    """(site, via, parameter) for each trainable parameter a peft layer adds: the site is the
    wrapped module, or the wrapped parameter (`...experts.gate_up_proj`) for target_parameters."""
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        site, via = unwrapped_name(name), ""
        parameter_name = getattr(module, "parameter_name", None)
        if isinstance(parameter_name, str):
            # A module's own `weight` (a router's) names the module; a fused expert weight is
            # named by itself (`experts.gate_up_proj`).
            site = site if parameter_name == "weight" else f"{site}.{parameter_name}"
            via = "target_parameters"
        elif hasattr(module, "is_feedforward"):  # IA3
            scaled = getattr(module, SCALED_ATTR, None)
            side = "input scales" if module.is_feedforward else "output scales"
            via = f"{side} of {scaled}" if scaled else side
        assert isinstance(module, nn.Module)
        for pname, p in module.named_parameters():
            if p.requires_grad and not pname.startswith("base_layer."):
                yield site, via, p


def _sites(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Every trained site -> (via, trained parameters)."""
    sites: dict[str, tuple[str, int]] = {}
    seen: set[int] = set()

    def add(site: str, via: str, p: nn.Parameter) -> None:
        # By identity: a peft layer's parameter is met again by named_parameters below, and a
        # tied weight under two names; each counts once, at the first (most specific) site.
        if id(p) in seen:
            return
        seen.add(id(p))
        old = sites.get(site, (via, 0))
        sites[site] = (old[0], old[1] + trained_numel(p))

    for site, via, p in _tuner_sites(model):
        add(site, via, p)
    for name, p in model.named_parameters():
        if p.requires_grad:  # trained in place (full, freeze) or added by leantune or peft
            add(_plain_site(unwrapped_name(name), p), "", p)
    return sites


def _plain_site(name: str, p: nn.Parameter) -> str:
    """The site of a parameter no peft layer added: its module, a fused expert weight itself,
    or the bottleneck adapter it belongs to (`bottleneck_adapters.mlp`)."""
    if p.dim() == 3:  # a fused expert weight is a site of its own, as peft names it
        return name
    parts = name.split(".")
    if BLOCK_ATTR in parts:
        return ".".join(parts[: parts.index(BLOCK_ATTR) + 2])
    return name.rsplit(".", 1)[0]


def _kind(path: str) -> str:
    parts = path.split(".")
    if parts[0] == BLOCK_ATTR:
        return "bottleneck adapters after"
    if is_router(path):
        return "router"
    if any(p.startswith("shared_expert") for p in parts):
        return "shared expert"
    if "experts" in parts:
        return "routed experts"
    if parts[0] in _ATTENTION:
        return "attention"
    if parts[0] in _MLP:
        return "mlp"
    return "block"


def _fused_experts(model: nn.Module) -> list[str]:
    """Leaf names of the blocks' fused expert weights: 3-D parameters (experts x out x in)."""
    names: list[str] = []
    for name, p in model.named_parameters():
        leaf = unwrapped_name(name).rsplit(".", 1)[-1]
        if p.dim() == 3 and _LAYER.match(unwrapped_name(name)) and leaf not in names:
            names.append(leaf)
    return names


def _routers(model: nn.Module) -> list[str]:
    """Leaf names of the blocks' router modules."""
    names: list[str] = []
    for name, module in model.named_modules():
        path = unwrapped_name(name)
        if (
            _LAYER.match(path)
            and is_router(path)
            and any(True for _ in module.parameters(recurse=False))
        ):
            leaf = path.rsplit(".", 1)[-1]
            if leaf not in names:
                names.append(leaf)
    return names


def _groups(model: nn.Module) -> list[Group]:
    """The trained sites grouped by (kind, via, blocks), groups in KINDS order, names (and groups
    of one kind) in model order."""
    order: dict[str, int] = {}
    for i, (name, _) in enumerate(model.named_parameters()):
        path = unwrapped_name(name)
        # Both the parameter and its module: a site is named by either (see `_plain_site`).
        order.setdefault(path, i)
        order.setdefault(path.rsplit(".", 1)[0], i)
    # (in-block path or full name, via) -> blocks it is in (-1: outside), first position, size
    sites: dict[tuple[str, str], tuple[set[int], int, int]] = {}
    for site, (via, n) in _sites(model).items():
        m = _LAYER.match(site)
        key = (m.group(3), via) if m else (site, via)
        layers, first, size = sites.get(key, (set(), 1 << 62, 0))  # 1 << 62: after any position
        layers.add(int(m.group(2)) if m else -1)
        sites[key] = (layers, min(first, order.get(site, 1 << 62)), size + n)
    members: dict[tuple[str, str, frozenset[int]], list[tuple[int, str, int]]] = {}
    for (path, via), (blocks, first, size) in sites.items():
        inside = -1 not in blocks
        kind = _kind(path) if inside else "outside blocks"
        name = path.rsplit(".", 1)[-1] if inside else path.removeprefix("model.")
        # The block set is in the key: q_proj adapted in blocks 0-3 only and k_proj in all
        # blocks are two groups, each saying where.
        group_key = (kind, via, frozenset(blocks) if inside else frozenset[int]())
        members.setdefault(group_key, []).append((first, name, size))
    groups = []
    for (kind, via, in_blocks), items in members.items():
        items.sort()
        group = Group(
            kind, tuple(n for _, n, _ in items), via, len(in_blocks), sum(s for *_, s in items)
        )
        groups.append((KINDS.index(kind), items[0][0], group))
    return [g for *_, g in sorted(groups, key=lambda t: (t[0], t[1]))]


def coverage_of(model: nn.Module, method: str) -> Coverage:
    """What `method` trains on the wrapped `model` (see the module docstring)."""
    adapted = _groups(model)
    trainable, total = count_parameters(model)
    touched = {g.kind for g in adapted}
    # Gaps are only gaps for a method that adapts the blocks' weights (not prompts, not all).
    block_adapter = trainable < total and bool(touched & {"attention", "mlp", "shared expert"})
    missed = _fused_experts(model) if "routed experts" not in touched and block_adapter else []
    frozen = [r for r in _routers(model) if "router" not in touched] if block_adapter else []
    return Coverage(
        method=method,
        trainable=trainable,
        total=total,
        blocks=_block_count(model),
        adapted=tuple(adapted),
        routers_frozen=tuple(frozen),
        experts_missed=tuple(missed),
    )


def _block_count(model: nn.Module) -> int:
    try:
        return len(decoder_layers(model))
    except ValueError:  # no recognisable block list: the report names no "x N layers"
        return 0
