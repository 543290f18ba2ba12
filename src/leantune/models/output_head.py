"""What a causal LM does between its output projection and the logits it returns.

The training loss runs the projection itself, only at supervised positions
(`models.loss`), so it must apply what the model's own forward applies after it:
Gemma 2 soft-caps its logits (`cap * tanh(z / cap)`), Cohere multiplies them by `logit_scale`,
Granite divides them by `logits_scaling`. `decide_output_head` reads the known transforms from
the config and checks them against the model itself, once, on a few tokens: a forward hook on
the output projection captures what it returns during `model(...)`, and the returned logits
must equal that with the known transform applied. When they do not (a transform no config
field names: remote code, a model leantune has never seen), the decision is the model's own
forward, which is slower but always right.

The decision lives on the model (`OUTPUT_HEAD_ATTR`), made by the loader, so every user of the
loss (training, the data-parallel loss modules, evaluation) and every wrapper around the model
(peft reads attributes through to the base model) sees the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

OUTPUT_HEAD_ATTR = "leantune_output_head"
"""The model attribute that holds its `OutputHead` decision."""

PROBE_TOKENS = 8
"""Tokens the check runs the model on: enough to compare logits, cheap for any model size."""


@dataclass(frozen=True)
class OutputHead:
    """How the loss turns the output projection's result `z` into the model's logits:
    `softcap * tanh(scale * z / softcap)` (without the tanh when `softcap` is None), or, with
    `own_forward`, not at all: the loss takes the logits of the model's own forward."""

    scale: float = 1.0
    softcap: float | None = None
    own_forward: bool = False
    note: str | None = None
    """Why the model's own forward is used, for the log; None when it is not."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The known transform of `logits` (the projection's output), in their dtype."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


IDENTITY = OutputHead()


def declared_head(config: object) -> OutputHead:
    """The transform the config's fields declare (the fields transformers' models read)."""
    scale = 1.0
    logit_scale = getattr(config, "logit_scale", None)  # Cohere, Cohere 2: multiplies
    # bool is an int subclass: a flag named like the field is not a scale.
    if isinstance(logit_scale, (int, float)) and not isinstance(logit_scale, bool):
        scale *= float(logit_scale)
    logits_scaling = getattr(config, "logits_scaling", None)  # Granite: divides
    if isinstance(logits_scaling, (int, float)) and logits_scaling:  # 0 would divide by zero
        scale /= float(logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 (and 3, when set)
    return OutputHead(scale=scale, softcap=float(softcap) if softcap else None)


def output_head(model: nn.Module) -> OutputHead:
    """The model's decision (`decide_output_head`), made now if nothing has made it yet (a
    model built outside the loader). Wrappers (peft) pass the attribute through to the model."""
    found = getattr(model, OUTPUT_HEAD_ATTR, None)
    if isinstance(found, OutputHead):
        return found
    return decide_output_head(model)


def decide_output_head(model: nn.Module) -> OutputHead:
    """Check the declared transform against the model's own forward on `PROBE_TOKENS` tokens
    and record the decision on the model (`OUTPUT_HEAD_ATTR`); returns it."""
    decided = _probe(model)
    # On the innermost transformers model, so that peft wrappers made later still reach it
    # (peft reads attributes through to the base model); on the wrapper too when there is one.
    target = _innermost(model)
    setattr(target, OUTPUT_HEAD_ATTR, decided)
    if target is not model:
        setattr(model, OUTPUT_HEAD_ATTR, decided)
    return decided


def _innermost(model: nn.Module) -> nn.Module:
    """The transformers model inside peft's wrappers, where the decision is stored: peft
    wrappers made later still reach it."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return base if isinstance(base, nn.Module) else model


def _probe(model: nn.Module) -> OutputHead:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Module) or config is None:
        return _own_forward(model, "it has no output projection the loss can run")
    # A hook on the projection captures its result during the model's own forward: the logits
    # that forward returns must be that result with the known transform applied.
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    try:
        logits = _probe_logits(model, config)
    finally:
        hook.remove()
    # Called more than once, or to another shape (a model that slices positions or projects
    # twice): no transform of one projection explains the logits.
    if logits is None or len(captured) != 1 or captured[0].shape != logits.shape:
        return _own_forward(model, "its output projection's result is not its logits' shape")
    z = captured[0]
    declared = declared_head(config)
    # IDENTITY too: a config may declare a field its model's forward does not apply.
    for candidate in (declared, IDENTITY):
        if _close(candidate.apply(z.float()), logits, z.dtype):
            return candidate
    return _own_forward(
        model,
        "its forward changes the output projection's logits in a way leantune does not know "
        f"(checked against {_describe(declared)})",
    )


@torch.no_grad()
def _probe_logits(model: nn.Module, config: object) -> torch.Tensor | None:
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        return None
    device = next(model.parameters()).device
    # Spread over the vocabulary (7919 is prime): distinct ids, not the first few special ones.
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)
    positions = torch.arange(PROBE_TOKENS, device=device).unsqueeze(0)
    # eval: dropout would make the two sides of the comparison differ.
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, position_ids=positions, use_cache=False)
    finally:
        model.train(was_training)
    logits = getattr(out, "logits", None)
    return logits.float() if isinstance(logits, torch.Tensor) else None


def _close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to the rounding of the projection's dtype."""
    # A bf16 model applies its transform in bf16, the loss in fp32: a few ulps of the dtype.
    tol = max(1e-5, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5
    # Scaled by the largest logit: absolute error grows with the magnitude.
    atol = tol * max(1.0, float(theirs.abs().max()))
    return bool(torch.allclose(ours, theirs, rtol=tol, atol=atol))


def _describe(head: OutputHead) -> str:
    parts = [f"scale {head.scale:g}"] if head.scale != 1.0 else []
    if head.softcap is not None:
        parts.append(f"soft-capping at {head.softcap:g}")
    return ", ".join(parts) or "no transform"


def _own_forward(model: nn.Module, why: str) -> OutputHead:
    note = (
        f"loss: {type(model).__name__}: {why}; the loss uses the model's own forward "
        "(its logits at every position: slower and more memory than the chunked loss)"
    )
    return OutputHead(own_forward=True, note=note)
