"""qlora: a 4-bit NF4 base loaded through bitsandbytes (which runs on CPU too) plus LoRA."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
from support import QA_ROWS, prepare_rows, write_jsonl

from leantune.config import ConfigError
from leantune.core.optim import build_optimizer
from leantune.data.loader import collate
from leantune.methods.artifacts import load_for_inference, save_final
from leantune.methods.registry import (
    apply_method,
    base_quantization,
    merge_for_inference,
    trainable_named_parameters,
)
from leantune.models.loading import ModelSource, load_model
from leantune.models.quantize import Quantization, is_quantized
from leantune.training.checks import load_config
from leantune.training.trainer import backward_window

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)

IDS = torch.tensor([[5, 17, 42, 7, 99, 3]])


def lora_model(model_dir: Path, name: str, *overrides: str) -> torch.nn.Module:
    """The base loaded as the recipe loads it for `name`, wrapped by the method."""
    cfg = load_config(None, [f"method.name={name}", *overrides])
    quant = base_quantization(cfg.method, "fp32")  # these tests train in fp32 (train_steps)
    base = load_model(ModelSource(str(model_dir)), quantization=quant)
    torch.manual_seed(0)
    return apply_method(base, cfg.method)


def train_steps(model: torch.nn.Module, batch, lr: float, steps: int) -> list[float]:
    opt = build_optimizer(trainable_named_parameters(model), lr, 0.0)
    model.train()
    losses = []
    for _ in range(steps):
        losses.append(backward_window(model, [batch], torch.device("cpu"), "fp32"))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.fixture()
def batch(tokenizer, tmp_path: Path):
    data = prepare_rows(
        write_jsonl(tmp_path / "d.jsonl", QA_ROWS), "chat", tokenizer, 64, pack=True
    )
    return collate(data.rows, 0)


def test_blocks_are_nf4_and_only_fp32_adapters_train(tiny_llama_dir: Path) -> None:
    import bitsandbytes as bnb

    model = lora_model(tiny_llama_dir, "qlora")
    four_bit = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    # 2 blocks x (q, k, v, o, gate, up, down); lm_head and embeddings stay full precision.
    assert len(four_bit) == 14 and not any("lm_head" in n for n in four_bit)
    weight = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
    assert weight.dtype == torch.uint8 and weight.numel() == 128 * 64 // 2  # two codes a byte
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quant
    params = trainable_named_parameters(model)
    assert {n.split(".")[-3] for n in params} == {"lora_A", "lora_B"}
    assert all(p.dtype == torch.float32 for p in params.values())


def test_double_quant_option_controls_nested_scales(tiny_llama_dir: Path) -> None:
    model = lora_model(tiny_llama_dir, "qlora", "method.double_quant=false")
    weight = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
    assert not weight.quant_state.nested


def test_qlora_at_lr_1e3_learns_like_lora(tiny_llama_dir: Path, batch) -> None:
    """QLoRA learns at lr 1e-3 (its loss is not flat over 4 steps): on the same batch, its loss
    falls about as far as LoRA's, and every adapter matrix gets gradients. Both start alike
    (B = 0), so the comparison is of the 4-bit base alone."""
    qlora = lora_model(tiny_llama_dir, "qlora", "method.init=default")
    lora = lora_model(tiny_llama_dir, "lora")
    q_losses = train_steps(qlora, batch, 1e-3, 4)
    l_losses = train_steps(lora, batch, 1e-3, 4)
    assert all(b < a for a, b in itertools.pairwise(q_losses)), q_losses
    q_drop, l_drop = q_losses[0] - q_losses[-1], l_losses[0] - l_losses[-1]
    assert q_drop == pytest.approx(l_drop, rel=0.1), (q_losses, l_losses)
    # After 4 steps every A and B has moved from its init (B from exactly 0).
    for name, p in trainable_named_parameters(qlora).items():
        if "lora_B" in name:
            assert p.abs().max() > 0, name


def test_adapter_reloads_on_the_requantised_base_with_equal_logits(
    tiny_llama_dir: Path, tokenizer, batch, tmp_path: Path
) -> None:
    model = lora_model(tiny_llama_dir, "qlora")
    train_steps(model, batch, 1e-2, 3)
    quant = Quantization(double_quant=True, compute_dtype="fp32")
    out = save_final(model, tokenizer, tmp_path / "final", str(tiny_llama_dir), quantization=quant)
    pointer = json.loads((out / "leantune_base.json").read_text())
    assert pointer["quantization"] == {
        "bits": 4,
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "fp32",
    }
    assert not list(out.glob("*.bin")) and (out / "adapter_model.safetensors").is_file()
    reloaded, _ = load_for_inference(str(out))
    assert is_quantized(reloaded)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        got = reloaded(input_ids=IDS).logits
        # NF4 quantisation is deterministic: the rebuilt 4-bit base is the trained one.
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        # The same adapter on the full-precision base is a different model (W vs NF4(W)).
        pointer.pop("quantization")
        (out / "leantune_base.json").write_text(json.dumps(pointer))
        full_precision, _ = load_for_inference(str(out))
        assert not is_quantized(full_precision)
        gap = (full_precision(input_ids=IDS).logits - expected).abs().max()
    assert gap > 1e-3


def test_merge_for_inference_leaves_a_4bit_base_unmerged(tiny_llama_dir: Path, batch) -> None:
    model = lora_model(tiny_llama_dir, "qlora")
    train_steps(model, batch, 1e-2, 2)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        merge_for_inference(model)
        after = model(input_ids=IDS).logits
    assert torch.equal(before, after)
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_qlora_without_a_4bit_base_is_refused(tiny_llama_dir: Path) -> None:
    cfg = load_config(None, ["method.name=qlora"])
    base = load_model(ModelSource(str(tiny_llama_dir)))
    with pytest.raises(ValueError, match="qlora needs the base loaded in 4 bits"):
        apply_method(base, cfg.method)


def test_missing_bitsandbytes_fails_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a)
    )
    with pytest.raises(ConfigError, match=r"method\.name=qlora needs bitsandbytes.*pip install"):
        load_config(None, ["method.name=qlora"])


def test_gguf_base_is_refused_before_loading(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ConfigError, match="qlora cannot start from a GGUF model"):
        load_config(None, ["method.name=qlora", f"model.path={gguf}"])


def test_compute_dtype_follows_precision_unless_set() -> None:
    def quant(*overrides: str) -> Quantization | None:
        cfg = load_config(None, ["method.name=qlora", *overrides])
        return base_quantization(cfg.method, cfg.train.precision)

    assert quant("train.precision=fp32") == Quantization("nf4", True, "fp32")
    assert quant("train.precision=bf16") == Quantization("nf4", True, "bf16")
    # auto is resolved first (the recipe does; tests/unit/core/test_precision.py runs it both ways).
    with pytest.raises(ValueError, match=r"resolved train\.precision"):
        quant("train.precision=auto")
    assert quant(
        "method.compute_dtype=bf16", "method.double_quant=false", "train.precision=fp32"
    ) == Quantization("nf4", False, "bf16")
    cfg = load_config(None, ["method.name=lora"])
    assert base_quantization(cfg.method, "fp32") is None


def test_validate_warns_about_low_precision_4bit_matmuls_on_cpu() -> None:
    """fp16 4-bit matmuls are slow on CPUs; bf16 ones only where bf16 is emulated, which
    tests/unit/core/test_precision.py checks both ways (on an AMX CPU bf16 is the fast choice)."""
    from leantune.training.checks import check_config

    cfg = load_config(None, ["method.name=qlora", "method.compute_dtype=fp16", "train.device=cpu"])
    assert any(
        "method.compute_dtype=fp16" in w and "fp32 is faster" in w for w in check_config(cfg)
    )
    cfg = load_config(None, ["method.name=qlora", "train.device=cpu"])
    assert check_config(cfg) == []


def test_recipe_trains_qlora_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from leantune.monitor.metrics import read_metrics
    from leantune.training.recipe import train

    rows = QA_ROWS * 3
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", QA_ROWS[:4])
    cfg = load_config(
        None,
        [
            f"model.path={tiny_llama_dir}",
            f"data.train={train_file}",
            f"data.eval={eval_file}",
            f"run.dir={tmp_path / 'run'}",
            "run.progress=false",
            "method.name=qlora",
            "train.max_steps=4",
            "train.micro_batch_size=8",
            "train.lr=1e-3",
            "train.eval_exact_match=false",
        ],
    )
    summary = train(cfg, log=lambda _: None)
    final = tmp_path / "run" / "final"
    assert json.loads((final / "leantune_base.json").read_text())["quantization"]["bits"] == 4
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert summary["eval_loss"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlora_on_cuda_bf16_trains_and_reloads(tiny_llama_dir: Path, tokenizer, tmp_path: Path):
    cfg = load_config(None, ["method.name=qlora", "train.precision=bf16"])
    quant = base_quantization(cfg.method, "bf16")
    base = load_model(ModelSource(str(tiny_llama_dir)), quantization=quant, device="cuda")
    model = apply_method(base, cfg.method)
    ids = IDS.cuda()
    opt = build_optimizer(trainable_named_parameters(model), 1e-3, 0.0, "paged_adamw_8bit", "cuda")
    losses = []
    for _ in range(4):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    out = save_final(model, tokenizer, tmp_path / "final", str(tiny_llama_dir), quantization=quant)
    reloaded, _ = load_for_inference(str(out))
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-2
        )


def test_parameter_count_is_the_full_precision_models(tiny_llama_dir: Path) -> None:
    """Packed 4-bit storage (two values a byte) is not what a user means by parameters (a 6.9B
    model counted that way reads "40,370,176 of 3,655,669,248"). QLoRA counts the logical values,
    the same total as the full-precision model and the same trainable count as LoRA."""
    from leantune.methods.registry import count_parameters

    qlora = lora_model(tiny_llama_dir, "qlora")
    lora = lora_model(tiny_llama_dir, "lora")
    weight = qlora.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
    assert weight.numel() == 128 * 64 // 2  # the packed storage the count must not use
    assert count_parameters(qlora) == count_parameters(lora)
    base = load_model(ModelSource(str(tiny_llama_dir)))
    trainable, total = count_parameters(qlora)
    assert total == sum(p.numel() for p in base.parameters()) + trainable  # base + adapters
