"""`torchscript`: `model.pt`, a traced module mapping input ids to logits, for C++/`torch.jit` use.

    logits = torch.jit.load("model.pt")(input_ids)   # [batch, seq] int64 -> [batch, seq, vocab]

The trace is made with `example_input.pt` (saved beside it) and works for any batch size and
length; the parity check runs other shapes than the example's.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.core.writes import write_file
from leantune.export.parity import LogitsFn

MODEL_FILE = "model.pt"
EXAMPLE_FILE = "example_input.pt"
# Short: the traced module serves any length, so the example only has to run the graph once.
EXAMPLE_LEN = 8


class LogitsModule(nn.Module):
    """`input_ids -> logits` over a causal LM, traceable for any batch size and length."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers builds its own mask with shape-dependent Python code that a trace would
        # freeze at the example's shape; a causal mask and position ids made with tensor ops
        # stay symbolic, so the traced module serves any batch size and length.
        batch, length = input_ids.shape[0], input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(batch, -1)
        keep = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        mask = torch.zeros(length, length, device=input_ids.device)
        # Additive, as transformers' own masks: the float minimum rather than -inf, which turns
        # a fully masked softmax row into NaN.
        mask = mask.masked_fill(~keep, torch.finfo(torch.float32).min)
        mask = mask[None, None].expand(batch, 1, length, length)
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False
        )
        return out.logits


def trace_logits(model: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    """Trace `LogitsModule(model)` on `example` (float32 weights)."""
    with warnings.catch_warnings():
        # Tracer and deprecation warnings are expected here; parity on other shapes is the check.
        warnings.simplefilter("ignore")
        with torch.no_grad():
            # check_trace would rerun the same example; parity runs other shapes instead.
            traced = torch.jit.trace(LogitsModule(model).eval(), example, check_trace=False)
    return traced


def example_input(first_sample: list[int]) -> torch.Tensor:
    """The trace's example: the first `EXAMPLE_LEN` tokens of the first held-out sample."""
    return torch.tensor([first_sample[:EXAMPLE_LEN]])


def write_torchscript(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, example: torch.Tensor
) -> dict[str, Any]:
    """Trace and save `model.pt`, `example_input.pt`, and the tokenizer and config beside them."""
    traced = trace_logits(model, example)
    save_traced(traced, example, out)
    # Beside model.pt: the tokenizer makes its input ids; the config describes the model.
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"example_input_shape": list(example.shape), "usage": _USAGE}


def save_traced(traced: torch.jit.ScriptModule, example: torch.Tensor, out: Path) -> None:
    """`model.pt` and `example_input.pt`, written from Python."""
    # `torch.jit.save` to a path ends the process (std::terminate, exit 134) when the disk
    # fills; serialised to memory first, the write is Python's, and a full disk is an error
    # (`leantune.core.writes`). The cost: the module's bytes are held once more meanwhile.
    write_file(out / MODEL_FILE, traced.save_to_buffer())
    buffer = io.BytesIO()
    torch.save(example, buffer)
    write_file(out / EXAMPLE_FILE, buffer.getvalue())


def load_torchscript(out: Path) -> LogitsFn:
    """Load `model.pt` with `torch.jit.load`; no transformers code runs."""
    module = torch.jit.load(str(out / MODEL_FILE))
    module.eval()

    def fn(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return module(input_ids).float()  # parity compares float32 logits

    return fn


_USAGE = 'torch.jit.load("model.pt")(input_ids) -> logits [batch, seq, vocab]'
