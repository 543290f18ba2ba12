"""Every export format round-trips a tiny model and passes its parity check; broken ones fail it.

The tiny models use initializer_range 0.1 so that their logits are far from uniform: with the
default 0.02 every logit is ~0 and a wrong export (e.g. unpermuted Q/K in GGUF) would change the
logits by less than the thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from support import save_tiny_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

import leantune.export.gguf_file as gguf_file
from leantune.cli.app import main
from leantune.cli.inference import EXPORT_FORMATS
from leantune.export.int8 import quantize_int8
from leantune.export.parity import REPORT_NAME, ParityError, build_samples, sample_logits
from leantune.export.run import FORMATS, check_export, export_model
from leantune.export.source import ExportError, load_source, merge_into_base, model_logits_fn
from leantune.methods.artifacts import save_final
from leantune.methods.lora import LoraSettings, apply_lora
from leantune.models.quantize import keep_training_layout


def _save_model(out: Path, arch: str, tokenizer_dir: Path) -> Path:
    # initializer_range 0.1: with the default 0.02 the logits sit near 0 and a broken GGUF moved
    # them by only 0.01, below the parity threshold.
    return save_tiny_model(out, arch, tokenizer_dir, initializer_range=0.1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_dir)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tokenizer_dir)


def _lora_model(base_dir: Path) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = apply_lora(base, LoraSettings(r=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero; a non-zero B makes the merge matter
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """A run directory whose final/ is a LoRA adapter on the tiny Llama."""
    run = tmp_path_factory.mktemp("lora_run")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    save_final(_lora_model(llama_dir), tok, run / "final", str(llama_dir))
    return run


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, 384, shape, generator=torch.Generator().manual_seed(sum(shape)))


def _peft_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    return model_logits_fn(load_source(str(run)).model)(ids)


def test_cli_formats_match_the_registry() -> None:
    assert set(EXPORT_FORMATS) == set(FORMATS)


def test_hf_merges_lora_and_loads_in_plain_transformers(
    lora_run: Path, llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    report = export_model(str(lora_run), "hf", out)
    assert report["passed"] and report["merged_adapter"]
    assert report["parity"]["max_abs_logit_diff"] < 1e-4
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        report["files"]
    )
    assert json.loads((out / REPORT_NAME).read_text())["passed"] is True
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n in merged.state_dict())
    ids = _ids(2, 9)
    with torch.no_grad():
        got = merged(ids).logits
        base = AutoModelForCausalLM.from_pretrained(llama_dir).eval()(ids).logits
    want = _peft_logits(lora_run, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (want - base).abs().max() > 0.05  # the adapter changed the model, so merging mattered
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == AutoTokenizer.from_pretrained(llama_dir).chat_template
    assert merged.generation_config.eos_token_id == tok.eos_token_id


def test_adapter_export_is_the_adapter_and_full_models_have_none(
    lora_run: Path, llama_dir: Path, tmp_path: Path
) -> None:
    report = export_model(str(lora_run), "adapter", tmp_path / "ad")
    assert report["passed"] and report["parity"]["max_abs_logit_diff"] == 0.0
    assert {"adapter_config.json", "adapter_model.safetensors", "leantune_base.json"} <= set(
        report["files"]
    )
    with pytest.raises(ExportError, match="full model, not a PEFT adapter"):
        export_model(str(llama_dir), "adapter", tmp_path / "none")


def test_torchscript_of_lora_merged_model_matches_eager_on_other_shapes(
    lora_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ts"
    report = export_model(str(lora_run), "torchscript", out)
    assert report["passed"] and report["example_input_shape"] == [1, 8]
    assert torch.load(out / "example_input.pt").shape == (1, 8)
    scripted = torch.jit.load(str(out / "model.pt"))
    for shape in [(3, 11), (1, 1), (2, 30)]:
        ids = _ids(*shape)
        torch.testing.assert_close(scripted(ids), _peft_logits(lora_run, ids), atol=1e-4, rtol=0)


def test_int8_reloads_the_quantised_model_and_reports_speed(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "int8"
    report = export_model(str(llama_dir), "int8", out)
    assert report["passed"]
    assert report["fp32_forward_ms"] > 0 and report["int8_forward_ms"] > 0
    assert report["speedup"] == pytest.approx(report["fp32_forward_ms"] / report["int8_forward_ms"])
    assert report["int8_layers"] == 2 * 6  # q, k, v, o, gate, up per block; down_proj stays float
    assert "lm_head" in report["float32_layers"]
    ids = _ids(2, 13)
    fp32 = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        want = quantize_int8(fp32)(ids).logits
        exact = fp32(ids).logits
    with torch.no_grad():
        got = torch.jit.load(str(out / "model.pt"))(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert 1e-4 < float((got - exact).abs().max()) < 0.5  # quantised, but close


GGUF_CASES = [
    ("llama", "f16", gguf.GGMLQuantizationType.F16, 0.05),
    ("llama", "bf16", gguf.GGMLQuantizationType.BF16, 0.2),
    ("llama", "q8_0", gguf.GGMLQuantizationType.Q8_0, 0.2),
    ("qwen2", "f16", gguf.GGMLQuantizationType.F16, 0.05),
    ("qwen2", "q8_0", gguf.GGMLQuantizationType.Q8_0, 0.2),
]


@pytest.mark.parametrize(("arch", "gguf_type", "qtype", "atol"), GGUF_CASES)
def test_gguf_reads_back_with_gguf_reader_and_transformers(
    arch: str,
    gguf_type: str,
    qtype: gguf.GGMLQuantizationType,
    atol: float,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    src: Path = request.getfixturevalue(f"{arch}_dir")
    out = tmp_path / "gguf"
    report = export_model(str(src), "gguf", out, gguf_type=gguf_type)
    assert report["passed"] and report["tokenizer_samples_matched"] == report["samples"]

    reader = gguf.GGUFReader(out / "model.gguf")
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    tmpl = reader.fields["tokenizer.chat_template"]
    source_tok = AutoTokenizer.from_pretrained(src)
    assert bytes(tmpl.parts[tmpl.data[0]]).decode() == source_tok.chat_template
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert ("output.weight" in types) == (arch == "qwen2")  # Llama here has tied embeddings
    assert ("blk.0.attn_q.bias" in types) == (arch == "qwen2")

    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    ids = _ids(2, 17)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        got = loaded.eval()(ids).logits
    diff = float((got - want).abs().max())
    assert diff < atol
    assert want.abs().max() > 1.0  # logits are not trivially small, so `atol` is a real bound

    tok = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    text = source_tok.apply_chat_template(
        [{"role": "user", "content": "Where is order A-1234?"}], tokenize=False
    )
    assert tok(text)["input_ids"] == source_tok(text)["input_ids"]
    assert tok.eos_token == source_tok.eos_token


def test_gguf_without_the_llama_qk_permutation_fails_parity(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_file, "permute_qk", lambda w, n_head: w)
    out = tmp_path / "bad"
    with pytest.raises(ParityError, match="parity check failed"):
        export_model(str(llama_dir), "gguf", out, gguf_type="f16")
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["passed"] is False
    assert report["parity"]["max_abs_logit_diff"] > report["thresholds"]["max_abs_logit_diff"]


def test_corrupted_hf_export_fails_the_check(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_model(str(llama_dir), "hf", out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    model.save_pretrained(out)
    source = load_source(str(llama_dir))
    samples = build_samples(source.tokenizer)
    reference = sample_logits(model_logits_fn(source.model), samples)
    with pytest.raises(ParityError, match="max abs logit difference"):
        check_export(out, "hf", reference, samples, source, {"format": "hf"})
    assert json.loads((out / REPORT_NAME).read_text())["passed"] is False


def test_gguf_refuses_unsupported_architectures(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=384)).save_pretrained(src)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(src)
    with pytest.raises(ExportError, match="model type 'gpt2' is not supported"):
        export_model(str(src), "gguf", tmp_path / "out")


def test_export_uses_held_out_data_and_refuses_a_foreign_out_dir(
    llama_dir: Path, tmp_path: Path
) -> None:
    from support import write_jsonl

    data = write_jsonl(
        tmp_path / "held.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}]
        * 3,
    )
    report = export_model(str(llama_dir), "torchscript", tmp_path / "ts", data=data)
    assert report["sample_source"] == str(data) and report["samples"] == 3
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not an earlier export"):
        export_model(str(llama_dir), "hf", foreign)
    with pytest.raises(ExportError, match="--samples 0"):
        export_model(str(llama_dir), "hf", tmp_path / "none", num_samples=0)


def test_cli_export_exit_codes(lora_run: Path, llama_dir: Path, tmp_path: Path) -> None:
    assert main(["export", str(lora_run), "--format", "hf", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / REPORT_NAME).read_text())["passed"] is True
    # A full model has no adapter: the user's mistake (exit 2), not a failed parity check (1).
    rc = main(["export", str(llama_dir), "--format", "adapter", "--out", str(tmp_path / "b")])
    assert rc == 2
    assert not (tmp_path / "b").exists()


def test_merge_dequantises_a_4bit_base_first(llama_dir: Path, tmp_path: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    for layer in base.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        compute_dtype=torch.float32,
                        quant_type="nf4",
                    )
                    q.weight = bnb.nn.Params4bit(
                        child.weight.data, requires_grad=False, quant_type="nf4"
                    )
                    setattr(parent, name, q.to("cpu"))
    keep_training_layout(base)  # as load_model does for a 4-bit base
    model = _lora_model_from(base)
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    ids = _ids(2, 9)
    want = model_logits_fn(model)(ids)
    merged, info = merge_into_base(model, adapter_dir)
    assert info["dequantized_layers"] == 2 * 7
    assert not any(type(p).__name__ == "Params4bit" for p in merged.parameters())
    got = model_logits_fn(merged)(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _nf4_layer(double_quant: bool, seed: int = 0) -> torch.nn.Module:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(seed)
    dense = torch.nn.Linear(128, 256)
    q = bnb.nn.Linear4bit(
        128, 256, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=double_quant
    )
    q.weight = bnb.nn.Params4bit(
        dense.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=double_quant
    )
    q.bias = torch.nn.Parameter(dense.bias.data.clone())
    return q.to("cpu")


@pytest.mark.parametrize("double_quant", [True, False])
def test_a_weight_repacked_for_the_avx512_bf16_kernel_dequantises_correctly(
    double_quant: bool,
) -> None:
    """bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel (shape [out, in/2],
    bf16 block scales). The repacking is forced here, so this runs on any CPU."""
    import bitsandbytes.functional as bnb_f

    from leantune.export.source import dequantize_4bit

    layer = _nf4_layer(double_quant)
    want = bnb_f.dequantize_4bit(layer.weight.data, layer.weight.quant_state).clone()
    absmax = float(want.abs().max())
    w = layer.weight
    w.data, w.quant_state = bnb_f._convert_weight_packed_for_cpu(w.data, w.quant_state)
    assert tuple(w.data.shape) == (256, 64)
    holder = torch.nn.Sequential(layer)
    assert dequantize_4bit(holder) == 1
    got = holder[0].weight.detach()
    assert got.shape == want.shape
    # The repacking rounded the block scales to bf16 (8 significant bits): recovered weights
    # are within 2^-8 of the block absmax. Reading the packed bytes as they are was off by 0.18,
    # and bitsandbytes' inverse alone (scales left transposed) by 10% of absmax without
    # double quantisation.
    assert float((got - want).abs().max()) <= absmax * 2**-8


def test_eval_mode_runs_the_training_kernel_on_every_cpu() -> None:
    """With keep_training_layout an eval forward neither repacks the weight nor changes the
    result, as if this CPU had AVX512-BF16 (the flag bitsandbytes sets from the CPU is forced)."""
    layer = _nf4_layer(double_quant=True)
    layer.support_avx512bf16_for_cpu = True
    assert keep_training_layout(torch.nn.Sequential(layer)) == 1
    x = torch.randn(3, 128)
    layer.train()
    train_out = layer(x).detach()
    layer.eval()
    with torch.no_grad():
        eval_out = layer(x)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(eval_out, train_out)


def _lora_model_from(base: torch.nn.Module) -> torch.nn.Module:
    model = apply_lora(base, LoraSettings(r=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def test_generate_chat_runs_on_an_exported_hf_model(
    lora_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from leantune.eval.generation import SamplingSettings, generate_texts, render_prompt

    out = tmp_path / "hf"
    export_model(str(lora_run), "hf", out)
    turns = ["and the second question?"]

    def fake_input(_prompt: str = "") -> str:
        if not turns:
            raise EOFError  # ends the chat after the second turn
        return turns.pop(0)

    monkeypatch.setattr("builtins.input", fake_input)
    argv = [
        "generate",
        "--model",
        str(out),
        "--chat",
        "--prompt",
        "hello there",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        "--repetition-penalty",
        "1.0",
    ]
    assert main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("assistant> ")]
    # The same conversation, generated directly with the unmerged adapter model.
    source = load_source(str(lora_run))
    settings = SamplingSettings(max_new_tokens=6, temperature=0.0, repetition_penalty=1.0)
    history = [{"role": "user", "content": "hello there"}]
    want = []
    for nxt in ["and the second question?", None]:
        (reply,) = generate_texts(
            source.model, source.tokenizer, [render_prompt(source.tokenizer, history)], settings, 1
        )
        want.append(reply)
        history += [{"role": "assistant", "content": reply}]
        if nxt is not None:
            history.append({"role": "user", "content": nxt})
    assert lines == [f"assistant> {w}" for w in want]
    assert len(lines) == 2 and all(len(w) > 0 for w in want)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "gguf_type"), [("gguf", "q8_0"), ("int8", "f16")])
def test_demo_model_exports_pass_parity(fmt: str, gguf_type: str, tmp_path: Path) -> None:
    """SmolLM2-135M, the model the lossy formats' thresholds were measured on (about 2 min each)."""
    data = Path(__file__).resolve().parents[3] / "src/leantune/demo/data/support_eval.jsonl"
    report = export_model("smollm2-135m-instruct", fmt, tmp_path / fmt, gguf_type, data)
    assert report["passed"]
    assert 10.0 < report["parity"]["ppl_source"] < 40.0  # a trained model, not a random one
