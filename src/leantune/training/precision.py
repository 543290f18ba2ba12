"""Mixed precision: autocast contexts and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(device_type: str, precision: str) -> Iterator[None]:
    """Autocast to bf16/fp16 for `precision` in ("bf16", "fp16"); a no-op for "fp32"."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision]):
        yield


def make_grad_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 on CUDA (fp16 gradients underflow without it); None otherwise.

    Raises:
        ValueError: fp16 requested off CUDA.
    """
    if precision != "fp16":
        return None
    if device_type != "cuda":
        raise ValueError("train.precision=fp16 needs CUDA; use bf16 on CPU")
    return torch.amp.GradScaler("cuda")


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is available")
    return torch.device(requested)


def bf16_slowdown_on_cpu(size: int = 256, repeats: int = 3) -> float:
    """How many times slower a bf16 matmul is than fp32 on this CPU (a ~0.1 s probe).

    CPUs without AVX512-BF16/AMX emulate bf16 matmul; on an AVX2-only machine it measured ~100x
    slower than fp32, which turns bf16 autocast from a speed-up into a stall.
    """
    import time

    a = torch.randn(size, size)
    timings = []
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            x @ x
        timings.append(time.perf_counter() - start)
    return timings[1] / max(timings[0], 1e-9)
