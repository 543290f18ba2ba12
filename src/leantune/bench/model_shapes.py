"""Random-weight models of real shapes, built from a transformers config on this machine
(nothing is downloaded: a shape decides memory and speed, the weights do not).

Used by `leantune bench throughput --model-shape`, `benchmarks/scale.py` and
`benchmarks/qlora_step.py`. Weights are written as bf16 safetensors shards, one tensor in memory
at a time, so building a 7B never holds more than one shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leantune.layout import ModelPaths

SHAPES: dict[str, dict[str, int]] = {
    # A test fixture's size: seconds to build and train, the same code path as the real ones.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": 1,
    },
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": 1,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": 1,
    },
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": 0,
    },
}
"""Qwen2.5-{0.5B,1.5B,7B}'s published config.json dimensions (the Qwen/Qwen2.5-* model cards),
and a tiny one for tests."""
SHARD_BYTES = 2 << 30
COMPLETE = "COMPLETE"
"""Written last into a built model folder: a folder without it is rebuilt."""


def dimensions(shape: str) -> dict[str, int]:
    """`shape`'s layer dimensions: its entry without the vocabulary and the tying (which depend
    on the tokenizer, and which a config takes as a bool)."""
    return {
        k: v for k, v in SHAPES[shape].items() if k not in ("vocab_size", "tie_word_embeddings")
    }


def config_kwargs(shape: str, vocab_size: int | None = None) -> dict[str, Any]:
    """`shape`'s `Qwen2Config` keywords: its dimensions, its vocabulary (or `vocab_size`) and its
    tying as the bool a config takes."""
    vocab = SHAPES[shape]["vocab_size"] if vocab_size is None else vocab_size
    tied = bool(SHAPES[shape]["tie_word_embeddings"])
    return {**dimensions(shape), "vocab_size": vocab, "tie_word_embeddings": tied}


def shape_vocab(shape: str, tokenizer_size: int, real_vocab: bool = True) -> int:
    """The vocabulary the built model has: the shape's published one (its embedding and output
    rows beyond the tokenizer's are never looked up, as Qwen2.5's 151,936 rows hold a 151,665
    token tokenizer, but the output layer and the loss pay for all of them), or the tokenizer's
    own size (`real_vocab=False`). Never below the tokenizer's size: every id must have a row."""
    return max(SHAPES[shape]["vocab_size"], tokenizer_size) if real_vocab else tokenizer_size


def build_model(shape: str, out: Path, tokenizer_dir: Path, real_vocab: bool = True) -> Path:
    """Random bf16 weights of `shape` (and `tokenizer_dir`'s tokenizer) in `out`, as sharded
    safetensors; kept and reused when `out` already holds a complete build."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if (out / COMPLETE).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        **config_kwargs(shape, shape_vocab(shape, len(tokenizer), real_vocab)),
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    writer = _ShardWriter(out)
    gen = torch.Generator().manual_seed(0)
    for name, p in skeleton.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = torch.empty(p.shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif p.dim() == 1:
            t.zero_()
        else:
            t.normal_(0.0, config.initializer_range, generator=gen)
        writer.add(name, t)
    writer.close()
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / COMPLETE).write_text("")
    return out


def parameter_count(model_dir: Path) -> int:
    """Parameters of a built model, from its config (tied embeddings counted once)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    kv = d * c.num_key_value_heads // c.num_attention_heads
    # q, k, v with biases, o without; the gated MLP; two RMSNorms.
    attention = d * d + d + 2 * (d * kv + kv) + d * d
    per_layer = attention + 3 * d * inter + 2 * d
    embeddings = vocab * d * (1 if c.tie_word_embeddings else 2)
    return int(c.num_hidden_layers * per_layer + embeddings + d)


class _ShardWriter:
    """Tensors into SHARD_BYTES shards and the safetensors index, a full shard at a time."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.shard: dict[str, Any] = {}
        self.size = 0
        self.index: dict[str, str] = {}
        self.written = 0

    def add(self, name: str, tensor: Any) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.shard and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.shard[name] = tensor
        self.size += nbytes

    def close(self) -> None:
        self._flush()
        index = {"metadata": {}, "weight_map": self.index}
        ModelPaths(self.out).weights_index.write_text(json.dumps(index, indent=1))

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.shard:
            return
        self.written += 1
        name = f"model-{self.written:05d}.safetensors"
        save_file(self.shard, self.out / name, metadata={"format": "pt"})
        self.index.update(dict.fromkeys(self.shard, name))
        self.shard, self.size = {}, 0
