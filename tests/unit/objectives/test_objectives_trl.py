"""Parity with TRL (the `trl` pin of the test extra): on the same log-probs, leantune's DPO
(sigmoid, conservative, IPO, RPO), SimPO, ORPO and KTO losses, their gradients and their reward
metrics equal those TRL's own trainer code computes, to 1e-5.

TRL's loss code lives in trainer methods. Each test builds the minimum trainer object those
methods read (`object.__new__` plus the attributes its `__init__` sets from a real TRL config,
a one-process stand-in for accelerate's `Accelerator`) and calls the method itself: DPO's and
KTO's `_compute_loss` on a model TRL calls as it calls its fused LM head, CPO's and ORPO's
`get_batch_loss_metrics` with their `concatenated_forward` given the log-probs TRL's own
`get_batch_logps` computes from the logits.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import tiny_llama_config
from torch import nn
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

from leantune.config.preference import PreferenceConfig
from leantune.models.loss import supervised_token_logps
from leantune.objectives.logps import SequenceLogps, logits_token_logps, sequence_logps
from leantune.objectives.preference import ObjectiveOutput, PreferenceBatch, kto_kl
from leantune.objectives.registry import OBJECTIVES, settings_for

TOL = {"rtol": 1e-5, "atol": 1e-5}
PAIRED_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class _OneProcess:
    """What TRL's loss code asks of accelerate's `Accelerator` in a one-process CPU run."""

    device = torch.device("cpu")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def _trl_args(cls: type, tmp: Path, **fields: Any) -> Any:
    return cls(output_dir=str(tmp), report_to="none", use_cpu=True, bf16=False, **fields)


def _dpo_trainer(model: nn.Module, args: DPOConfig) -> Any:
    """A DPOTrainer with the attributes `_compute_loss` reads, set as its `__init__` sets them;
    the reference log-probs come with the inputs (TRL's precomputed-reference path)."""
    t = object.__new__(DPOTrainer)
    t.model, t.ref_model, t.args, t.accelerator = model, None, args, _OneProcess()
    t.beta, t.precompute_ref_logps = args.beta, True
    t.loss_types = args.loss_type
    t.loss_weights = args.loss_weights or [1.0] * len(t.loss_types)
    t.ld_alpha, t.f_divergence_type = args.ld_alpha, args.f_divergence_type
    t.f_alpha_divergence_coef = args.f_alpha_divergence_coef
    t.label_smoothing, t.use_weighting = args.label_smoothing, args.use_weighting
    t.aux_loss_enabled, t._tp_size, t._total_train_tokens = False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


class _TableLogps(nn.Module):
    """A stand-in model whose log-prob of each label is an entry of a trainable table: row
    `input_ids[:, 0]`, column t for the label of position t + 1. TRL calls it as it calls a
    model with its fused LM head (`fused_lm_head=True`, TRL's `FusedCausalLMOutput`)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any
    ) -> FusedCausalLMOutput:
        mask = labels[:, 1:] != -100
        logps = self.table[input_ids[:, 0]] * mask
        zeros = torch.zeros_like(logps).detach()
        return FusedCausalLMOutput(
            log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=mask & False, label_mask=mask
        )


def _completion_mask(rows: int, width: int, seed: int) -> torch.Tensor:
    """Prompts of 2-4 tokens, answers of 1..width-5 tokens, right padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        start = int(torch.randint(2, 5, (1,), generator=g))
        end = start + int(torch.randint(1, width - 4, (1,), generator=g))
        mask[r, start:end] = 1
    return mask


def _trl_inputs(
    completion: torch.Tensor, ids: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    rows, width = completion.shape
    if ids is None:  # row ids for the table model; the rest of the tokens do not matter
        ids = torch.arange(rows).unsqueeze(1).expand(rows, width).contiguous()
    ends = [int(torch.nonzero(completion[r]).max()) + 1 for r in range(rows)]
    attention = torch.stack([(torch.arange(width) < e).long() for e in ends])
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _our_logps(model: _TableLogps, completion: torch.Tensor) -> SequenceLogps:
    """leantune's per-sequence sums of the same table: labels shifted, supervised where TRL's
    completion mask is."""
    mask = completion[:, 1:].bool()
    labels = torch.where(mask, 1, -100)
    return sequence_logps(model.table[mask], labels)


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _assert_same(
    ours: ObjectiveOutput,
    our_grads: dict[str, torch.Tensor],
    theirs: torch.Tensor,
    their_grads: dict[str, torch.Tensor],
    their_metrics: dict[str, float],
    names: tuple[str, ...] = PAIRED_METRICS,
) -> None:
    torch.testing.assert_close(ours.loss().detach(), theirs.detach().float(), **TOL)
    assert our_grads.keys() == their_grads.keys() and our_grads
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], **TOL, msg=name)
    got = ours.metrics()
    for name in names:
        assert got[name] == pytest.approx(their_metrics[name], rel=1e-5, abs=1e-5), name


def _split(logps: SequenceLogps) -> tuple[SequenceLogps, SequenceLogps]:
    n = len(logps) // 2
    return logps.select(torch.arange(n)), logps.select(torch.arange(n, 2 * n))


DPO_CASES = {
    "sigmoid": ({"beta": 0.1}, {"loss_type": ["sigmoid"], "beta": 0.1}),
    "rpo": (
        {"beta": 0.2, "sft_weight": 0.7},
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.7], "beta": 0.2},
    ),
    "ipo": ({"beta": 0.3, "loss_type": "ipo"}, {"loss_type": ["ipo"], "beta": 0.3}),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_matches_trl_on_fixed_log_probs(case: str, tmp_path: Path) -> None:
    ours_cfg, trl_cfg = DPO_CASES[case]
    pairs, width = 5, 12
    completion = _completion_mask(2 * pairs, width, seed=1)
    g = torch.Generator().manual_seed(2)
    model = _TableLogps(-3 * torch.rand(2 * pairs, width - 1, generator=g))
    ref = (-3 * torch.rand(2 * pairs, width - 1, generator=g) * completion[:, 1:]).sum(1)

    trainer = _dpo_trainer(model, _trl_args(DPOConfig, tmp_path, **trl_cfg))
    inputs = _trl_inputs(completion) | {
        "ref_chosen_logps": ref[:pairs],
        "ref_rejected_logps": ref[pairs:],
    }
    theirs = trainer._compute_loss(model, inputs, return_outputs=False)
    their_grads = _grads(model, theirs)

    chosen, rejected = _split(_our_logps(model, completion))
    batch = PreferenceBatch(chosen, rejected, ref[:pairs], ref[pairs:])
    ours = OBJECTIVES["dpo"].loss(
        batch, settings_for(OBJECTIVES["dpo"], PreferenceConfig(**ours_cfg))
    )
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    _assert_same(ours, _grads(model, ours.loss()), theirs, their_grads, metrics)


def test_conservative_dpo_matches_trls_aot_loss_on_single_pairs(tmp_path: Path) -> None:
    # TRL 1.x dropped label smoothing from its sigmoid loss; its `aot` loss is the conservative
    # DPO loss of the batch's sorted log-ratios, which for a batch of one pair is that pair's.
    pairs, width = 4, 10
    completion = _completion_mask(2 * pairs, width, seed=3)
    g = torch.Generator().manual_seed(4)
    model = _TableLogps(-2 * torch.rand(2 * pairs, width - 1, generator=g))
    ref = (-2 * torch.rand(2 * pairs, width - 1, generator=g) * completion[:, 1:]).sum(1)
    args = _trl_args(DPOConfig, tmp_path, loss_type=["aot"], beta=0.5, label_smoothing=0.2)

    total = torch.zeros(())
    for i in range(pairs):
        rows = torch.tensor([i, pairs + i])
        trainer = _dpo_trainer(model, args)
        inputs = _trl_inputs(completion[rows], ids=rows.unsqueeze(1).expand(2, width))
        inputs |= {
            "ref_chosen_logps": ref[i : i + 1],
            "ref_rejected_logps": ref[pairs + i : pairs + i + 1],
        }
        total = total + trainer._compute_loss(model, inputs, return_outputs=False) / pairs
    their_grads = _grads(model, total)

    chosen, rejected = _split(_our_logps(model, completion))
    spec = OBJECTIVES["dpo"]
    ours = spec.loss(
        PreferenceBatch(chosen, rejected, ref[:pairs], ref[pairs:]),
        settings_for(spec, PreferenceConfig(beta=0.5, label_smoothing=0.2)),
    )
    _assert_same(ours, _grads(model, ours.loss()), total, their_grads, {}, names=())


def test_dpo_matches_trl_on_a_tiny_models_own_log_probs(tmp_path: Path) -> None:
    # The whole path on a real model: leantune's chunked per-token log-probs summed per answer
    # against TRL's fused LM head, then the RPO-style DPO loss; gradients on every weight.
    torch.manual_seed(0)
    config = tiny_llama_config()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    pairs, width = 3, 14
    completion = _completion_mask(2 * pairs, width, seed=5)
    ids = torch.randint(
        3, config.vocab_size, (2 * pairs, width), generator=torch.Generator().manual_seed(6)
    )
    ref = -torch.rand(2 * pairs, generator=torch.Generator().manual_seed(7)) * 20

    ours_cfg, trl_cfg = DPO_CASES["rpo"]
    trainer = _dpo_trainer(model, _trl_args(DPOConfig, tmp_path, **trl_cfg))
    inputs = _trl_inputs(completion, ids) | {
        "ref_chosen_logps": ref[:pairs],
        "ref_rejected_logps": ref[pairs:],
    }
    theirs = trainer._compute_loss(model, inputs, return_outputs=False)
    their_grads = _grads(model, theirs)

    mask = completion[:, 1:].bool()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(mask, ids[:, 1:], -100)
    positions = torch.arange(width).expand(2 * pairs, width).contiguous()
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    chosen, rejected = _split(sequence_logps(supervised_token_logps(model, batch), labels))
    spec = OBJECTIVES["dpo"]
    ours = spec.loss(
        PreferenceBatch(chosen, rejected, ref[:pairs], ref[pairs:]),
        settings_for(spec, PreferenceConfig(**ours_cfg)),
    )
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    _assert_same(ours, _grads(model, ours.loss()), theirs, their_grads, metrics)


def test_kto_matches_trl_with_its_kl_estimate(tmp_path: Path) -> None:
    n, width = 7, 10
    labels = torch.tensor([True, False, True, True, False, True, False])
    completion = _completion_mask(2 * n, width, seed=8)  # rows 0..n-1 matched, n.. the KL pairs
    g = torch.Generator().manual_seed(9)
    model = _TableLogps(-torch.rand(2 * n, width - 1, generator=g))
    ref = (-torch.rand(2 * n, width - 1, generator=g) * completion[:, 1:]).sum(1)
    args = _trl_args(KTOConfig, tmp_path, beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)

    t = object.__new__(KTOTrainer)
    t.model, t.ref_model, t.args, t.accelerator = model, None, args, _OneProcess()
    t.beta, t.precompute_ref_logps, t.loss_type = args.beta, True, args.loss_type
    t.desirable_weight, t.undesirable_weight = args.desirable_weight, args.undesirable_weight
    t.calculate_KL, t.aux_loss_enabled, t._tp_size, t._total_train_tokens = True, False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    matched, kl_rows = (
        _trl_inputs(completion[:n]),
        _trl_inputs(completion[n:], torch.arange(n, 2 * n).unsqueeze(1).expand(n, width)),
    )
    inputs = matched | {f"KL_{k}": v for k, v in kl_rows.items()}
    inputs |= {"label": labels, "ref_logps": ref[:n], "ref_KL_logps": ref[n:]}
    theirs = t._compute_loss(model, inputs, return_outputs=False)
    their_grads = _grads(model, theirs)

    logps = _our_logps(model, completion)
    matched_logps = logps.select(torch.arange(n))
    with torch.no_grad():
        kl = kto_kl(logps.sums[n:], ref[n:])
    batch = PreferenceBatch(
        matched_logps.select(labels),
        matched_logps.select(~labels),
        ref[:n][labels],
        ref[:n][~labels],
        kl=kl,
    )
    spec = OBJECTIVES["kto"]
    ours = spec.loss(
        batch,
        settings_for(
            spec, PreferenceConfig(beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)
        ),
    )
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    names = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "kl",
    )
    _assert_same(ours, _grads(model, ours.loss()), theirs, their_grads, metrics, names)


def _logits_batch(
    pairs: int, width: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf logits (2 * pairs, width, vocab) and TRL's unshifted labels (prompt -100)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * pairs, width, vocab, generator=g).requires_grad_()
    completion = _completion_mask(2 * pairs, width, seed)
    tokens = torch.randint(0, vocab, (2 * pairs, width), generator=g)
    return logits, torch.where(completion.bool(), tokens, -100)


def _trl_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The chosen answers' NLL as CPO's `concatenated_forward` computes it (a closure there)."""
    return nn.CrossEntropyLoss()(
        logits[..., :-1, :].reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1)
    )


def _ours_from_logits(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[SequenceLogps, SequenceLogps]:
    shifted = labels[:, 1:]
    return _split(sequence_logps(logits_token_logps(logits[:, :-1], shifted), shifted))


def _trl_paired_metrics(
    cls: type, t: Any, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    pairs = logits.shape[0] // 2
    mean_logps = cls.get_batch_logps(logits, labels, average_log_prob=True)
    nll = _trl_nll(logits[:pairs], labels[:pairs])
    t.concatenated_forward = lambda _model, _batch: (
        mean_logps[:pairs],
        mean_logps[pairs:],
        logits[:pairs],
        logits[pairs:],
        nll,
    )
    loss, metrics = cls.get_batch_loss_metrics(t, None, {})
    return loss, metrics


def _logit_grads(logits: torch.Tensor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    logits.grad = None
    loss.backward()
    assert logits.grad is not None
    grad, logits.grad = logits.grad.clone(), None
    return {"logits": grad}


@pytest.mark.parametrize("sft_weight", [0.0, 0.5])
def test_simpo_matches_trls_cpo_trainer(sft_weight: float, tmp_path: Path) -> None:
    logits, labels = _logits_batch(4, 9, 31, seed=10)
    args = _trl_args(
        CPOConfig,
        tmp_path,
        loss_type="simpo",
        beta=2.0,
        simpo_gamma=0.8,
        cpo_alpha=sft_weight,
        label_smoothing=0.1,
    )
    t = SimpleNamespace(accelerator=_OneProcess(), aux_loss_enabled=False, alpha=args.alpha)
    t.beta, t.label_smoothing, t.loss_type = args.beta, args.label_smoothing, args.loss_type
    t.cpo_alpha, t.simpo_gamma = args.cpo_alpha, args.simpo_gamma
    t.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(t, c, r)
    theirs, metrics = _trl_paired_metrics(CPOTrainer, t, logits, labels)
    their_grads = _logit_grads(logits, theirs)

    chosen, rejected = _ours_from_logits(logits, labels)
    spec = OBJECTIVES["simpo"]
    cfg = PreferenceConfig(beta=2.0, simpo_gamma=0.8, sft_weight=sft_weight, label_smoothing=0.1)
    ours = spec.loss(PreferenceBatch(chosen, rejected), settings_for(spec, cfg))
    _assert_same(ours, _logit_grads(logits, ours.loss()), theirs, their_grads, metrics)


def test_orpo_matches_trls_orpo_trainer(tmp_path: Path) -> None:
    # TRL's ORPO takes the chosen NLL over prompt and answer; leantune's over the answer, as
    # its SFT loss: the NLL given to TRL here is the answer's, so the rest must agree.
    logits, labels = _logits_batch(4, 9, 31, seed=11)
    args = _trl_args(ORPOConfig, tmp_path, beta=0.25)
    t = SimpleNamespace(accelerator=_OneProcess(), aux_loss_enabled=False, beta=args.beta)
    t.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(t, c, r)
    theirs, metrics = _trl_paired_metrics(ORPOTrainer, t, logits, labels)
    their_grads = _logit_grads(logits, theirs)

    chosen, rejected = _ours_from_logits(logits, labels)
    spec = OBJECTIVES["orpo"]
    ours = spec.loss(
        PreferenceBatch(chosen, rejected), settings_for(spec, PreferenceConfig(orpo_lambda=0.25))
    )
    names = (*PAIRED_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    _assert_same(ours, _logit_grads(logits, ours.loss()), theirs, their_grads, metrics, names)
