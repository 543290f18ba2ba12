"""`export --format gguf` for every architecture in `gguf_arch.ARCHITECTURES`: each zoo family's
tiny model exports and passes the parity check (logits of the GGUF read back by transformers vs
the source on held-out prompts); what llama.cpp or the read-back cannot handle is refused before
any weight loads, naming the model type and what can be exported.

The zoo models use initializer_range 0.1 so that logits are large enough for a wrong tensor
layout to fail the check (the broken-export tests below prove it does). Shapes where transformers'
GGUF loader would guess wrong from its class defaults (head_dim != hidden / heads, as in Qwen3 and
Gemma) are chosen on purpose so that `GgufArch.readback` is exercised.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_zoo import FAMILIES, save_family_model
from support import run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

import leantune.export.gguf_arch as gguf_arch
import leantune.export.gguf_file as gguf_file
from leantune.export.gguf_file import MODEL_FILE, read_fields, write_gguf
from leantune.export.parity import REPORT_NAME, ParityError, build_samples, sample_logits
from leantune.export.run import check_export, export_model
from leantune.export.source import ExportError, ExportSource, model_logits_fn

# family -> (config overrides that make it a real model's shape, GGUF architecture name)
EXPORTED: dict[str, tuple[dict[str, Any], str]] = {
    # Qwen3-0.6B has head_dim 128 with hidden/heads 64: transformers reads head_dim back only
    # through `readback`.
    "qwen3": ({"head_dim": 32}, "qwen3"),
    # Mistral v0.2/v0.3 have no sliding window (llama.cpp writes Mistral as Llama).
    "mistral": ({"sliding_window": None}, "llama"),
    "phi3": ({}, "phi3"),
    "phi4": ({}, "phi3"),
    "qwen2-moe": ({}, "qwen2moe"),
    # Qwen3-30B-A3B renormalises its top-k expert weights, as llama.cpp always does.
    "qwen3-moe": ({"norm_topk_prob": True}, "qwen3moe"),
    # Gemma 3 1B: every 6th layer full attention (llama.cpp's fixed pattern), whose rope base
    # (1e6) differs from the sliding layers' (1e4).
    "gemma3": (
        {
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
        },
        "gemma3",
    ),
    "smollm2": ({}, "llama"),
    "llama3": ({}, "llama"),
}


def _zoo(tmp_path: Path, family: str, **overrides: Any) -> Path:
    return save_family_model(tmp_path / family, family, initializer_range=0.1, **overrides)


def _arch(path: Path) -> str:
    return str(gguf.GGUFReader(path).fields["general.architecture"].contents())


@pytest.mark.parametrize("family", sorted(EXPORTED))
def test_each_family_exports_gguf_that_passes_parity(family: str, tmp_path: Path) -> None:
    overrides, arch = EXPORTED[family]
    src = _zoo(tmp_path, family, **overrides)
    out = tmp_path / "gguf"
    report = export_model(str(src), "gguf", out, gguf_type="f16")
    assert report["passed"] and report["tokenizer_samples_matched"] == report["samples"] == 4
    assert report["parity"]["max_abs_logit_diff"] < 0.05
    assert _arch(out / MODEL_FILE) == arch
    # The logits are large enough for the 0.05 above to be a real bound.
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    samples = build_samples(AutoTokenizer.from_pretrained(src))
    logits = sample_logits(model_logits_fn(model), samples)
    assert max(float(lg.abs().max()) for lg in logits) > 1.0


def test_every_registered_architecture_has_a_parity_test() -> None:
    """A new `ARCHITECTURES` entry needs a family here (Gemma 2 below, Qwen2 in test_export)."""
    tested = {FAMILIES[f].config(448).model_type for f in EXPORTED} | {"gemma2", "qwen2"}
    assert tested == set(gguf_arch.ARCHITECTURES)


def _export_eager(src: Path, out: Path, gguf_type: str = "f16") -> dict[str, Any]:
    """Write and check a GGUF from a model loaded with eager attention: `export` loads with
    sdpa, which transformers refuses for Gemma 2 (soft-capped attention)."""
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(src)
    samples = build_samples(tok)
    reference = sample_logits(model_logits_fn(model), samples)
    out.mkdir()
    info = write_gguf(model, tok, out, gguf_type)
    source = ExportSource(str(src), model, tok, None)
    return check_export(out, "gguf", reference, samples, source, info, gguf_type)


def test_gemma2_exports_with_llama_cpp_norms_and_soft_caps(tmp_path: Path) -> None:
    src = _zoo(tmp_path, "gemma2", head_dim=32, query_pre_attn_scalar=32)
    report = _export_eager(src, tmp_path / "gguf")
    assert report["passed"] and report["parity"]["max_abs_logit_diff"] < 0.05
    fields = read_fields(tmp_path / "gguf" / MODEL_FILE)
    assert fields["final_logit_softcapping"] == 30.0 and fields["attn_logit_softcapping"] == 50.0
    assert fields["attention.key_length"] == 32 and fields["attention.sliding_window"] == 8
    # llama.cpp multiplies by the stored norm weight, Gemma by (1 + weight): stored 1 + weight.
    reader = gguf.GGUFReader(tmp_path / "gguf" / MODEL_FILE)
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    hf = AutoModelForCausalLM.from_pretrained(src).state_dict()
    want = hf["model.layers.0.pre_feedforward_layernorm.weight"].numpy() + 1.0
    np.testing.assert_allclose(stored["blk.0.ffn_norm.weight"], want, rtol=0, atol=1e-6)


def test_gemma_without_the_norm_offset_fails_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = gguf_arch.ARCHITECTURES["gemma2"]
    monkeypatch.setitem(
        gguf_arch.ARCHITECTURES, "gemma2", dataclasses.replace(entry, norm_offset=0.0)
    )
    with pytest.raises(ParityError, match="parity check failed"):
        _export_eager(_zoo(tmp_path, "gemma2"), tmp_path / "bad")


def test_moe_experts_are_stacked_gate_and_up_apart(tmp_path: Path) -> None:
    """llama.cpp's layout: ffn_gate_exps / ffn_up_exps [experts, ff, hidden] from transformers'
    fused gate_up_proj (gate first), ffn_down_exps [experts, hidden, ff]; q8_0 on 3-D tensors."""
    src = _zoo(tmp_path, "qwen2-moe")
    out = tmp_path / "gguf"
    report = export_model(str(src), "gguf", out, gguf_type="q8_0")
    assert report["passed"]
    reader = gguf.GGUFReader(out / MODEL_FILE)
    tensors = {t.name: t for t in reader.tensors}
    hf = AutoModelForCausalLM.from_pretrained(src).state_dict()
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    ff = gate_up.shape[1] // 2
    for name, want in [("gate", gate_up[:, :ff]), ("up", gate_up[:, ff:])]:
        t = tensors[f"blk.1.ffn_{name}_exps.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=0.01)
    assert tensors["blk.1.ffn_gate_inp_shexp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    fields = read_fields(out / MODEL_FILE)
    assert fields["expert_count"] == 4 and fields["expert_used_count"] == 2
    assert fields["expert_feed_forward_length"] == 32
    assert fields["expert_shared_feed_forward_length"] == 64


def test_a_mistral_sliding_window_bounds_the_gguf_context(tmp_path: Path) -> None:
    """llama.cpp's Llama architecture has no sliding window: the GGUF declares the context in
    which it computes what transformers does (Mistral 7B v0.1: 4096)."""
    src = _zoo(tmp_path, "mistral", sliding_window=96, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    (tmp_path / "out").mkdir()
    write_gguf(model, AutoTokenizer.from_pretrained(src), tmp_path / "out", "f16")
    assert read_fields(tmp_path / "out" / MODEL_FILE)["context_length"] == 96


REFUSED = [
    # llama.cpp converts these, but transformers cannot read their GGUF back for the check.
    ("olmo2", {}, "model type 'olmo2' is not supported"),
    ("mixtral", {}, "model type 'mixtral' is not supported"),
    ("smollm3", {}, "model type 'smollm3' is not supported"),
    # Configurations llama.cpp would run differently.
    ("qwen3-moe", {"norm_topk_prob": False}, "norm_topk_prob False"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("gemma3", {}, r"layer_types \['sliding_attention', 'full_attention'\]"),
    ("gemma2", {"query_pre_attn_scalar": 99}, "query_pre_attn_scalar 99"),
]


@pytest.mark.parametrize(("family", "overrides", "message"), REFUSED)
def test_what_cannot_be_exported_is_refused_before_loading(
    family: str, overrides: dict[str, Any], message: str, tmp_path: Path
) -> None:
    src = _zoo(tmp_path, family, **overrides)
    # Without weights, anything that loads the model would fail differently: the refusal comes
    # from the config alone.
    (src / "model.safetensors").unlink()
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=message):
        export_model(str(src), "gguf", out)
    assert not out.exists()


def test_cli_refusal_exits_2_naming_the_model_type_and_the_supported_list(
    tmp_path: Path,
) -> None:
    src = _zoo(tmp_path, "olmo2")
    out = tmp_path / "out"
    result = run_cli(["export", str(src), "--format", "gguf", "--out", str(out)])
    assert result.code == 2, result
    text = result.out + result.err
    assert "model type 'olmo2' is not supported" in text
    for model_type in gguf_arch.ARCHITECTURES:
        assert model_type in text
    assert not out.exists()


def test_without_the_readback_a_qwen3_gguf_is_not_read_back_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' GGUF loader ignores key_length for Qwen3 and takes Qwen3Config's head_dim
    (128): `readback` is what makes the parity check load a head_dim-32 model as it is."""
    entry = gguf_arch.ARCHITECTURES["qwen3"]
    monkeypatch.setitem(
        gguf_arch.ARCHITECTURES, "qwen3", dataclasses.replace(entry, readback=lambda f: {})
    )
    out = tmp_path / "out"
    with pytest.raises(ParityError, match="transformers cannot read it back"):
        export_model(str(_zoo(tmp_path, "qwen3", head_dim=32)), "gguf", out)
    # A failed check leaves its report, so the folder is an earlier export to write over.
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["passed"] is False and "cannot read it back" in report["failures"][0]


def _swap_pre_tokenizer(
    src: Path, pre: dict[str, Any], decoder: dict[str, Any] | None = None
) -> None:
    path = src / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["pre_tokenizer"] = pre
    if decoder is not None:
        tok["decoder"] = decoder
    path.write_text(json.dumps(tok))


TOKENIZERS_REFUSED = [
    # llama.cpp's gpt-2 pre-tokenizer adds no prefix space: token ids would differ.
    (
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        None,
        "pre-tokenizer",
    ),
    # A known split followed by a second regex split is not the Llama 3 pre-tokenizer.
    (
        {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": gguf_file._LLAMA3_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": True,
                },
            ],
        },
        None,
        "pre-tokenizer",
    ),
    # SentencePiece style (Mistral v0.3, Gemma, Phi-3): not a byte-level BPE.
    (
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        "only byte-level BPE",
    ),
]


@pytest.mark.parametrize(("pre", "decoder", "message"), TOKENIZERS_REFUSED)
def test_a_tokenizer_llama_cpp_would_split_differently_is_refused_before_loading(
    pre: dict[str, Any], decoder: dict[str, Any] | None, message: str, tmp_path: Path
) -> None:
    src = _zoo(tmp_path, "mistral", sliding_window=None)
    _swap_pre_tokenizer(src, pre, decoder)
    (src / "model.safetensors").unlink()  # the refusal needs no weights
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=message):
        export_model(str(src), "gguf", out)
    assert not out.exists()
