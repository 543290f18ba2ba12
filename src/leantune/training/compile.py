"""`train.compile`: each transformer block compiled with torch.compile (Inductor) for training.

Only the training forward (a block in training mode, with gradients on) runs compiled;
evaluation, generation and the KL term's base forward run eagerly, and so does the segment
attention inside each block.

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
    # The segment attention (`models.attention`) reads each row's example lengths from its
    # position ids and calls SDPA once per example; traced, every new layout of a packed row
    # would be a new graph. Kept eager, it splits a block's graph into the code before and
    # after it. The rows' lengths change from step to step: the first change recompiles with
    # dynamic shapes, and later lengths reuse that graph.
    keep_eager_under_compile()
    # Blocks, not the whole model: every block is the same code, so one compiled graph serves
    # them all (torch compiles a module's code once and passes its parameters in), and the
    # method's wrapping, the loss and the loop stay eager.
    for block in blocks:
        _compile_training_forward(block)
    return len(blocks)


def _compile_training_forward(block: nn.Module) -> None:
    """The block's calls in training mode with gradients on go through a compiled copy of its
    call; every other call is the eager one."""
    eager: Callable[..., Any] = block._call_impl
    compiled = torch.compile(eager)

    def call(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        # Eager for everything else: generation's shapes change every token (a KV cache
        # growing by one), and compiled they would recompile each time.
        return eager(*args, **kwargs)

    # The hook `Module.compile` itself sets: `nn.Module.__call__` runs `_compiled_call_impl`
    # when there is one, so forward hooks and checkpointing wrappers still apply around it.
    block._compiled_call_impl = call
