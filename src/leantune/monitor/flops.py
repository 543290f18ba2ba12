"""How much arithmetic a training token costs, and how much this device can do.

MFU (model FLOPs utilisation) is the share of the device's matmul peak that the model's own
arithmetic used: `flops_per_token x tokens/s / peak`. The peak is measured at set-up by a
short matmul in the run's precision (`measure_peak_flops`), and the run uses the best of that
probe and the best one this machine recorded before (`best_peak_flops`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from leantune.core.precision import machine_key
from leantune.core.writes import OutputError, write_file
from leantune.models.demo_model import leantune_home

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROBE_SECONDS = 0.01
"""Each timed round of the peak probe lasts about this long (the probe: ~4 rounds)."""
# Bounds the probe's memory and time: three 8192 x 8192 fp32 matrices are 768 MiB.
MAX_PROBE_SIZE = {"cuda": 8192, "cpu": 1024}
PEAK_FILE = "matmul_peak.json"
"""The best probe per machine, device and precision, under $LEANTUNE_HOME."""


def flops_per_token(matmul_params: int, trainable_matmul_params: int) -> float:
    """Training FLOPs per token: 4N + 2N_trainable (full fine-tuning 6N, LoRA on a frozen
    base ~4N). Attention's sequence-length term and recomputed forwards are not counted.

    Args:
        matmul_params: N, the parameters that multiply (`matmul_parameters`).
        trainable_matmul_params: the trainable ones among them.
    """
    # Every weight that multiplies costs 2 FLOPs per token forward and 2 backward for the
    # gradient with respect to its input, which the layers below need, frozen or not; only
    # trainable weights cost 2 more, for their own gradient. Gradient checkpointing's second
    # forward is left out: MFU counts the model's FLOPs, not the hardware's.
    return 4.0 * matmul_params + 2.0 * trainable_matmul_params


def matmul_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters of `model` that take part in a matmul.

    The input embedding is a table lookup and is left out, unless it is tied to the output head
    (which multiplies). A 4-bit weight counts the elements it stands for, not its packed bytes.
    """
    skip: set[int] = set()
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    # The input embedding is a lookup, no matmul, unless tied to the head, which multiplies.
    if embedding is not None:
        tied = head is not None and getattr(head, "weight", None) is embedding.weight
        if not tied:
            skip = {id(p) for p in embedding.parameters()}
    total = trainable = 0
    for p in model.parameters():
        if id(p) in skip:
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)  # bitsandbytes 4-bit
        n = math.prod(shape) if shape is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(a: torch.Tensor, b: torch.Tensor, repeats: int, device: torch.device) -> float:
    # CUDA launches return at once: without the syncs the clock would time the launches only.
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return time.perf_counter() - start


def measure_peak_flops(device: torch.device, precision: str, rounds: int = 3) -> float | None:
    """Matmul FLOP/s of `device` in `precision` (fp32, bf16 or fp16): the best of a few rounds.

    Costs ~50 ms on any device. Returns None when the device has no memory left for it (MFU is
    then not reported).
    """
    try:
        return _probe(device, DTYPES[precision], rounds)
    except torch.OutOfMemoryError:
        return None
    finally:
        if device.type == "cuda":  # the probe's matrices are gone: give their memory back
            torch.cuda.empty_cache()


def _probe(device: torch.device, dtype: torch.dtype, rounds: int) -> float:
    # Its own generator: the probe's size depends on timing, and the run's RNG must not.
    gen = torch.Generator(device=device).manual_seed(0)

    def matrix(n: int) -> torch.Tensor:
        return torch.randn(n, n, device=device, generator=gen).to(dtype)

    a = matrix(256)
    one = _seconds(a, a, 1, device) + _seconds(a, a, 1, device)  # warm-up, then a first timing
    # The 256 x 256 matmul only sizes the probe: a device-independent fixed size would be too
    # short to time on a fast GPU or too slow on a CPU. The floors guard a clock that read 0.
    rate = 2 * 256**3 / max(one / 2, 1e-9)
    # The size one matmul needs to last about PROBE_SECONDS at that rate, in steps of 256.
    size = int((rate * PROBE_SECONDS / 2) ** (1 / 3)) // 256 * 256
    size = min(max(size, 256), MAX_PROBE_SIZE.get(device.type, 1024))
    a, b = matrix(size), matrix(size)
    first = _seconds(a, b, 1, device)
    repeats = max(1, math.ceil(PROBE_SECONDS / max(first, 1e-9)))
    # The fastest round: other work on the device only ever adds time.
    best = min(_seconds(a, b, repeats, device) for _ in range(rounds)) / repeats
    return 2 * size**3 / max(best, 1e-12)


def _peak_key(device: torch.device, precision: str) -> str:
    """What a probe's result depends on: the machine (CPU model, flags, torch, threads) or the
    GPU's name, and the precision."""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}"
    else:
        where = machine_key()
    return f"{device.type} | {where} | {precision}"


def best_peak_flops(
    device: torch.device,
    precision: str,
    measure: Callable[[torch.device, str], float | None] = measure_peak_flops,
    cache: Path | None = None,
) -> float | None:
    """The matmul peak MFU is measured against: the higher of `measure` now and the best probe
    recorded for this machine in `cache` (default $LEANTUNE_HOME/matmul_peak.json), which keeps
    the higher one. A cache that cannot be read or written leaves the probe's value."""
    if cache is None:
        cache = leantune_home() / PEAK_FILE
    # A probe taken while other work shares the cores reads low (MFU of 5.6 and 13 were
    # reported so): the best probe this machine ever gave is the better peak.
    now = measure(device, precision)
    key = _peak_key(device, precision)
    entries: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError):
        raw = json.loads(cache.read_text(encoding="utf-8"))
        entries = {k: float(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
    # A zero or negative entry (a hand-edited file) is no peak to divide by.
    best = max([v for v in (now, entries.get(key)) if v is not None and v > 0], default=None)
    if best is not None and best != entries.get(key):
        entries[key] = best
        with contextlib.suppress(OSError, OutputError):  # the probe's value stands
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_file(cache, json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return best
