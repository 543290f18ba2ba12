"""The preference objectives' building blocks: per-token log-probs through the chunked output
projection equal the model's own forward, per-sequence sums (packed or not), the losses'
arithmetic, the registry and the `preference:` settings. Parity with TRL is in
test_objectives_trl.py."""

from __future__ import annotations

import math
import typing

import pytest
import torch
import torch.nn.functional as F
from support import tiny_llama_config, tiny_qwen2_config
from torch import nn
from transformers import AutoModelForCausalLM

from leantune.config import ConfigError, MethodConfig, TrainConfig
from leantune.config.preference import PreferenceConfig
from leantune.core import chunked_ce
from leantune.core.chunked_ce import linear_token_logps
from leantune.methods.registry import apply_method
from leantune.models.loss import reference_token_logps, supervised_token_logps
from leantune.models.output_head import decide_output_head
from leantune.objectives.logps import (
    SequenceLogps,
    logits_token_logps,
    segments_from_positions,
    sequence_logps,
)
from leantune.objectives.preference import (
    ObjectiveOutput,
    PreferenceBatch,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from leantune.objectives.registry import OBJECTIVES, SFT, settings_for
from leantune.objectives.spec import ObjectiveSettings
from leantune.training.checks import load_config


def settings(objective: str, **fields: typing.Any) -> ObjectiveSettings:
    return settings_for(OBJECTIVES[objective], PreferenceConfig(**fields))


# ---------------------------------------------------------------------------------------------
# Per-token log-probs, chunked


def _plain_logps(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, **transform: float
) -> torch.Tensor:
    z = F.linear(h, w).float() * transform.get("scale", 1.0)
    if "softcap" in transform:
        z = torch.tanh(z / transform["softcap"]) * transform["softcap"]
    return torch.log_softmax(z, dim=-1).gather(1, t.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("transform", [{}, {"scale": 0.5, "softcap": 3.0}])
def test_chunked_token_logps_equal_log_softmax_in_value_and_gradients(
    weight_grad: bool, transform: dict[str, float]
) -> None:
    # A frozen head keeps d logp / dh from the forward; a trained one recomputes in backward:
    # both must give autograd's gradients for a per-token upstream gradient.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(97, 16, generator=g, requires_grad=weight_grad)
    t = torch.randint(0, 97, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    ref = _plain_logps(h, w, t, **transform)
    (ref * upstream).sum().backward()
    ref_h, ref_w = h.grad.clone(), (w.grad.clone() if weight_grad else None)  # type: ignore[union-attr]
    h.grad, w.grad = None, None
    got = linear_token_logps(h, w, t, chunk=8, **transform)  # type: ignore[arg-type]
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)
    if weight_grad:
        torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_token_logps(h, w, t, chunk=8, **transform), ref)  # type: ignore[arg-type]


def _tiny(arch: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config() if arch == "llama" else tiny_qwen2_config()
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def _batch(rows: int, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of random tokens whose second half is supervised (labels shifted), right-padded
    by different amounts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 384, (rows, width), generator=g)
    labels = torch.full_like(ids, -100)
    for r in range(rows):
        n = width - r  # row r has r padding tokens
        labels[r, n // 2 : n - 1] = ids[r, n // 2 + 1 : n]
    positions = torch.arange(width).expand(rows, width).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


@pytest.mark.parametrize("frozen_head", [False, True])
def test_sequence_logps_equal_the_models_own_forward(frozen_head: bool) -> None:
    model = _tiny("qwen2")  # untied head: frozen_head freezes only the projection
    model.get_output_embeddings().weight.requires_grad_(not frozen_head)
    batch = _batch(3, 12)
    upstream = torch.tensor([0.3, -1.2, 0.7])

    got = sequence_logps(supervised_token_logps(model, batch), batch["labels"])
    (got.sums * upstream).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    mask = batch["labels"] != -100
    picked = logp.gather(2, batch["labels"].clamp(min=0).unsqueeze(2)).squeeze(2) * mask
    expected = picked.sum(dim=1)
    (expected * upstream).sum().backward()

    torch.testing.assert_close(got.sums, expected, rtol=1e-6, atol=1e-5)
    assert got.counts.tolist() == mask.sum(dim=1).tolist()
    assert len(ours) == sum(p.grad is not None for p in model.parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(
        sequence_logps(logits_token_logps(logits, batch["labels"]), batch["labels"]).sums,
        expected,
    )


def test_packed_segments_equal_each_sequence_alone() -> None:
    model = _tiny()
    alone = _batch(3, 10, seed=1)
    lengths = [10, 9, 8]
    packed = {
        key: torch.cat([alone[key][r, :n] for r, n in enumerate(lengths)]).unsqueeze(0)
        for key in ("input_ids", "labels", "position_ids")
    }
    with torch.no_grad():
        ref = sequence_logps(supervised_token_logps(model, alone), alone["labels"])
        segments = segments_from_positions(packed["position_ids"])
        got = sequence_logps(supervised_token_logps(model, packed), packed["labels"], segments)
    assert segments.tolist() == [[0] * 10 + [1] * 9 + [2] * 8]
    torch.testing.assert_close(got.sums, ref.sums, rtol=1e-6, atol=1e-5)
    assert got.counts.tolist() == ref.counts.tolist()


def test_padding_is_a_sequence_without_tokens() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3, 4]])
    labels = torch.tensor([[5, 6, -100, 7, -100, -100, -100], [-100, 8, 9, -100, -100, -100, -100]])
    segments = segments_from_positions(positions)
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 4, 4, 4]]
    got = sequence_logps(torch.tensor([-1.0, -2.0, -4.0, -8.0, -16.0]), labels, segments)
    assert got.sums.tolist() == [-3.0, -4.0, 0.0, -8.0, -16.0]
    assert got.counts.tolist() == [2, 1, 0, 1, 1]
    assert got.means().tolist() == [-1.5, -4.0, 0.0, -8.0, -16.0]
    with pytest.raises(ValueError, match="labels supervise 5"):
        sequence_logps(torch.zeros(4), labels, segments)


def test_the_chunked_path_never_builds_the_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The vocab projection runs only on the supervised positions (forward, and the backward's
    # recomputation for a trained head); the model's own head, which would project every
    # position of the batch, never runs.
    model = _tiny("qwen2")
    batch = _batch(4, 16)
    n_supervised = int((batch["labels"] != -100).sum())
    vocab = model.config.vocab_size
    shapes: list[tuple[int, ...]] = []
    original = F.linear

    def recording(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = original(x, w, b)
        if out.shape[-1] == vocab:
            shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(chunked_ce.F, "linear", recording)
    decide_output_head(model)  # its one probe of 8 tokens through the model's own forward
    shapes.clear()
    head_calls: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    got = supervised_token_logps(model, batch)
    got.sum().backward()
    assert head_calls == [] and got.shape == (n_supervised,)
    assert shapes == [(n_supervised, vocab)] * 2  # forward, and backward's recomputation
    assert n_supervised < 4 * 16


def test_the_reference_is_the_model_with_its_adapters_off() -> None:
    base = _tiny()
    batch = _batch(2, 10, seed=2)
    with torch.no_grad():
        expected = supervised_token_logps(base, batch)
    model = apply_method(base, MethodConfig(name="lora"))
    for name, p in model.named_parameters():  # a trained adapter: the policy moves away
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    policy = supervised_token_logps(model, batch)
    got = reference_token_logps(model, batch)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad and (policy - expected).abs().max() > 1e-2
    with pytest.raises(ValueError, match="needs an adapter method"):
        reference_token_logps(_tiny(), batch)


def test_a_trained_head_under_bf16_autocast_stays_close_to_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(300, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 300, (40,), generator=g)
    upstream = torch.randn(40, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.log_softmax(F.linear(h, w).float(), -1).gather(1, t.unsqueeze(1)).squeeze(1)
    (ref * upstream).sum().backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    h.grad, w.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_token_logps(h, w, t, chunk=16)
    (got * upstream).sum().backward()
    assert got.dtype == torch.float32 and w.grad.dtype == torch.float32  # type: ignore[union-attr]
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(h.grad, ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, ref_w, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# The losses' arithmetic


def _logps(sums: list[float], counts: list[int]) -> SequenceLogps:
    return SequenceLogps(torch.tensor(sums), torch.tensor(counts))


def _pairs(seed: int, n: int = 4) -> PreferenceBatch:
    g = torch.Generator().manual_seed(seed)
    counts_c, counts_r = (
        torch.randint(2, 9, (n,), generator=g),
        torch.randint(2, 9, (n,), generator=g),
    )
    return PreferenceBatch(
        chosen=SequenceLogps(-counts_c * (0.5 + torch.rand(n, generator=g)), counts_c),
        rejected=SequenceLogps(-counts_r * (0.5 + torch.rand(n, generator=g)), counts_r),
        ref_chosen=-counts_c * (0.5 + torch.rand(n, generator=g)),
        ref_rejected=-counts_r * (0.5 + torch.rand(n, generator=g)),
        kl=torch.tensor(0.3),
    )


def test_losses_at_known_points() -> None:
    zero = PreferenceBatch(
        _logps([-2.0, -4.0], [2, 4]),
        _logps([-3.0, -1.0], [3, 1]),
        ref_chosen=torch.tensor([-2.0, -4.0]),
        ref_rejected=torch.tensor([-3.0, -1.0]),
        kl=torch.tensor(0.0),
    )
    # Policy = reference: DPO is log 2, IPO the squared target margin, KTO one half.
    assert dpo_loss(zero, settings("dpo")).loss().item() == pytest.approx(math.log(2))
    ipo = dpo_loss(zero, settings("dpo", loss_type="ipo", beta=0.25)).loss().item()
    assert ipo == pytest.approx(4.0)
    assert kto_loss(zero, settings("kto")).loss().item() == pytest.approx(0.5)
    # SimPO compares per-token means: (-1 vs -1) and (-1 vs -1) are ties, so -log sigmoid(-gamma).
    simpo = simpo_loss(zero, settings("simpo", simpo_gamma=0.5)).loss().item()
    assert simpo == pytest.approx(-math.log(1 / (1 + math.exp(0.5))))
    # ORPO: equal means -> log odds 0 -> NLL + lambda log 2; NLL = 6 nats over 6 tokens.
    orpo = orpo_loss(zero, settings("orpo", orpo_lambda=0.1)).loss().item()
    assert orpo == pytest.approx(1.0 + 0.1 * math.log(2))


def test_length_normalisation_sees_means_and_dpo_sees_sums() -> None:
    # Doubling the rejected answer's length at the same per-token log-prob changes DPO's loss
    # (it sees the doubled sum) but not SimPO's or IPO's (they see per-token means).
    short = PreferenceBatch(
        _logps([-4.0], [4]), _logps([-6.0], [3]), torch.tensor([-4.0]), torch.tensor([-4.0])
    )
    long = PreferenceBatch(
        _logps([-4.0], [4]), _logps([-12.0], [6]), torch.tensor([-4.0]), torch.tensor([-8.0])
    )
    for name, s in (("simpo", settings("simpo")), ("ipo", settings("dpo", loss_type="ipo"))):
        loss = simpo_loss if name == "simpo" else dpo_loss
        assert loss(short, s).loss().item() == pytest.approx(loss(long, s).loss().item()), name
    assert dpo_loss(short, settings("dpo")).loss() != dpo_loss(long, settings("dpo")).loss()


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_accumulated_micro_batches_equal_one_batch(name: str) -> None:
    # Normalising each micro-batch by the window's counts (STYLE.md section 6) gives the loss,
    # and so the gradients, of the whole batch at once.
    full = _pairs(3, n=6)
    s = (
        settings(name, sft_weight=0.5)
        if "sft_weight" in OBJECTIVES[name].settings
        else settings(name)
    )

    def part(idx: slice) -> PreferenceBatch:
        assert full.ref_chosen is not None and full.ref_rejected is not None
        return PreferenceBatch(
            SequenceLogps(full.chosen.sums[idx], full.chosen.counts[idx]),
            SequenceLogps(full.rejected.sums[idx], full.rejected.counts[idx]),
            full.ref_chosen[idx],
            full.ref_rejected[idx],
            full.kl,
        )

    whole = OBJECTIVES[name].loss(full, s)
    halves = [OBJECTIVES[name].loss(part(i), s) for i in (slice(0, 2), slice(2, 6))]
    tokens = int(full.chosen.counts.sum())
    summed = sum(h.loss(whole.examples, tokens) for h in halves)
    torch.testing.assert_close(summed, whole.loss())
    assert whole.examples == (12 if name == "kto" else 6)


def test_metrics_are_means_with_the_margin_between_them() -> None:
    batch = PreferenceBatch(
        _logps([-1.0, -5.0], [1, 5]),
        _logps([-3.0, -2.0], [3, 2]),
        torch.tensor([-2.0, -4.0]),
        torch.tensor([-2.0, -4.0]),
    )
    got = dpo_loss(batch, settings("dpo", beta=0.5)).metrics()
    # rewards: chosen 0.5 * (1, -1), rejected 0.5 * (-1, 2)
    assert got == pytest.approx(
        {
            "rewards/chosen": 0.0,
            "rewards/rejected": 0.25,
            "rewards/accuracies": 0.5,
            "rewards/margins": -0.25,
            "logps/chosen": -3.0,
            "logps/rejected": -2.5,
        }
    )


def test_kto_takes_any_mix_and_its_kl_is_a_clamped_constant() -> None:
    assert kto_kl(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])).item() == 0.0
    kl = kto_kl(torch.tensor([-1.0, -3.0], requires_grad=True), torch.tensor([-2.0, -3.5]))
    assert kl.item() == pytest.approx(0.75) and not kl.requires_grad
    only_desirable = PreferenceBatch(
        _logps([-1.0, -2.0, -3.0], [1, 1, 1]),
        _logps([], []),
        torch.tensor([-1.0, -2.0, -3.0]),
        torch.zeros(0),
        kl=torch.tensor(0.0),
    )
    out = kto_loss(only_desirable, settings("kto", desirable_weight=2.0))
    assert out.loss().item() == pytest.approx(1.0)  # 2 * (1 - sigmoid(0))
    assert "rewards/rejected" not in out.metrics() and "rewards/margins" not in out.metrics()


def test_paired_objectives_refuse_unpaired_batches_and_a_missing_reference() -> None:
    unpaired = PreferenceBatch(_logps([-1.0, -2.0], [1, 1]), _logps([-1.0], [1]))
    for name in ("dpo", "simpo", "orpo"):
        with pytest.raises(ValueError, match="2 chosen and 1 rejected"):
            OBJECTIVES[name].loss(unpaired, settings(name))
    no_reference = PreferenceBatch(_logps([-1.0], [1]), _logps([-1.0], [1]))
    for name in ("dpo", "kto"):
        with pytest.raises(ValueError, match="reference"):
            OBJECTIVES[name].loss(no_reference, settings(name))


# ---------------------------------------------------------------------------------------------
# The registry and the settings


def test_every_objective_is_in_the_config_and_reads_real_settings() -> None:
    hints = typing.get_type_hints(TrainConfig)
    assert set(typing.get_args(hints["objective"])) == {SFT, *OBJECTIVES}
    fields = set(typing.get_type_hints(PreferenceConfig))
    for spec in OBJECTIVES.values():
        assert set(spec.settings) <= fields, spec.name
        assert (spec.default_beta is None) == ("beta" not in spec.settings), spec.name
        out = spec.loss(_pairs(1), settings(spec.name))
        assert isinstance(out, ObjectiveOutput) and torch.isfinite(out.loss())
        assert spec.needs_reference == (spec.name in ("dpo", "kto"))
    assert settings("dpo").beta == 0.1 and settings("simpo").beta == 2.0
    assert settings("dpo", beta=0.3).beta == 0.3


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["preference.beta=0"], "preference.beta: must be > 0, got 0"),
        (["preference.label_smoothing=0.5"], "preference.label_smoothing: must be in [0, 0.5)"),
        (
            ["preference.loss_type=ipo", "preference.label_smoothing=0.1"],
            "the ipo loss has no label smoothing",
        ),
        (["preference.sft_weight=-1"], "preference.sft_weight: must be >= 0"),
        (["preference.undesirable_weight=0"], "preference.undesirable_weight: must be > 0"),
        (["train.objective=dpo", "train.kl_coef=0.1"], "train.kl_coef: applies to"),
        (["train.objective=rlhf"], "train.objective: 'rlhf' is not one of"),
    ],
)
def test_bad_preference_settings_name_the_field(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_a_setting_the_objective_does_not_read_gets_a_warning() -> None:
    from leantune.training.checks import check_config

    # The demo config's data, read as pairs without its held-out SFT file.
    pairs = ["data.format=preference", "data.eval=null", "train.eval_exact_match=false"]
    cfg = load_config(None, ["train.objective=dpo", "preference.beta=0.2", *pairs])
    assert cfg.train.objective == "dpo" and cfg.preference.beta == 0.2
    assert not [w for w in check_config(cfg) if "preference." in w]
    cfg = load_config(None, ["train.objective=orpo", "preference.beta=0.2", *pairs])
    assert "preference.beta is set but train.objective=orpo does not use it" in check_config(cfg)
