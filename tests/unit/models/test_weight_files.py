"""Loading reads the checkpoint tensor by tensor (models/weight_files.py): the weights it builds
are transformers' own, and the checkpoint's pages are never resident beside them (otherwise a
13 GB bf16 7B loaded for QLoRA peaks at 18.9 GiB, its file pages and the 4-bit weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from leantune.core.process_memory import status_bytes
from leantune.models.loading import ModelSource, load_model
from leantune.models.weight_files import checkpoint_shards


def _save(out: Path, config: LlamaConfig, shard: str | None = None) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[2, 3], temperature=0.6, do_sample=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kwargs)
    return out


def _small() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["one-file", "sharded"])
def test_the_weights_are_transformers_own(tmp_path: Path, shard: str | None) -> None:
    folder = _save(tmp_path / "m", _small(), shard)
    shards = checkpoint_shards(str(folder))
    assert shards is not None and (len(shards) > 1) == (shard is not None)
    ours = load_model(ModelSource(str(folder)), dtype="fp32")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for k, v in theirs.items():
        assert mine[k].dtype == v.dtype and torch.equal(mine[k], v), k
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    assert ours.name_or_path == ref.name_or_path == str(folder)
    ids = torch.tensor([[1, 5, 9, 200]])
    assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_weights_without_the_files_transformers_reads_fall_back(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", _small())
    (folder / "model.safetensors").rename(folder / "other.safetensors")
    assert checkpoint_shards(str(folder)) is None  # transformers would read no such file either


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self's VmHWM")
def test_loading_never_holds_the_files_pages_beside_the_weights(tmp_path: Path) -> None:
    # 67M parameters: a 134 MB bf16 file built into 268 MB of fp32 weights, no tensor over 4 MB.
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    folder = _save(tmp_path / "m", config)
    file_bytes = (folder / "model.safetensors").stat().st_size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    before = status_bytes("VmRSS")
    model = load_model(ModelSource(str(folder)), dtype="fp32")
    grew = status_bytes("VmHWM") - before
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # memory-mapped loading peaks at weights + the whole file; one tensor at a time adds a few MB
    assert grew < weights + 0.35 * file_bytes, (grew / 2**20, weights / 2**20, file_bytes / 2**20)
