"""`hf`: the merged model as an HF safetensors directory that plain transformers loads.

The directory holds config, weights, tokenizer (with its chat template) and generation config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.export.parity import LogitsFn
from leantune.export.source import model_logits_fn


def write_hf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path
) -> dict[str, Any]:
    """Save `model` (already merged) with its tokenizer and generation config into `out`."""
    gen = model.generation_config
    if gen is not None and gen.eos_token_id is None and tokenizer.eos_token_id is not None:
        # Without it, generation in other tools runs past the end of the turn.
        gen.eos_token_id = tokenizer.eos_token_id
    # Batched generation in other tools needs a pad id; the tokenizer's is what training used.
    if gen is not None and gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"files": sorted(p.name for p in out.iterdir())}


def load_hf(out: Path) -> LogitsFn:
    """Load the export with plain `AutoModelForCausalLM` (no leantune, no peft)."""
    # float32 whatever the saved dtype: parity compares with the float32 source.
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return model_logits_fn(model)
