"""Mixed precision: autocast contexts, the fp16 gradient scaler, and what `train.precision=auto`
means on this machine.

`auto` picks, for the device the run trains on:

- CUDA: bf16 where the GPU supports it (`torch.cuda.is_bf16_supported()`), else fp16 with a
  GradScaler.
- CPU: bf16 autocast where this CPU runs bf16 matmul clearly faster than fp32 (native bf16
  units: AVX512-BF16, AMX), else fp32. Feature flags do not say this reliably (torch reports
  "AVX512" for CPUs with and without bf16 units, and whether oneDNN uses them depends on the torch
  build), so it is measured: `bf16_slowdown_on_cpu`, a ~0.1 s probe, cached per machine in
  `$LEANTUNE_HOME/precision_probe.json` (or `~/.cache/leantune`), keyed by CPU model and flags,
  torch version and thread count.
- A resumed run keeps the precision it started with (recorded in its `leantune_run.json`), on
  whatever machine it resumes: the precision decides the trajectory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch

from leantune.core.digests import leantune_home
from leantune.core.writes import OutputError, write_file
from leantune.errors import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Resolved = Literal["fp32", "bf16", "fp16"]
RESOLVED: tuple[Resolved, ...] = ("fp32", "bf16", "fp16")
"""What `auto` resolves to."""
BF16_MIN_SPEEDUP = 1.25
"""auto picks bf16 on CPU only when bf16 matmul is at least this much faster than fp32: bf16 costs
precision and autocast casts, so an even race is not worth it. The CPUs measured are far from the
line either way (AVX2: ~50-100x slower; AVX512-BF16/AMX: 2-5x faster)."""
PROBE_FILE = "precision_probe.json"


@contextlib.contextmanager
def autocast(device_type: str, precision: str) -> Iterator[None]:
    """Autocast to bf16/fp16 for `precision` in ("bf16", "fp16"); a no-op for "fp32"."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision]):
        yield


def make_grad_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """A GradScaler on `device_type` for fp16 (fp16 gradients underflow without it); None
    otherwise.

    A run trains in fp16 on CUDA only (`resolve_precision` refuses it elsewhere); on CPU the
    scaler lets tests run the same fp16 step (`torch.amp.GradScaler("cpu")`).
    """
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type)


class DeviceUnavailable(ValueError, UserError):
    """train.device names a device this machine does not have."""


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU.

    Raises:
        DeviceUnavailable: train.device=cuda on a machine without a CUDA device.
    """
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            "train.device=cuda but torch finds no CUDA device on this machine (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); use "
            "train.device=auto to train on the CPU here"
        )
    return torch.device(requested)


def bf16_slowdown_on_cpu(size: int = 256, rounds: int = 5, repeats: int = 4) -> float:
    """How many times slower a bf16 matmul is than fp32 on this CPU (a ~0.1 s probe).

    CPUs without AVX512-BF16/AMX emulate bf16 matmul; on an AVX2-only machine it measured ~100x
    slower than fp32, which turns bf16 autocast from a speed-up into a stall.
    """
    fp32 = torch.randn(size, size)
    bf16 = fp32.to(torch.bfloat16)
    fp32 @ fp32, bf16 @ bf16  # warm-up: thread pool, oneDNN kernel selection

    def seconds(x: torch.Tensor) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            x @ x
        return time.perf_counter() - start

    t32: list[float] = []
    t16: list[float] = []
    # Interleaved rounds, the best of each side kept: another process taking the cores for a
    # moment slows one measurement, which the minimum then discards.
    for _ in range(rounds):
        t32.append(seconds(fp32))
        t16.append(seconds(bf16))
        if min(t16) > 10 * min(t32):  # emulated: plain after one round, not worth timing more
            break
    return min(t16) / max(min(t32), 1e-9)  # no division by 0 on a coarse timer


@dataclass(frozen=True)
class Bf16Speed:
    """The probe's result on this machine."""

    slowdown: float
    """bf16 matmul time / fp32 matmul time (below 1: bf16 is faster)."""
    measured: str
    """When it was measured (ISO date)."""
    cached_in: Path | None
    """The cache file it is kept in (None when that cannot be written)."""
    from_cache: bool
    """Read from the cache rather than measured now."""

    def describe(self) -> str:
        """'bf16 matmul 2.3x faster than fp32 on this CPU (measured ..., cached in ...)'."""
        if self.slowdown >= 1:
            speed = f"{self.slowdown:.1f}x slower than"
        else:
            speed = f"{1 / self.slowdown:.1f}x faster than"
        when = f"measured {self.measured}" if self.from_cache else "measured now"
        where = f", cached in {self.cached_in}" if self.cached_in is not None else ""
        return f"bf16 matmul {speed} fp32 on this CPU ({when}{where})"


ISA_CAPS = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
)
"""Settings that hold oneDNN's, torch's or MKL's kernels below what the CPU has
(ONEDNN_MAX_CPU_ISA=AVX2 makes bf16 emulated on any x86 CPU), so they are part of the key."""


def machine_key() -> str:
    """What the probe's result depends on: CPU model and flags, torch version, threads, and any
    kernel ISA cap that is set."""
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name":
                model = value.strip()
            elif name in ("flags", "Features"):
                flags = value.strip()
            if not line.strip():
                break  # the first processor describes them all
    # The flags line is hundreds of characters; a short digest keeps the cache's keys readable.
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    threads = torch.get_num_threads()
    key = f"{model} | flags {digest} | torch {torch.__version__} | {threads} threads"
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return " | ".join([key, *caps])


def bf16_speed_on_cpu(probe: Callable[[], float] | None = None) -> Bf16Speed:
    """`bf16_slowdown_on_cpu` for this machine, measured once and then read from the cache.

    A cache that cannot be read or written only costs the ~0.1 s probe; delete the file to
    measure again.
    """
    path = leantune_home() / PROBE_FILE
    key = machine_key()
    entries: dict[str, dict[str, object]] = {}
    # A missing or corrupt cache only costs the probe; it is rewritten below.
    with contextlib.suppress(OSError, ValueError):
        raw = json.loads(path.read_text(encoding="utf-8"))
        entries = raw if isinstance(raw, dict) else {}
    entry = entries.get(key)
    if isinstance(entry, dict):
        slowdown, measured = entry.get("bf16_slowdown"), entry.get("measured")
        # Checked field by field: the file is a user's to edit, and a bad entry means measure.
        if isinstance(slowdown, float) and slowdown > 0 and isinstance(measured, str):
            return Bf16Speed(slowdown, measured, path, from_cache=True)
    slowdown = (probe or bf16_slowdown_on_cpu)()
    measured = time.strftime("%Y-%m-%d")
    entries[key] = {"bf16_slowdown": float(slowdown), "measured": measured}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
    except (OSError, OutputError):  # a read-only home: the probe runs again next time
        return Bf16Speed(float(slowdown), measured, None, from_cache=False)
    return Bf16Speed(float(slowdown), measured, path, from_cache=False)


class PrecisionUnavailable(UserError):
    """The precision asked for, or the one a resumed run started with, cannot run on this
    machine."""


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run trains in, and the line that says why."""

    precision: Resolved
    """fp32, bf16 or fp16."""
    note: str | None = None
    """The log line: what auto chose and why, or a warning about an explicit choice."""


def resolve_precision(
    requested: str,
    device_type: str,
    recorded: str | None = None,
    compute_dtype: str = "auto",
) -> PrecisionChoice:
    """What `train.precision=requested` trains in on `device_type`.

    Args:
        requested: ``train.precision``: auto, fp32, bf16 or fp16.
        device_type: "cpu" or "cuda".
        recorded: The precision the run being resumed started with (its run record), if any:
            auto keeps it.
        compute_dtype: qlora's ``method.compute_dtype`` ("auto" for other methods); auto never
            picks a precision that validation refuses with it (bf16 autocast with fp16 matmuls).

    Raises:
        PrecisionUnavailable: fp16 asked for, or auto resuming an fp16 run, on a machine
            without CUDA.
    """
    choice = _resolve(requested, device_type, recorded, compute_dtype)
    # Measured here, when the run sets up, not while its config is validated.
    if (warning := _slow_compute_warning(compute_dtype, device_type)) is not None:
        note = f"{choice.note}\n{warning}" if choice.note else warning
        return PrecisionChoice(choice.precision, note)
    return choice


def _slow_compute_warning(compute_dtype: str, device_type: str) -> str | None:
    """qlora's 4-bit matmuls in bf16 on a CPU that emulates bf16 (fast with AVX512-BF16/AMX)."""
    if compute_dtype != "bf16" or device_type != "cpu":
        return None
    if (speed := bf16_speed_on_cpu()).slowdown <= 1:
        return None
    return (
        f"warning: method.compute_dtype=bf16: 4-bit matmuls in bf16 are emulated here "
        f"({speed.describe()}); method.compute_dtype=fp32 is faster"
    )


def _resolve(
    requested: str, device_type: str, recorded: str | None, compute_dtype: str
) -> PrecisionChoice:
    if requested != "auto":
        explicit = cast(Resolved, requested)
        if explicit == "fp16" and device_type != "cuda":
            # Validation refuses train.device=cpu; auto finds out only here. fp16 matmul is
            # emulated on most CPUs: one core of an AVX512-BF16 EPYC ran a 512^3 fp16 matmul
            # at 0.6 GFLOP/s, against 20 in fp32 and 44 in bf16 (measured under load).
            raise PrecisionUnavailable(
                "train.precision=fp16 needs CUDA (fp16 autocast with a GradScaler) and "
                "train.device=auto found no CUDA device on this machine; use "
                "train.precision=auto (bf16 or fp32, whichever this CPU runs faster)"
            )
        return PrecisionChoice(explicit, _slow_bf16_warning(explicit, device_type))
    # A resumed run keeps the precision it started with, whatever this machine would pick:
    # the precision decides the trajectory.
    if recorded in RESOLVED:
        recorded = cast(Resolved, recorded)
        if recorded == "fp16" and device_type != "cuda":
            raise PrecisionUnavailable(
                "train.precision=auto: the run being resumed started in fp16 (CUDA, with a "
                "GradScaler) and this machine trains on CPU. Resume it on a CUDA machine, or "
                "continue it here in another precision with run.resume=force "
                "train.precision=fp32 (or bf16)"
            )
        why = "the precision the resumed run started with (its leantune_run.json); kept"
        warning = _slow_bf16_warning(recorded, device_type)
        return PrecisionChoice(recorded, _auto_line(recorded, why, warning))
    if device_type == "cuda":
        return _auto_on_cuda(compute_dtype)
    if compute_dtype == "fp16":
        why = "method.compute_dtype=fp16 rules out bf16 autocast, and fp16 autocast needs CUDA"
        return PrecisionChoice("fp32", _auto_line("fp32", why))
    speed = bf16_speed_on_cpu()
    # Feature flags do not say whether oneDNN uses bf16 units (torch reports "AVX512" with and
    # without them, and it depends on the build), so the decision rests on the measurement.
    if speed.slowdown * BF16_MIN_SPEEDUP <= 1:
        return PrecisionChoice("bf16", _auto_line("bf16", speed.describe()))
    why = speed.describe()
    if speed.slowdown >= 1:
        why += "; no native bf16 units"
    else:
        why += f"; bf16 pays off from {BF16_MIN_SPEEDUP}x faster"
    return PrecisionChoice("fp32", _auto_line("fp32", why))


def _auto_on_cuda(compute_dtype: str) -> PrecisionChoice:
    name = torch.cuda.get_device_name()
    if compute_dtype == "fp16":
        why = f"method.compute_dtype=fp16 on {name} (bf16 autocast would mix the two)"
        return PrecisionChoice("fp16", _auto_line("fp16", why + "; with a GradScaler"))
    if torch.cuda.is_bf16_supported():
        return PrecisionChoice("bf16", _auto_line("bf16", f"{name} supports bf16"))
    why = f"{name} has no bf16 support; fp16 autocast with a GradScaler"
    return PrecisionChoice("fp16", _auto_line("fp16", why))


def _auto_line(precision: str, why: str, warning: str | None = None) -> str:
    line = f"train.precision=auto -> {precision}: {why}"
    return f"{line}\n{warning}" if warning else line


def _slow_bf16_warning(precision: str, device_type: str) -> str | None:
    """A warning when bf16 is asked for on a CPU that emulates it."""
    if precision != "bf16" or device_type != "cpu":
        return None
    speed = bf16_speed_on_cpu()
    # Only a clear stall is worth a warning for an explicit choice; auto's line is at 1.25x.
    if speed.slowdown <= 4:
        return None
    return (
        f"warning: train.precision=bf16: bf16 matmul is {speed.slowdown:.0f}x slower than fp32 "
        "on this CPU (no native bf16 units); train.precision=fp32 will be much faster here"
    )
