"""What each method adapts does not depend silently on the family:
LoRA's defaults reach the routed experts of every MoE family in the model zoo, IA3 scales keys,
values and the MLP on fused layouts (Phi-3), and the run says once what is adapted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_zoo import FAMILIES, plant_chats, save_family_model
from peft import PeftModel
from support import make_config, write_jsonl
from transformers import AutoModelForCausalLM, PreTrainedModel

from leantune.config import MethodConfig
from leantune.core.optim import build_optimizer
from leantune.methods.coverage import coverage_of
from leantune.methods.errors import MethodError
from leantune.methods.lora import quiet_peft
from leantune.methods.registry import apply_method, count_parameters, trainable_named_parameters
from leantune.training.recipe import train

MOE = ["qwen3-moe", "qwen2-moe", "mixtral"]
R = 16  # the default preset's rank
IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 11, 23, 64, 8]])


def _base(family: str, seed: int = 0) -> PreTrainedModel:
    config = FAMILIES[family].config(128, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _applied(family: str, method: str, **fields: object) -> torch.nn.Module:
    torch.manual_seed(1)
    return apply_method(_base(family), MethodConfig(name=method, **fields))  # type: ignore[arg-type]


def _lora(out: int, inp: int, experts: int = 1) -> int:
    """LoRA's parameters on an out x in weight (fused experts: an A and a B per expert)."""
    return R * experts * (out + inp)


def _expert_wrappers(model: torch.nn.Module, layer: int) -> set[str]:
    """The fused expert weights of block `layer` that peft wraps (its `ParamWrapper`s)."""
    return {
        m.parameter_name
        for n, m in model.named_modules()
        if f"layers.{layer}.mlp.experts" in n and isinstance(getattr(m, "parameter_name", 0), str)
    }


@pytest.mark.parametrize("family", MOE)
def test_default_lora_adapts_and_trains_the_routed_experts_of_every_moe_family(
    family: str,
) -> None:
    model = _applied(family, "lora")
    for layer in range(2):
        assert _expert_wrappers(model, layer) == {"gate_up_proj", "down_proj"}, family
    expert_params = {n: p for n, p in trainable_named_parameters(model).items() if ".experts." in n}
    assert expert_params, family
    # Train the expert adapters alone: the output must change through them.
    for n, p in trainable_named_parameters(model).items():
        p.requires_grad_(n in expert_params)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        base = _base(family)(input_ids=IDS).logits
    torch.testing.assert_close(before, base)  # lora_B starts at 0: the base model's output
    model.train()
    logits = model(input_ids=IDS).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:])
    loss.backward()
    for n, p in expert_params.items():
        if "lora_B" in n:
            assert p.grad is not None and p.grad.abs().max() > 0, n
    torch.optim.SGD(list(expert_params.values()), lr=0.5).step()
    model.eval()
    with torch.no_grad():
        after = model(input_ids=IDS).logits
    assert (after - before).abs().max() > 1e-3, family


def _lines(family: str, method: str) -> list[str]:
    return coverage_of(_applied(family, method), method).lines()[1:]


# Dimensions from tests/model_zoo.py: hidden 64, 4 heads of 16 (2 for keys/values), MLP 128,
# MoE: 4 experts of 32 (Qwen) or 128 (Mixtral), Qwen2-MoE's shared expert 64.
ATTENTION = 2 * (_lora(64, 64) + 2 * _lora(32, 64) + _lora(64, 64))
COVERAGE = {
    "llama3": [
        f"method lora adapts: attention q_proj, k_proj, v_proj, o_proj x 2 layers ({ATTENTION:,}); "
        f"mlp gate_proj, up_proj, down_proj x 2 layers ({2 * 3 * _lora(128, 64):,})"
    ],
    "phi3": [
        # In the model's own order: Phi3Attention defines o_proj first.
        f"method lora adapts: attention o_proj, qkv_proj x 2 layers "
        f"({2 * (_lora(128, 64) + _lora(64, 64)):,}); mlp gate_up_proj, down_proj x 2 layers "
        f"({2 * (_lora(256, 64) + _lora(64, 128)):,})"
    ],
    "qwen3-moe": [
        f"method lora adapts: attention q_proj, k_proj, v_proj, o_proj x 2 layers "
        f"({ATTENTION:,}); routed experts gate_up_proj, down_proj via target_parameters "
        f"x 2 layers ({2 * (_lora(64, 64, 4) + _lora(64, 32, 4)):,})",
        "method lora keeps the MoE routers frozen: gate x 2 layers (the training loss has no "
        "load-balancing term to keep a trained router spreading tokens over experts)",
    ],
    "qwen2-moe": [
        f"method lora adapts: attention q_proj, k_proj, v_proj, o_proj x 2 layers "
        f"({ATTENTION:,}); shared expert gate_proj, up_proj, down_proj x 2 layers "
        f"({2 * 3 * _lora(64, 64):,}); routed experts gate_up_proj, down_proj via "
        f"target_parameters x 2 layers ({2 * (_lora(64, 64, 4) + _lora(64, 32, 4)):,})",
        "method lora keeps the MoE routers frozen: gate, shared_expert_gate x 2 layers (the "
        "training loss has no load-balancing term to keep a trained router spreading tokens "
        "over experts)",
    ],
    "mixtral": [
        f"method lora adapts: attention q_proj, k_proj, v_proj, o_proj x 2 layers "
        f"({ATTENTION:,}); routed experts gate_up_proj, down_proj via target_parameters "
        f"x 2 layers ({2 * (_lora(256, 64, 4) + _lora(64, 128, 4)):,})",
        "method lora keeps the MoE routers frozen: gate x 2 layers (the training loss has no "
        "load-balancing term to keep a trained router spreading tokens over experts)",
    ],
}


@pytest.mark.parametrize("family", sorted(COVERAGE))
def test_lora_coverage_lines_name_every_adapted_kind_with_its_count(family: str) -> None:
    model = _applied(family, "lora")
    coverage = coverage_of(model, "lora")
    assert coverage.lines()[1:] == COVERAGE[family]
    trainable, total = count_parameters(model)
    assert coverage.lines()[0] == (
        f"method lora: {trainable:,} of {total:,} parameters train ({100 * trainable / total:.3f}%)"
    )
    # The groups add up to what trains.
    assert sum(g.params for g in coverage.adapted) == trainable
    # summary.json's form of the same groups.
    groups = coverage.as_dict()["groups"]
    assert [(g["kind"], g["layers"], g["params"]) for g in groups] == [
        (g.kind, 2, g.params) for g in coverage.adapted
    ]
    assert groups[0]["kind"] == "attention" and groups[-1]["names"] == list(
        coverage.adapted[-1].names
    )


def test_ia3_coverage_lines_show_scales_and_the_experts_it_cannot_reach() -> None:
    assert _lines("llama3", "ia3") == [
        "method ia3 adapts: attention k_proj, v_proj via output scales x 2 layers (128); "
        "mlp down_proj via input scales x 2 layers (256)"
    ]
    assert _lines("phi3", "ia3") == [
        "method ia3 adapts: attention qkv_proj via output scales of k, v x 2 layers (128); "
        "mlp down_proj via input scales x 2 layers (256)"
    ]
    mixtral = _lines("mixtral", "ia3")
    assert (
        mixtral[0]
        == "method ia3 adapts: attention k_proj, v_proj via output scales x 2 layers (128)"
    )
    assert mixtral[-1] == (
        "warning: method ia3 does not reach the routed experts (gate_up_proj, down_proj x 2 "
        "layers: fused expert parameters, which it cannot adapt); method.name=lora adapts them"
    )


def test_coverage_of_the_other_methods() -> None:
    assert _lines("llama3", "full") == ["method full adapts: every parameter"]
    assert _lines("llama3", "prompt") == [
        "method prompt adapts: outside blocks prompt_encoder.default.embedding (1,280)"
    ]
    assert _lines("llama3", "adapter") == [
        "method adapter adapts: bottleneck adapters after mlp x 2 layers (1,160)"
    ]
    freeze = coverage_of(_applied("mixtral", "freeze", last_blocks=1), "freeze").lines()[1:]
    assert freeze == [
        "method freeze adapts: attention q_proj, k_proj, v_proj, o_proj x 1 of 2 layers "
        "(12,288); routed experts gate_up_proj, down_proj x 1 of 2 layers (98,304); router "
        "gate x 1 of 2 layers (256); block input_layernorm, post_attention_layernorm x 2 "
        "layers (256); outside blocks norm (64)"
    ]


def test_phi3_ia3_scales_keys_values_and_mlp_like_llama() -> None:
    """Phi-3 fuses q, k, v into qkv_proj and gate, up into gate_up_proj. IA3 scales its keys and
    values (the k and v slices of qkv_proj's output) and the MLP's inner activation (down_proj's
    input): as many scales as on Llama with the same dimensions, the queries untouched."""
    cfg = _base("phi3").config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    queries, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    model = _applied("phi3", "ia3")
    params = trainable_named_parameters(model)
    shapes = {n.split("layers.")[1]: tuple(p.shape) for n, p in params.items()}
    assert shapes == {
        f"{i}.{site}.ia3_l.default": shape
        for i in range(cfg.num_hidden_layers)
        for site, shape in (
            ("self_attn.qkv_proj", (queries + 2 * kv, 1)),
            ("mlp.down_proj", (1, cfg.intermediate_size)),
        )
    }
    logical = cfg.num_hidden_layers * (2 * kv + cfg.intermediate_size)
    assert count_parameters(model)[0] == logical == count_parameters(_applied("llama3", "ia3"))[0]
    # A few optimizer steps move the k, v and MLP scales and leave the query scales at 1.
    opt = build_optimizer(params, 5e-2, 0.0)
    model.train()
    for _ in range(3):
        logits = model(input_ids=IDS).logits
        torch.nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:]).backward()
        opt.step()
        opt.zero_grad()
    for name, p in params.items():
        if "qkv_proj" in name:
            assert torch.equal(p[:queries], torch.ones_like(p[:queries])), name
            assert (p[queries:] - 1).abs().min() > 0, name
        else:
            assert (p - 1).abs().min() > 0, name


def test_phi3_ia3_output_equals_the_base_with_k_and_v_rows_scaled() -> None:
    """The model's own forward as the reference: IA3's scales on qkv_proj act exactly as scaling
    the key and value rows of the base weight."""
    model = _applied("phi3", "ia3").eval()
    base = _base("phi3")
    queries = base.config.num_attention_heads * (base.config.hidden_size // 4)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in trainable_named_parameters(model).items():
            p.copy_(1 + 0.5 * torch.randn_like(p))
            if "qkv_proj" in name:
                p[:queries] = 1  # held: what training leaves there
            layer = int(name.split("layers.")[1].split(".")[0])
            block = base.model.layers[layer]
            if "qkv_proj" in name:
                block.self_attn.qkv_proj.weight.mul_(p)  # rows = outputs
            else:
                block.mlp.down_proj.weight.mul_(p)  # columns = inputs
        torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits)


def test_lora_target_names_that_match_nothing_are_refused() -> None:
    with pytest.raises(
        MethodError, match=r"'k_proj' matches no linear or embedding layer.*qkv_proj"
    ):
        _applied("phi3", "lora", target_modules=["k_proj"])


def test_explicit_lora_targets_reach_fused_experts_by_name() -> None:
    model = _applied("qwen2-moe", "lora", target_modules=["down_proj"])
    lines = coverage_of(model, "lora").lines()
    assert lines[1].startswith(
        "method lora adapts: shared expert down_proj x 2 layers (4,096); routed experts "
        "down_proj via target_parameters x 2 layers"
    )


@pytest.mark.parametrize("family", MOE)
def test_dora_refuses_to_skip_the_routed_experts(family: str) -> None:
    """peft has no DoRA for fused expert weights: the run says so instead of leaving them out
    (or failing with peft's traceback)."""
    with pytest.raises(MethodError, match=r"dora.*gate_up_proj.*routed experts"):
        _applied(family, "dora")
    named = _applied(family, "dora", target_modules=["q_proj", "v_proj"])
    assert {g.kind for g in coverage_of(named, "dora").adapted} == {"attention"}


def test_phi3_ia3_refuses_scales_that_lost_their_query_mask() -> None:
    """A strategy that swaps the parameters (FSDP2 shards) would drop the mask silently."""
    model = _applied("phi3", "ia3")
    layer = model.get_base_model().model.layers[0].self_attn.qkv_proj
    layer.ia3_l["default"] = torch.nn.Parameter(layer.ia3_l["default"].detach().clone())
    with pytest.raises(MethodError, match=r"fused qkv_proj.*dist.strategy=ddp"):
        model(input_ids=IDS)


@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_expert_adapters_save_reload_and_merge_to_the_same_logits(
    family: str, tmp_path: Path
) -> None:
    """The routed experts' adapters (peft target_parameters) are part of the saved adapter and
    fold into the fused expert weights on merge, as export does."""
    model = _applied(family, "lora")
    with torch.no_grad():
        for p in trainable_named_parameters(model).values():
            p.add_(torch.randn_like(p) * 0.05)
        expected = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    with quiet_peft():
        reloaded = PeftModel.from_pretrained(_base(family), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_qwen2_moe_run_says_its_routed_experts_train(tmp_path: Path) -> None:
    """End to end with the defaults: the log says once what LoRA adapts, and summary.json keeps
    it, routed experts included."""
    model_dir = save_family_model(tmp_path / "model", "qwen2-moe")
    data = write_jsonl(tmp_path / "chats.jsonl", plant_chats(8))
    logs: list[str] = []
    summary = train(
        make_config(model_dir, data, tmp_path / "run", "train.max_steps=2", "data.max_seq_len=256"),
        log=logs.append,
    )
    assert [line for line in logs if line.startswith("method lora ")] == [
        line for line in _lines("qwen2-moe", "lora") if line.startswith("method lora ")
    ]
    groups = json.loads((tmp_path / "run" / "summary.json").read_text())["adapted"]["groups"]
    experts = [g for g in groups if g["kind"] == "routed experts"]
    assert experts == [
        {
            "kind": "routed experts",
            "names": ["gate_up_proj", "down_proj"],
            "via": "target_parameters",
            "layers": 2,
            "params": 2 * (_lora(64, 64, 4) + _lora(64, 32, 4)),
        }
    ]
    assert summary["adapted"]["routers_frozen"] == ["gate", "shared_expert_gate"]


@pytest.mark.parametrize("family", MOE)
def test_routers_train_only_when_named(family: str) -> None:
    """The default keeps routers frozen (see lora.resolve_targets); naming `gate` adapts the
    router, a custom module around a 2-D weight in transformers 5, through target_parameters."""
    model = _applied(family, "lora", target_modules=["q_proj", "gate"])
    routers = [g for g in coverage_of(model, "lora").adapted if g.kind == "router"]
    assert [(g.names, g.layers) for g in routers] == [(("gate",), 2)]
    assert routers[0].params == 2 * _lora(4, 64)  # 4 experts x hidden 64, rank 16
