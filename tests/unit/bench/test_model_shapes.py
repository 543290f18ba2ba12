"""The random-weight models of `bench.model_shapes`: Qwen2.5's published shapes (their
parameter counts, from the model cards, follow from the dimensions), and a built model that
transformers loads with the dimensions and vocabulary asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from leantune.bench.model_shapes import (
    COMPLETE,
    SHAPES,
    build_model,
    dimensions,
    parameter_count,
    shape_vocab,
)

PUBLISHED = {
    # Qwen/Qwen2.5-{0.5B,1.5B,7B} config.json: hidden, intermediate, layers, heads, kv heads,
    # vocabulary, tied embeddings; and the parameter count that shape has.
    "0.5b": ((896, 4864, 24, 14, 2, 151936, True), 494_032_768),
    "1.5b": ((1536, 8960, 28, 12, 2, 151936, True), 1_543_714_304),
    "7b": ((3584, 18944, 28, 28, 4, 152064, False), 7_615_616_512),
}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_a_shape_has_the_published_dimensions_and_parameters(shape: str, tmp_path: Path) -> None:
    dims, parameters = PUBLISHED[shape]
    s = SHAPES[shape]
    assert (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_hidden_layers"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["vocab_size"],
        bool(s["tie_word_embeddings"]),
    ) == dims
    config = Qwen2Config(
        **dimensions(shape), vocab_size=dims[5], tie_word_embeddings=dims[6], dtype="bfloat16"
    )
    with torch.device("meta"):  # no memory: the count only
        model = AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    config.save_pretrained(tmp_path)
    assert counted == parameter_count(tmp_path) == parameters


def test_the_tiny_shape_builds_a_model_transformers_loads(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = build_model("tiny", tmp_path / "m", tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(out)
    c = model.config
    assert {k: getattr(c, k) for k in dimensions("tiny")} == dimensions("tiny")
    # The shape's vocabulary, never below the tokenizer's (every id needs a row).
    assert c.vocab_size == shape_vocab("tiny", len(tokenizer)) == max(512, len(tokenizer))
    assert shape_vocab("tiny", len(tokenizer), real_vocab=False) == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(out)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert 0.01 < float(weight.detach().std()) < 0.03  # initializer_range 0.02: random, not zero
    (out / "config.json").write_text("{}")  # a complete build is kept, not rebuilt
    assert build_model("tiny", out, tokenizer_dir) == out and (out / COMPLETE).is_file()
    assert (out / "config.json").read_text() == "{}"
