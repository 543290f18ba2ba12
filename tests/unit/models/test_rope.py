"""model.rope_scaling: the scaled frequencies are the specified ones, rotary angles stay fp32 under
bf16 autocast, and a model run at 4k+ positions in bf16 autocast stays close to fp32."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support import tiny_llama_config
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from leantune.config import ConfigError, RopeScalingConfig
from leantune.models.loading import ModelSource, load_model
from leantune.models.rope import apply_rope_scaling
from leantune.training.checks import load_config


def rotary(scaling: RopeScalingConfig | None, max_pos: int = 512) -> LlamaRotaryEmbedding:
    cfg = tiny_llama_config()
    cfg.max_position_embeddings = max_pos
    if scaling is not None:
        apply_rope_scaling(cfg, scaling)
    return LlamaRotaryEmbedding(cfg)


def cos_sin(rope: LlamaRotaryEmbedding, positions: torch.Tensor, dtype=torch.float32):
    x = torch.zeros(1, dtype=dtype)
    return rope(x, positions[None])


def test_linear_factor_2_at_position_2p_equals_unscaled_at_p() -> None:
    p = torch.arange(0, 900)
    scaled = rotary(RopeScalingConfig("linear", 2.0))
    assert scaled.config.max_position_embeddings == 1024
    cos2, sin2 = cos_sin(scaled, 2 * p)
    cos1, sin1 = cos_sin(rotary(None), p)
    # Halving a frequency is exact in binary floating point, so the angles are identical.
    assert torch.equal(cos2, cos1) and torch.equal(sin2, sin1)
    assert not torch.equal(cos_sin(scaled, p)[0], cos1)


def test_dynamic_keeps_short_inputs_and_raises_the_base_for_long_ones() -> None:
    base = rotary(None)
    dyn = rotary(RopeScalingConfig("dynamic", 4.0))
    assert dyn.config.max_position_embeddings == 512  # the original context, by design
    short = torch.arange(0, 512)
    assert torch.equal(cos_sin(dyn, short)[0], cos_sin(base, short)[0])
    seq = 2048
    cos_sin(dyn, torch.arange(0, seq))
    dim, theta, factor = 16, 10000.0, 4.0
    new_base = theta * ((factor * seq / 512) - (factor - 1)) ** (dim / (dim - 2))
    expected = 1.0 / (new_base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    torch.testing.assert_close(dyn.inv_freq, expected, rtol=1e-6, atol=0)


def test_yarn_keeps_high_frequencies_divides_low_ones_and_scales_attention() -> None:
    base = rotary(None)
    yarn = rotary(RopeScalingConfig("yarn", 4.0))
    assert yarn.config.max_position_embeddings == 2048
    assert yarn.config.rope_parameters["original_max_position_embeddings"] == 512
    assert yarn.inv_freq[0] == base.inv_freq[0]  # fastest rotation: extrapolated as is
    torch.testing.assert_close(yarn.inv_freq[-1], base.inv_freq[-1] / 4, rtol=1e-6, atol=0)
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)


def test_rotary_angles_are_fp32_under_bf16_autocast() -> None:
    """transformers 5 computes position x inv_freq as an elementwise product, which autocast
    leaves in fp32: cos/sin under bf16 autocast are the fp32 values, rounded once at the end."""
    rope = rotary(RopeScalingConfig("yarn", 8.0))
    positions = torch.arange(4000, 4200)
    ref_cos, ref_sin = cos_sin(rope, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos32, sin32 = cos_sin(rope, positions)
        cos16, _ = cos_sin(rope, positions, torch.bfloat16)
    assert torch.equal(cos32, ref_cos) and torch.equal(sin32, ref_sin)
    assert torch.equal(cos16, ref_cos.to(torch.bfloat16))
    # What computing the angle in bf16 would cost at these positions (bf16 cannot even hold 4097).
    bf16_angle = (positions[:, None].bfloat16() * rope.inv_freq.bfloat16()).float()
    assert (bf16_angle.cos() - ref_cos[0, :, :8]).abs().max() > 0.5


def _bf16_angle_forward(self, x, position_ids):
    freqs = (position_ids[..., None].bfloat16() * self.inv_freq.bfloat16()).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = self.attention_scaling
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def test_bf16_autocast_at_4k_positions_stays_close_to_fp32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny Llama with a 1024-token context, YaRN x4, run on 4160 tokens. q/k/v are scaled up
    so attention is sharp and depends on position (at init it is nearly uniform and hides RoPE
    errors). Measured: fp32 vs bf16 autocast max |logit diff| 0.036 at positions >= 4000;
    with the angles computed in bf16 instead it is 0.80, so the bound below can fail."""
    cfg = tiny_llama_config()
    cfg.max_position_embeddings = 1024
    apply_rope_scaling(cfg, RopeScalingConfig("yarn", 4.0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(10)
    ids = torch.randint(0, cfg.vocab_size, (1, 4160), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        ref = model(input_ids=ids).logits  # fp32 throughout

    def long_range_error() -> float:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(input_ids=ids).logits.float()
        return float((ref - low)[0, 4000:].abs().max())

    assert long_range_error() < 0.1
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _bf16_angle_forward)
    assert long_range_error() > 0.3


def test_config_parses_rope_scaling_and_rejects_bad_values(tmp_path: Path) -> None:
    train = tmp_path / "t.jsonl"
    train.write_text('{"text": "x"}\n')
    base = [f"data.train={train}"]
    cfg = load_config(None, [*base, "model.rope_scaling={type: yarn, factor: 4}"])
    assert cfg.model.rope_scaling == RopeScalingConfig("yarn", 4.0)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        f"data:\n  train: {train}\nmodel:\n  rope_scaling:\n    type: linear\n    fator: 2\n"
    )
    with pytest.raises(
        ConfigError, match=r"c\.yaml:4: model\.rope_scaling: unknown key\(s\) fator"
    ):
        load_config(yaml_file)
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.type: 'ntk' is not one of"):
        load_config(None, [*base, "model.rope_scaling={type: ntk, factor: 2}"])
    with pytest.raises(ConfigError, match=r"model\.rope_scaling: missing factor"):
        load_config(None, [*base, "model.rope_scaling={type: linear}"])
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.factor: must be > 1"):
        load_config(None, [*base, "model.rope_scaling={type: linear, factor: 0.5}"])


def test_scaled_model_loads_and_adapter_pointer_keeps_the_scaling(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path
) -> None:
    from leantune.methods.artifacts import load_for_inference, save_final
    from leantune.methods.registry import apply_method

    scaling = RopeScalingConfig("linear", 2.0)
    model = load_model(ModelSource(str(tiny_llama_dir)), rope_scaling=scaling)
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert model.config.max_position_embeddings == 1024
    lora = apply_method(model, load_config(None, ["method.name=lora"]).method)
    out = save_final(lora, tokenizer, tmp_path / "final", str(tiny_llama_dir), rope_scaling=scaling)
    assert json.loads((out / "leantune_base.json").read_text())["rope_scaling"] == {
        "type": "linear",
        "factor": 2.0,
        "original_max_position_embeddings": None,
    }
    reloaded, _ = load_for_inference(str(out))
    ids = torch.arange(0, 700)[None] % 384
    lora.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, lora(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_scaling_an_already_scaled_model_is_refused() -> None:
    cfg = tiny_llama_config()
    apply_rope_scaling(cfg, RopeScalingConfig("linear", 2.0))
    with pytest.raises(ValueError, match="already uses rope_type=linear"):
        apply_rope_scaling(cfg, RopeScalingConfig("yarn", 2.0))
