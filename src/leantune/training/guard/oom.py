"""Out-of-memory recovery: recognise an OOM, free what it left, shrink, explain the last resort.

On CUDA an OOM is ``torch.OutOfMemoryError``. On CPU, ``train.memory_budget`` sets a limit: the
resident set size is read after every micro-batch's forward and backward, and a reading above the
budget raises the same ``torch.OutOfMemoryError`` the GPU would.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from leantune.core.process_memory import current_rss_bytes
from leantune.methods.registry import METHODS

T = TypeVar("T")


# On CPU the kernel's OOM killer ends a process that exhausts RAM before Python sees anything,
# so the budget sits below it and raises the GPU's error type, letting one recovery path serve.
class MemoryBudget:
    """Raises ``torch.OutOfMemoryError`` when the process's memory is above ``limit`` bytes."""

    def __init__(self, limit: int | None):
        self.limit = limit

    def check(self) -> None:
        """Compare the resident set size with the budget (a no-op without one)."""
        if self.limit is None:
            return
        rss = current_rss_bytes()
        if rss > self.limit:
            raise torch.OutOfMemoryError(
                f"resident memory {rss / 2**30:.2f} GiB is above "
                f"train.memory_budget={self.limit / 2**30:.2f} GiB"
            )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` reports exhausted device or budget memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # Older torch versions and some backends (MPS) raise a plain RuntimeError; its text is
    # the only sign.
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    """Give back what a failed step left: garbage, cached CUDA blocks, glibc's free heap."""
    # Collect first: tensors in reference cycles hold blocks that empty_cache cannot release.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        # glibc keeps freed heap pages; without this the budget check sees the failed
        # attempt's memory and the halved micro-batch would fail too.
        libc_name = ctypes.util.find_library("c")
        if libc_name:
            # musl and other libcs lack malloc_trim; the trim is an optimisation only.
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(libc_name).malloc_trim(0)


def halved(micro_batch_size: int) -> int:
    """The next micro-batch size to try after an OOM."""
    return max(1, micro_batch_size // 2)


def levers_message(max_seq_len: int, gradient_checkpointing: bool, method: str) -> str:
    """What to change when a single sequence does not fit, in the order worth trying."""
    levers = []
    if not gradient_checkpointing:
        levers.append("train.gradient_checkpointing=true (recompute activations in backward)")
    levers.append(f"a shorter data.max_seq_len (now {max_seq_len})")
    if METHODS[method].trains_base_weights:  # adapters are the lighter method
        levers.append("a lighter method: method.name=lora (or qlora where available)")
    else:
        levers.append("a lighter method or model: qlora (4-bit base) where available")
    levers.append("a larger train.memory_budget or a bigger device")
    return "Next levers: " + "; ".join(levers) + "."


def retry_on_oom(
    fn: Callable[[int], T],
    batch_size: int,
    on_retry: Callable[[int, int, str], None],
    device: torch.device,
    before_attempt: Callable[[], None] = lambda: None,
) -> T:
    """Call ``fn(batch_size)``, halving the batch size after each OOM, down to 1.

    For evaluation: it only ever shrinks its own batch, never the training micro-batch.

    Args:
        fn: Work parameterised by its batch size.
        batch_size: The first size to try.
        on_retry: Called with (old size, new size, error text) before each retry.
        device: Where the work runs (to free its memory between attempts).
        before_attempt: Called inside the protected region first (the test fault hook).

    Raises:
        torch.OutOfMemoryError: even batch size 1 ran out of memory.
    """
    while True:
        error = ""
        try:
            before_attempt()
            return fn(batch_size)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc) or batch_size == 1:
                raise
            error = str(exc).splitlines()[0]
        # Outside the except block: the traceback no longer pins the failed attempt's tensors.
        free_memory(device)
        smaller = halved(batch_size)
        on_retry(batch_size, smaller, error)
        batch_size = smaller
