"""`int8`: dynamic int8 quantisation of the linear layers (torch.ao) for CPU inference.

Weights are stored in int8 (one scale per output channel) and activations are quantised on the
fly, one scale per tensor. The output head and the MLP down-projections stay float32
(`FLOAT_LAYERS`). The quantised model is saved as a TorchScript trace, `model.pt`, loaded the same
way as the `torchscript` format:

    logits = torch.jit.load("model.pt")(input_ids)

The report adds the measured forward time of the float32 and int8 models and the speedup; the
parity check gives the perplexity change.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.export.torchscript import load_torchscript, save_traced, trace_logits

load_int8 = load_torchscript  # the same model.pt file, only its weights differ


# The output head's logits feed the softmax directly, and the down-projections' inputs carry
# outlier activations that one per-tensor int8 scale crushes: on SmolLM2-135M, quantising every
# linear layer raised held-out perplexity from 19.7 to 48.5; keeping these two float32 gave 21.8.
FLOAT_LAYERS = ("lm_head", "down_proj")
"""Linear layers whose name ends with one of these stay float32."""


def int8_layer_names(model: nn.Module) -> list[str]:
    """Names of the linear layers that `quantize_int8` quantises."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not n.endswith(FLOAT_LAYERS)
    ]


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose linear layers (but `FLOAT_LAYERS`) use dynamic int8 (CPU only)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    spec = dict.fromkeys(int8_layer_names(model), per_channel_dynamic_qconfig)
    with warnings.catch_warnings():
        # torch.ao.quantization warns that it moves to torchao; it still ships and works.
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=False)


@torch.no_grad()
def median_forward_ms(model: nn.Module, input_ids: torch.Tensor, repeats: int = 5) -> float:
    """Median wall time of one forward pass in milliseconds, after one warm-up pass."""
    # The warm-up pays the one-off allocations and kernel selection outside the timing.
    model(input_ids=input_ids, use_cache=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=input_ids, use_cache=False)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)  # median: one pass slowed by another process does not count


def write_int8(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    example: torch.Tensor,
    timing_input: torch.Tensor,
) -> dict[str, Any]:
    """Quantise, time against float32 on `timing_input`, trace on `example` and save."""
    # Dynamic quantisation reads float32 weights, and float32 is the baseline the speedup is of.
    model = model.float().eval()
    quantized = quantize_int8(model)
    fp32_ms = median_forward_ms(model, timing_input)
    int8_ms = median_forward_ms(quantized, timing_input)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_logits(quantized, example)
    save_traced(traced, example, out)
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "timing_input_shape": list(timing_input.shape),
        "fp32_forward_ms": fp32_ms,
        "int8_forward_ms": int8_ms,
        "speedup": fp32_ms / int8_ms,
        "int8_layers": len(int8_layer_names(model)),
        "float32_layers": list(FLOAT_LAYERS),
        # The speedup depends on the thread count, so the report says which one it measured.
        "torch_threads": torch.get_num_threads(),
        "usage": 'torch.jit.load("model.pt")(input_ids) -> logits [batch, seq, vocab]',
    }
