"""Segment attention (model.attn_implementation=segments) computes what masked sdpa computes.

Packed rows of the tiny Llama and Qwen2 (GQA: 4 query heads, 2 KV heads), fp32: the loss and
every gradient equal today's masked sdpa and eager paths to float rounding, with and without
gradient checkpointing, for every method; packed equals unpacked; padding rows and
one-example rows; a sliding window; evaluation goes back to sdpa.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_zoo import FAMILIES, plant_chats, save_family_model
from support import (
    CliResult,
    run_cli,
    tiny_llama_config,
    tiny_qwen2_config,
    tiny_train_args,
    write_jsonl,
)
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2ForCausalLM,
)

import leantune.models.attention as attention
from leantune.config import MethodConfig
from leantune.data.loader import collate
from leantune.data.packing import Row, pack_examples, single_rows
from leantune.data.tokenize import Example
from leantune.methods.artifacts import load_for_inference
from leantune.methods.registry import METHODS as SPECS
from leantune.methods.registry import apply_method
from leantune.models.attention import (
    SEGMENTS,
    AttentionChoice,
    UnsupportedAttention,
    check_supported,
    register_segment_attention,
    resolve_attention,
    sdpa_attention,
    segment_lengths,
    segment_mask,
    segments_refusal,
)
from leantune.models.loading import enable_gradient_checkpointing
from leantune.models.loss import token_loss_sum
from leantune.models.output_head import output_head
from leantune.training.checks import load_config
from leantune.training.recipe import train

VOCAB = 384
LENGTHS = [5, 9, 3, 15, 20, 7, 5, 11, 2]
"""Example lengths: packed into rows of 32, they give rows of several examples and padding."""
# qlora needs bitsandbytes on CUDA; it computes attention as lora does.
METHODS = ["full", "lora", "dora", "ia3", "freeze", "adapter", "prefix", "ptuning_v2", "prompt"]


def _examples(lengths: list[int] = LENGTHS, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        # Shifted labels, the first position of every example unsupervised as in the data.
        out.append(Example(ids, [-100, *ids[1:]]))
    return out


def _model(arch: str, seed: int = 0, **config: object) -> PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tiny_llama_config() if arch == "llama" else tiny_qwen2_config()
    for key, value in config.items():
        setattr(cfg, key, value)
    model = LlamaForCausalLM(cfg) if arch == "llama" else Qwen2ForCausalLM(cfg)
    return model.train()


def _attend(model: PreTrainedModel, name: str) -> None:
    model.set_attn_implementation(register_segment_attention() if name == "segments" else name)


@pytest.fixture
def segments_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail if segment attention hands a call to sdpa (so a test cannot pass by delegating)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("segment attention delegated to sdpa")

    monkeypatch.setattr(attention, "sdpa_attention_forward", refuse)
    monkeypatch.setattr(attention, "sdpa_mask", refuse)
    yield


def _loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _assert_same(
    a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]
) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name, grad in a[1].items():
        # The loss is a sum over ~100 tokens: gradients reach ~10, and fp32 rounding with them
        # (eager and sdpa differ from each other by as much).
        scale = max(1.0, float(b[1][name].abs().max()))
        torch.testing.assert_close(grad, b[1][name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def _packed_batch(width: int = 32) -> dict[str, torch.Tensor]:
    rows = pack_examples(_examples(), seq_len=width)
    assert any(r.position_ids.count(0) > 2 for r in rows)  # several examples in a row
    assert len({len(r.input_ids) for r in rows}) > 1  # and padding in the shorter rows
    return collate(rows, pad_id=0)


# ---------------------------------------------------------------------------------------------
# Equal to the masked paths


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loss_and_grads_equal_masked_sdpa_and_eager(arch: str, segments_only: None) -> None:
    model = _model(arch)
    batch = _packed_batch()
    _attend(model, "segments")
    got = _loss_and_grads(model, batch)
    for reference in ("sdpa", "eager"):
        _attend(model, reference)
        _assert_same(got, _sdpa_loss_and_grads(model, batch))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_loss_equals_unpacked_loss(arch: str) -> None:
    model = _model(arch).eval()
    examples = _examples()
    with torch.no_grad():
        _attend(model, "sdpa")
        alone = sum(float(token_loss_sum(model, collate([r], 0))) for r in single_rows(examples))
        _attend(model, "segments")
        packed = float(token_loss_sum(model, _packed_batch()))
        # Without restarting positions the examples would see each other: the loss moves.
        batch = _packed_batch()
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(
            batch["position_ids"]
        )
        leaked = float(token_loss_sum(model, batch))
    assert packed == pytest.approx(alone, rel=1e-5)
    assert abs(leaked - alone) > 1e-3


def test_one_example_with_padding(segments_only: None) -> None:
    """A row with one example padded to a longer row's width, next to a packed row."""
    model = _model("llama")
    one = single_rows(_examples([6]))[0]
    packed = pack_examples(_examples([10, 8, 6], seed=1), seq_len=24)[0]
    batch = collate([one, packed], pad_id=0)
    assert segment_lengths(batch["position_ids"], 2, 24) == [[6, 18], [10, 8, 6]]
    _attend(model, "segments")
    got = _loss_and_grads(model, batch)
    _attend(model, "sdpa")
    _assert_same(got, _sdpa_loss_and_grads(model, batch))


def _sdpa_loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """`_loss_and_grads` with the real sdpa functions, whatever `segments_only` patched."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "sdpa_attention_forward", sdpa_attention_forward)
        mp.setattr(attention, "sdpa_mask", sdpa_mask)
        return _loss_and_grads(model, batch)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_grouped_and_full_heads(kv_heads: int, segments_only: None) -> None:
    """Multi-head (groups of 1) and multi-query (one KV head for 4 query heads)."""
    model = _model("qwen2", num_key_value_heads=kv_heads)
    batch = _packed_batch()
    _attend(model, "segments")
    got = _loss_and_grads(model, batch)
    _attend(model, "sdpa")
    _assert_same(got, _sdpa_loss_and_grads(model, batch))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gradient_checkpointing(arch: str, segments_only: None) -> None:
    """LoRA with checkpointed blocks (the recompute finds the same segments) equals sdpa
    without checkpointing."""
    batch = _packed_batch()
    results = []
    for name in ("sdpa", "segments"):
        base = _model(arch)
        _attend(base, name)
        torch.manual_seed(1)
        model = apply_method(base, MethodConfig(name="lora"))
        if name == "segments":
            enable_gradient_checkpointing(model)
            results.append(_loss_and_grads(model, batch))
        else:
            results.append(_sdpa_loss_and_grads(model, batch))
    _assert_same(results[1], results[0])


def test_sliding_window_longer_than_examples(segments_only: None) -> None:
    """Qwen2 with every layer on a 4-token window: examples longer than it are masked by it."""
    model = _model(
        "qwen2",
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    batch = _packed_batch()
    _attend(model, "segments")
    got = _loss_and_grads(model, batch)
    for reference in ("sdpa", "eager"):
        _attend(model, reference)
        _assert_same(got, _sdpa_loss_and_grads(model, batch))
    full = _model("qwen2")  # the same weights, no window: the window mattered
    assert abs(_sdpa_loss_and_grads(full, batch)[0] - got[0]) > 1e-4


# ---------------------------------------------------------------------------------------------
# Every method


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_sdpa(method: str) -> None:
    """Packed rows for the methods that pack; one example per row for the prompt methods,
    whose virtual tokens (a KV-cache prefix, or prepended embeddings) make sdpa's mask the
    path (prefix) or join every row's one example (prompt)."""
    examples = _examples()
    if SPECS[method].needs_unpacked_data:
        batch = collate(single_rows(examples)[:4], pad_id=0)
    else:
        batch = _packed_batch()
    cfg = MethodConfig(name=method)  # type: ignore[arg-type]
    results = []
    for name in ("sdpa", "segments"):
        base = _model("llama")
        _attend(base, name)
        torch.manual_seed(1)
        model = apply_method(base, cfg)
        for p in model.parameters():  # away from zero-initialised adapters' special case
            if p.requires_grad:
                with torch.no_grad():
                    p.add_(torch.randn_like(p) * 0.02)
        results.append(_loss_and_grads(model, batch))
    _assert_same(results[1], results[0])


# ---------------------------------------------------------------------------------------------
# Every architecture of the model zoo: a packed row equals each of its examples run alone

LOSS_RTOL = 1.2e-6
"""fp32; measured at most 1.2e-7 (the loss is a sum over ~100 tokens of ~4 each)."""
GRAD_RTOL = 1.5e-6
"""Of each gradient's largest entry; measured at most 7.1e-7 (Gemma 2 on eager)."""


def _zoo_model(family: str, **config: object) -> tuple[PreTrainedModel, PreTrainedConfig]:
    """The family's 2-layer model (fp32, fixed init), without building its tokenizer."""
    cfg = FAMILIES[family].config(VOCAB, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.train(), cfg


def _alone(model: PreTrainedModel, examples: list[Example]) -> tuple[float, dict]:
    """Loss and gradients summed over one forward and backward per example."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for row in single_rows(examples):
        loss = token_loss_sum(model, collate([row], pad_id=0))
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal_alone(got: tuple[float, dict], alone: tuple[float, dict]) -> None:
    assert got[0] == pytest.approx(alone[0], rel=LOSS_RTOL, abs=0)
    assert got[1].keys() == alone[1].keys() and got[1]
    for name, grad in alone[1].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=GRAD_RTOL * scale, msg=name)


def _packed_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor], name: str) -> tuple:
    """Loss and gradients of `batch` with attention `name`; segments may not call sdpa."""
    _attend(model, name)
    with pytest.MonkeyPatch.context() as mp:
        if name == "segments":
            mp.setattr(attention, "sdpa_attention_forward", _refuse_sdpa)
            mp.setattr(attention, "sdpa_mask", _refuse_sdpa)
        return _loss_and_grads(model, batch)


def _refuse_sdpa(*args: object, **kwargs: object) -> None:
    raise AssertionError("segment attention delegated to sdpa")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_attends_within_each_example(family: str) -> None:
    """What auto picks for packed rows (segments, or the masked fallback for a model segments
    refuse) gives the loss and gradients of each example run alone on the model's masked
    attention; a row whose positions do not restart (the examples see each other) does not.
    Segments are refused by name before loading exactly where their forward would refuse."""
    model, cfg = _zoo_model(family)
    choice = resolve_attention("auto", packed=True, model_config=cfg)
    masked = resolve_attention("auto", packed=False, model_config=cfg).name
    refused = segments_refusal(type(model), cfg)
    assert (choice.name == "segments") == (refused is None)
    assert (choice.note is None) == (refused is None)
    examples = _examples()
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", 1) else 0
    assert not window or max(LENGTHS) > window  # it cuts into the longer examples
    _attend(model, masked)
    alone = _alone(model, examples)
    batch = _packed_batch()
    _assert_equal_alone(_packed_loss(model, batch, choice.name), alone)
    width = batch["input_ids"].shape[1]
    leaking = {**batch, "position_ids": torch.arange(width).expand_as(batch["position_ids"])}
    leaked = _packed_loss(model, leaking, choice.name)[0]
    assert abs(leaked - alone[0]) > 20 * LOSS_RTOL * alone[0]  # measured: 9.5e-5 and up
    if refused is not None:
        with pytest.raises(UnsupportedAttention, match=f"segments: {type(model).__name__}"):
            resolve_attention("segments", packed=True, model_config=cfg)
        with pytest.raises(UnsupportedAttention):
            _packed_loss(model, batch, "segments")
    if window:  # the window mattered: without it, other losses
        wide, _ = _zoo_model(family, sliding_window=64)
        assert abs(_packed_loss(wide, batch, choice.name)[0] - alone[0]) > 1e-5 * alone[0]


# ---------------------------------------------------------------------------------------------
# The mask function, the segments, the settings


def test_mask_function_builds_nothing_only_without_padding_or_cache() -> None:
    causal = segment_mask(batch_size=2, q_length=8, kv_length=8)
    assert causal is None
    assert segment_mask(2, 8, 8, attention_mask=torch.ones(2, 8, dtype=torch.bool)) is None
    padded = torch.ones(2, 8, dtype=torch.bool)
    padded[1, :3] = False
    mask = segment_mask(2, 8, 8, attention_mask=padded, allow_is_causal_skip=True)
    assert mask is not None and mask.shape == (2, 1, 8, 8) and not bool(mask[1, 0, 5, 0])
    # A 4-token prefix in the KV cache: the queries start at position 4.
    prefix = segment_mask(2, 8, 12, q_offset=4, allow_is_causal_skip=True)
    assert prefix is not None and prefix.shape[-1] == 12


def test_segment_lengths() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert segment_lengths(pos, 2, 8) == [[3, 2, 1, 2], [8]]
    assert segment_lengths(pos, 2, 8) is segment_lengths(pos, 2, 8)  # once per forward
    pos[1, 4:] = torch.arange(4)  # changed in place: found again
    assert segment_lengths(pos, 2, 8) == [[3, 2, 1, 2], [4, 4]]
    assert segment_lengths(torch.arange(5)[None], 3, 5) == [[5]] * 3  # broadcast position ids


def test_resolve_attention() -> None:
    llama = tiny_llama_config()

    def auto(packed: bool = True, **kw: object) -> str:
        return resolve_attention("auto", packed=packed, **{"model_config": llama, **kw}).name  # type: ignore[arg-type]

    assert auto() == "segments"
    assert auto(packed=False) == "sdpa"
    assert auto(model_config=None) == "sdpa"  # not known: sdpa, as transformers loads it
    remote = tiny_llama_config()
    remote.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    assert auto(model_config=remote, remote_code=True) == "sdpa"  # its own code, maybe no hooks
    assert auto(model_config=remote) == "segments"  # without trust_remote_code: transformers'
    assert auto(recorded="sdpa") == "sdpa"  # a resumed run
    assert auto(recorded="garbage") == "segments"
    chosen = resolve_attention("eager", packed=True, model_config=llama, recorded="segments")
    assert chosen == AttentionChoice("eager")
    assert resolve_attention("auto", packed=True, model_config=llama).note is None


def test_evaluation_attends_with_sdpa() -> None:
    model = _model("llama")
    _attend(model, "segments")
    wrapped = apply_method(model, MethodConfig(name="lora"))
    with sdpa_attention(wrapped):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == SEGMENTS
    with pytest.raises(RuntimeError), sdpa_attention(wrapped):
        raise RuntimeError("an eval that fails")
    assert model.config._attn_implementation == SEGMENTS


def test_generation_matches_sdpa() -> None:
    """Greedy decoding with a left-padded batch and a KV cache: segments hands it to sdpa."""
    model = _model("llama").eval()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = {}
    for name in ("sdpa", "segments"):
        _attend(model, name)
        out[name] = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    assert torch.equal(out["sdpa"], out["segments"])


def test_model_without_attention_functions_is_refused() -> None:
    class Custom(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedAttention, match=r"model\.attn_implementation=sdpa"):
        check_supported(Custom(), "segments")
    check_supported(Custom(), "sdpa")
    check_supported(_model("llama"), "segments")


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_segments_run_on_the_flash_kernel(kv_heads: int) -> None:
    """Forward and backward without the math kernel (the one that stores attention weights):
    with only flash allowed, SDPA raises when an input (a 3-D view, say) does not fit it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model("llama", num_key_value_heads=kv_heads)
    _attend(model, "segments")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss, grads = _loss_and_grads(model, _packed_batch())
    assert loss > 0 and grads


def _row_by_row_saved(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """How many tensors autograd saves for backward whose last two dims are (row, row)."""
    width = batch["input_ids"].shape[1]
    found = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        found[0] += int(t.dim() >= 2 and tuple(t.shape[-2:]) == (width, width))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model, batch)
    return found[0]


def test_no_row_by_row_tensor_is_kept() -> None:
    """sdpa keeps a (row x row) float mask per block for backward; segments keep nothing of
    that size, and the memory planner counts it so."""
    from leantune.memory.estimate import StepSettings, estimate
    from leantune.memory.inputs import model_facts_for

    width = 256
    rows = pack_examples(_examples([60, 50, 40, 40, 30, 20, 16], seed=2), seq_len=width)
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].shape == (1, width)
    model = _model("llama")
    _attend(model, "sdpa")
    blocks = tiny_llama_config().num_hidden_layers
    assert _row_by_row_saved(model, batch) >= blocks
    _attend(model, "segments")
    assert _row_by_row_saved(model, batch) == 0
    facts = model_facts_for(tiny_llama_config(), "fp32", "segments", MethodConfig(name="lora"))
    step = StepSettings(1, width)
    masked = estimate(facts, step)
    cut = estimate(facts, dataclasses.replace(step, attn_implementation="segments"))
    # The masks, and K and V at their grouped heads (segments pass GQA heads to the kernel as
    # they are; a masked sdpa call gets them repeated to every query head).
    c = tiny_llama_config()
    head_dim = c.hidden_size // c.num_attention_heads
    repeated = (c.num_attention_heads - c.num_key_value_heads) * head_dim
    kv = width * blocks * 2 * repeated * 4
    assert masked.activations - cut.activations == width * width * (1 + 4 * blocks) + kv


def test_rows_reach_the_kernel_unmixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel sees one causal call per example and never a mask."""
    calls: list[tuple[int, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append((q.shape[-2], kw.get("attn_mask") is None and bool(kw.get("is_causal"))))
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = _model("llama")
    _attend(model, "segments")
    output_head(model)  # the once-per-model check of its logits (the loader's): not the loss's
    calls.clear()
    rows = [Row(list(range(3, 13)), [-100] * 10, [0, 1, 2, 3, 0, 1, 2, 0, 1, 2])]
    with torch.no_grad():
        token_loss_sum(model, {**collate(rows, 0), "labels": torch.tensor([[5] * 10])})
    assert calls == [(4, True), (3, True), (3, True)] * model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------
# A run


def _chat(n: int, offset: int = 0) -> list[dict]:
    items = ["lamp", "desk", "phone", "cable", "chair"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Order {i} for a {items[i % 5]}, status?"},
                {"role": "assistant", "content": f"Order {i}: the {items[i % 5]} ships today."},
            ]
        }
        for i in range(offset, offset + n)
    ]


def test_a_packed_run_trains_with_segments_as_it_did_with_sdpa(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The default (auto) trains packed rows with segments, records it in the fingerprint, and
    follows the sdpa run's losses; its evaluation and final model are sdpa's."""
    train_file = write_jsonl(tmp_path / "train.jsonl", _chat(24))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", _chat(4, offset=100))

    def run(name: str, *extra: str) -> tuple[dict, list[dict], dict]:
        cfg = load_config(
            None,
            [
                f"model.path={tiny_llama_dir}",
                f"data.train={train_file}",
                f"data.eval={eval_file}",
                "data.format=chat",
                f"run.dir={tmp_path / name}",
                "run.progress=false",
                "train.max_steps=3",
                "train.micro_batch_size=2",
                "method.name=full",  # final/ then holds the model's own config.json
                "train.lr=1e-3",
                "train.precision=fp32",
                "train.eval_exact_match=false",
                *extra,
            ],
        )
        summary = train(cfg, log=lambda _: None)
        record = json.loads((tmp_path / name / "leantune_run.json").read_text())
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        return record["fingerprint"], metrics, summary

    auto, auto_metrics, auto_summary = run("auto")
    sdpa, sdpa_metrics, sdpa_summary = run("sdpa", "model.attn_implementation=sdpa")
    unpacked, _, _ = run("unpacked", "data.pack=false")
    assert auto["model.attn_implementation"] == "segments"
    assert sdpa["model.attn_implementation"] == "sdpa"
    assert unpacked["model.attn_implementation"] == "sdpa"
    assert auto["data.pack"] is True and len(auto_metrics) == len(sdpa_metrics) == 3
    for a, b in zip(auto_metrics, sdpa_metrics, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert auto_summary["eval_loss"] == pytest.approx(sdpa_summary["eval_loss"], rel=1e-5)
    config = json.loads((tmp_path / "auto" / "final" / "config.json").read_text())
    assert SEGMENTS not in json.dumps(config)


# ---------------------------------------------------------------------------------------------
# Models segments cannot compute: auto falls back before any work, explicit choices are refused


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2 soft-caps its attention logits (and has no sdpa path in transformers)."""
    return save_family_model(tmp_path_factory.mktemp("gemma2"), "gemma2")


def _zoo_train(model: Path, tmp_path: Path, *extra: str) -> CliResult:
    data = write_jsonl(tmp_path / "chat.jsonl", plant_chats(12, system_every=0))
    args = ["train.max_steps=2", "method.name=lora", "data.max_seq_len=256", *extra]
    return run_cli(tiny_train_args(model, data, tmp_path / "run", *args))


def test_auto_trains_a_soft_capped_model_on_eager(gemma2_dir: Path, tmp_path: Path) -> None:
    """Packed rows (the default) go to eager's masked path, said once; the run records it."""
    result = _zoo_train(gemma2_dir, tmp_path)
    assert result.code == 0, result
    said = [line for line in result.out.splitlines() if "model.attn_implementation=auto" in line]
    assert len(said) == 1, result.out
    assert "-> eager" in said[0] and "attn_logit_softcapping" in said[0], said
    record = json.loads((tmp_path / "run" / "leantune_run.json").read_text())
    assert record["fingerprint"]["model.attn_implementation"] == "eager"
    assert record["fingerprint"]["data.pack"] is True
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


@pytest.mark.parametrize("name", ["segments", "sdpa"])
def test_an_explicit_attention_the_model_cannot_use_is_refused_first(
    name: str, gemma2_dir: Path, tmp_path: Path
) -> None:
    result = _zoo_train(gemma2_dir, tmp_path, f"model.attn_implementation={name}")
    assert result.code == 2, result
    assert f"model.attn_implementation={name}: Gemma2ForCausalLM" in result.err, result.err
    assert "set model.attn_implementation=eager" in result.err, result.err
    assert "prepare:" not in result.out  # refused before the data is read
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# eval, generate and export load an attention the model supports, or the one asked for


def test_inference_loads_an_attention_the_model_supports(
    gemma2_dir: Path, tiny_llama_dir: Path
) -> None:
    """auto is eager for Gemma 2 (its logits are its own eager forward's), sdpa elsewhere;
    --attn-implementation overrides it, and one the model cannot use is refused by name."""
    model, tokenizer = load_for_inference(str(gemma2_dir))
    assert model.config._attn_implementation == "eager"
    ids = tokenizer("Water the fern twice a week.", return_tensors="pt")["input_ids"]
    own = AutoModelForCausalLM.from_pretrained(gemma2_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, own(ids).logits, rtol=0, atol=0)
    assert load_for_inference(str(tiny_llama_dir))[0].config._attn_implementation == "sdpa"
    eager, _ = load_for_inference(str(tiny_llama_dir), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    refusal = r"--attn-implementation=sdpa: Gemma2ForCausalLM .*; set --attn-implementation=eager"
    with pytest.raises(UnsupportedAttention, match=refusal):
        load_for_inference(str(gemma2_dir), attn_implementation="sdpa")


def test_a_trained_soft_capped_model_evaluates_generates_and_exports(
    gemma2_dir: Path, tmp_path: Path
) -> None:
    assert _zoo_train(gemma2_dir, tmp_path).code == 0
    run, data = tmp_path / "run", tmp_path / "chat.jsonl"
    commands = {
        "eval": ["eval", "--model", str(run), "--data", str(data), "--limit", "4"],
        "generate": [
            "generate",
            "--model",
            str(run),
            "--prompt",
            "Water?",
            "--max-new-tokens",
            "3",
        ],
        # Held-out chats without a system message: Gemma's template refuses one, and the
        # built-in parity prompts have one.
        "export": [
            *("export", str(run), "--format", "hf", "--data", str(data)),
            *("--out", str(tmp_path / "hf")),
        ],
    }
    done = {name: run_cli(args) for name, args in commands.items()}
    assert all(r.code == 0 for r in done.values()), done
    eager = run_cli([*commands["eval"], "--attn-implementation", "eager"])
    assert json.loads(eager.out)["loss"] == json.loads(done["eval"].out)["loss"] > 0
    report = json.loads((tmp_path / "hf" / "export_report.json").read_text())
    assert report["passed"] is True, report
    for name, args in commands.items():
        if name == "export":
            args = [*args[:-1], str(tmp_path / "hf2")]
        refused = run_cli([*args, "--attn-implementation", "sdpa"])
        assert refused.code == 2, (name, refused)
        assert "--attn-implementation=sdpa: Gemma2ForCausalLM" in refused.err, refused.err
    assert not (tmp_path / "hf2").exists()  # refused before the export's folder is made
