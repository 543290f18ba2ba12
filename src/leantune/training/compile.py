"""`train.compile`: each transformer block compiled with torch.compile (Inductor) for training.

Blocks, not the whole model: every block of a model is the same code, so one compiled graph
serves them all (torch compiles a module's code once and passes its parameters in), and a
method's wrapping, the loss and the loop stay eager. Only the training forward (the block in
training mode, with gradients on) goes through the compiled code; evaluation, generation and
the KL term's base forward run eagerly, so their changing shapes (a KV cache growing by one
token) never recompile anything.

The segment attention (`models.attention`) reads each row's example lengths from its position
ids and calls SDPA once per example; traced, every new layout of a packed row would be a new
graph. It stays eager (`torch.compiler.disable`): a block compiles to the code before and
after it. The rows' lengths change from step to step: the first change recompiles with
dynamic shapes, and later lengths reuse that graph.

Inductor's CPU code is C++: it needs a C++ compiler (g++, or $CXX). Compiled code is cached
under $TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER): a second run of the same
model compiles in a fraction of the first one's time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from leantune.config.parse import ConfigError
from leantune.models.attention import keep_eager_under_compile
from leantune.training.parallel.fsdp import transformer_blocks


def compile_blocks(model: nn.Module) -> int:
    """Compile the training forward of every transformer block of `model` in place (its
    parameters and state-dict keys stay as they are); returns how many blocks.

    Raises:
        ConfigError: the model has no repeated blocks to compile.
    """
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(
            "train.compile=true: cannot find this model's transformer blocks (a ModuleList of "
            "repeated layers); set train.compile=false"
        )
    keep_eager_under_compile()
    for block in blocks:
        _compile_training_forward(block)
    return len(blocks)


def _compile_training_forward(block: nn.Module) -> None:
    """The block's calls in training mode with gradients on go through a compiled copy of its
    call; every other call is the eager one. `nn.Module.__call__` runs `_compiled_call_impl`
    when set (what `Module.compile` sets), so hooks and checkpointing wrappers still apply."""
    eager: Callable[..., Any] = block._call_impl
    compiled = torch.compile(eager)

    def call(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    block._compiled_call_impl = call
