"""The arithmetic of the loss, in one place.

Losses are sums over supervised tokens divided by the supervised-token count of the whole
accumulation window, so accumulating k micro-batches equals one k-times larger batch
(transformers#34191 is what happens otherwise).

The output projection runs only on supervised positions: with answer-only loss most positions
carry no label, and the vocab projection (49k x 576 for SmolLM2) is a large share of the step.
So the loss runs the model's decoder itself; a method whose trained weights live outside the
decoder's modules (virtual tokens) gives the model a `VirtualTokens` forward under
`VIRTUAL_TOKENS_HOOK` for it.

What the model's forward does after the projection (soft-capping, logit scaling) the loss does
too, as the model's `OutputHead` says (`models.output_head`, decided once per model against its
own forward); a model whose forward does something else has its loss computed from its own
forward's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from leantune.core.chunked_ce import linear_cross_entropy_sum, linear_token_logps
from leantune.data.tokenize import IGNORE_INDEX
from leantune.models.output_head import output_head

VIRTUAL_TOKENS_HOOK = "leantune_virtual_tokens"
"""The model attribute that holds its `VirtualTokens` forward, when it has one (methods/prompt.py
sets it on prefix and prompt tuning models)."""


class VirtualTokens(Protocol):
    """Last hidden states at the input positions with a method's virtual tokens in effect, or
    None while they are disabled (then the plain decoder computes them)."""

    def __call__(
        self, decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor | None: ...


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The transformer body and the output projection of an HF causal LM (also inside peft)."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Linear):
        return None
    return decoder, head


def supervised_hidden(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, nn.Linear] | None:
    """The last hidden states at the supervised positions of `batch` (n_supervised, hidden) and
    the output projection, or None for a model without a plain decoder and linear head."""
    parts = _decoder_and_head(model)
    if parts is None:
        return None
    decoder, head = parts
    assert isinstance(head, nn.Linear)
    virtual: VirtualTokens | None = getattr(model, VIRTUAL_TOKENS_HOOK, None)
    hidden = virtual(decoder, batch["input_ids"], batch["position_ids"]) if virtual else None
    if hidden is None:
        # use_cache=False is required: transformers only derives the per-example (packed) mask
        # from position ids when no KV cache is created.
        hidden = decoder(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).last_hidden_state
    # Only supervised positions go on to the vocab projection: with answer-only loss most
    # carry no label, and the projection (49k x 576 for SmolLM2) is a large share of the step.
    return hidden[batch["labels"] != IGNORE_INDEX], head


def supervised_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits at the supervised positions of `batch`, shape (n_supervised, vocab):
    its output projection's, with its output transform applied."""
    decided = output_head(model)
    found = None if decided.own_forward else supervised_hidden(model, batch)
    if found is None:
        return own_forward_logits(model, batch)
    hidden, head = found
    return decided.apply(head(hidden))


def own_forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the model's own forward at the supervised positions of `batch`.

    With virtual tokens in effect, the decoder's output inside that forward is replaced by the
    hidden states with the virtual tokens (`VIRTUAL_TOKENS_HOOK`), so that what the forward
    does after the decoder still applies to them.
    """
    mask = batch["labels"] != IGNORE_INDEX
    ids, positions = batch["input_ids"], batch["position_ids"]
    virtual: VirtualTokens | None = getattr(model, VIRTUAL_TOKENS_HOOK, None)
    parts = _decoder_and_head(model) if virtual else None
    hidden = virtual(parts[0], ids, positions) if virtual and parts else None
    if hidden is None or parts is None:
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits[mask]
    # The base model's forward, with the decoder's output swapped for the virtual-token hidden
    # states: peft's own forward would add the virtual tokens a second time.
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    handle = parts[0].register_forward_hook(lambda _m, _a, out: _replaced(out, hidden))
    try:
        logits = base(input_ids=ids, position_ids=positions, use_cache=False).logits
    finally:
        handle.remove()
    return logits[mask]


def _replaced(output: Any, hidden: torch.Tensor) -> Any:
    """A decoder's output with `hidden` as its last hidden state."""
    output.last_hidden_state = hidden
    return output


BatchFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""A computation on the model and a batch (`supervised_token_logps`) that a data-parallel
wrapper's forward runs (`through_wrapper`)."""


class LossModule(nn.Module):
    """`token_loss_sum` of `model` as a module's forward, for a data-parallel wrapper to wrap
    (DDP's forward prepares the gradient all-reduce, FSDP's root forward gathers the
    embeddings and the head): the chunked loss, which reaches into the decoder and the head
    past the model's own forward, then runs inside the wrapper's forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        kl_coef: float,
        fn: BatchFn | None = None,
    ) -> torch.Tensor:
        if fn is not None:  # a preference objective's log-probs (`through_wrapper`)
            return fn(self.model, batch)
        return token_loss_sum(self.model, batch, kl_coef)


class WrappedLoss(nn.Module):
    """The model as a data-parallel loop trains it: `wrapped` (DDP or FSDP around a
    `LossModule`) computes the loss; `plain` is the model with its method, unwrapped."""

    def __init__(self, wrapped: nn.Module, plain: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped
        object.__setattr__(self, "plain", plain)  # not a second registration of its weights

    def forward(
        self, batch: dict[str, torch.Tensor], kl_coef: float, fn: BatchFn | None = None
    ) -> torch.Tensor:
        return self.wrapped(batch, kl_coef) if fn is None else self.wrapped(batch, kl_coef, fn)


def through_wrapper(model: nn.Module, fn: BatchFn, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`fn(model, batch)` on the unwrapped model, inside the data-parallel wrapper's forward
    when `model` is one: DDP's forward prepares the gradient all-reduce of what `fn` computes,
    FSDP2's root forward gathers the embeddings and the head (a forward every rank runs)."""
    if isinstance(model, WrappedLoss):
        return model(batch, 0.0, fn)
    return fn(model, batch)


def token_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], kl_coef: float = 0.0
) -> torch.Tensor:
    """Sum of cross-entropy over the supervised positions (labels are already shifted), in fp32.

    The vocab projection and the loss run a chunk of positions at a time
    (`chunked_ce.linear_cross_entropy_sum`), so the logits of the whole batch never exist.
    With `kl_coef > 0`, adds `kl_coef * KL(model || base)` summed over the same positions: the
    seeds' remedy for repetitive generations after fine-tuning. The base is the same model with
    its adapters disabled, so this needs an adapter method (no second copy of the weights);
    the KL needs both models' logits, so that path keeps them.
    """
    if isinstance(model, WrappedLoss):
        # Through the wrapper's forward, which re-enters here with the plain model: DDP and
        # FSDP only do their work (all-reduce set-up, gathers) inside their own forward.
        return model(batch, kl_coef)
    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]
    decided = output_head(model)
    # The chunked path needs no logits to survive; the KL needs both models' logits, and a
    # head with a bias is not what the chunked function computes, so those take the plain path.
    if kl_coef == 0 and not decided.own_forward:
        found = supervised_hidden(model, batch)
        if found is not None and found[1].bias is None:
            hidden, head = found
            return linear_cross_entropy_sum(
                hidden, head.weight, targets, scale=decided.scale, softcap=decided.softcap
            )
    logits = supervised_logits(model, batch)
    # A sum, not a mean: the loop divides by the supervised-token count of the whole
    # accumulation window, so k micro-batches equal one k-times larger batch (transformers#34191
    # is what a per-micro-batch mean gives).
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    if kl_coef > 0:
        loss = loss + kl_coef * kl_to_base(model, batch, logits)
    return loss


def supervised_token_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(label) at each supervised position of `batch` (labels already shifted), shape
    (n_supervised,), fp32, in the row-major order of `labels != -100`: what a preference
    objective sums per sequence (`objectives.logps.sequence_logps`).

    The same path as `token_loss_sum`: the decoder's hidden states at the supervised positions
    through the output projection, a chunk at a time (`chunked_ce.linear_token_logps`), with the
    model's output transform; a model whose forward does something else (or whose head has a
    bias) gets its own forward's logits at those positions.
    """
    targets = batch["labels"][batch["labels"] != IGNORE_INDEX]
    decided = output_head(model)
    if not decided.own_forward:
        found = supervised_hidden(model, batch)
        if found is not None and found[1].bias is None:
            hidden, head = found
            return linear_token_logps(
                hidden, head.weight, targets, scale=decided.scale, softcap=decided.softcap
            )
    logits = supervised_logits(model, batch).float()  # fp32: a bf16 logsumexp loses precision
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def reference_token_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`supervised_token_logps` of the reference model, without gradient: the same model with
    its adapters disabled for this one forward, so there is no second copy of the weights.

    Raises:
        ValueError: the model has no adapters to disable (full fine-tuning, freeze: their
            reference is the model before training, whose log-probs are computed up front).
    """
    with torch.no_grad(), _adapters_disabled(model, "the reference of a preference objective"):
        return supervised_token_logps(model, batch)


def _adapters_disabled(model: nn.Module, what: str) -> contextlib.AbstractContextManager[Any]:
    """peft's context in which the model is its base (adapters off)."""
    disable = getattr(model, "disable_adapter", None)
    if not callable(disable):
        raise ValueError(f"{what} needs an adapter method (the base is the adapter-free model)")
    context: contextlib.AbstractContextManager[Any] = disable()
    return context


def kl_to_base(
    model: nn.Module, batch: dict[str, torch.Tensor], logits: torch.Tensor
) -> torch.Tensor:
    """KL(model || base) summed over supervised positions; `logits` are the model's there.

    Raises:
        ValueError: the model has no adapters to disable (e.g. full fine-tuning).
    """
    # The base is the same model with its adapters off: no second copy of the weights. No
    # gradient: the base is the fixed target.
    with torch.no_grad(), _adapters_disabled(model, "train.kl_coef"):
        base = supervised_logits(model, batch)
    log_p = F.log_softmax(logits.float(), dim=-1)
    log_q = F.log_softmax(base.float(), dim=-1)
    # kl_div(input, target) is KL(target || input): with target=log_p this is KL(model || base).
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum")


def count_supervised(labels: torch.Tensor) -> int:
    """Number of positions that carry a label."""
    return int((labels != IGNORE_INDEX).sum())
