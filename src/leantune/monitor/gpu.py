"""GPU utilisation and memory through NVML (`nvidia-ml-py`, imported as `pynvml`), if present.

torch's allocator counters say what this process's tensors hold; NVML says what the device
does: how busy its kernels keep it and how much memory every process on it uses (the CUDA
context and other processes included). Any failure here means "no GPU figures", never an error.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


class GpuProbe:
    """Reads one CUDA device's utilisation and memory through NVML."""

    def __init__(self, nvml: Any, handle: Any):
        self.nvml = nvml
        self.handle = handle

    def read(self) -> dict[str, float | int]:
        """`gpu_utilization` (0-1, the share of the last sample period a kernel ran) and
        `gpu_memory_used_bytes` (the whole device's, all processes); {} when NVML fails."""
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except Exception:  # a driver hiccup must not stop training
            return {}
        # NVML gives a percentage; the metrics hold ratios in 0-1 (as mfu).
        return {"gpu_utilization": util.gpu / 100, "gpu_memory_used_bytes": int(memory.used)}


def open_gpu_probe(device: torch.device) -> GpuProbe | None:
    """An NVML probe for `device`, or None off CUDA, without pynvml or when NVML fails."""
    if device.type != "cuda":
        return None
    # Nothing here is needed to train: no library, no driver or no device means no figures.
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # ImportError, or NVML's own error when the driver is missing
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        # By UUID: CUDA_VISIBLE_DEVICES renumbers devices for torch but not for NVML, so the
        # index is only a fallback for a torch that cannot give the UUID.
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            # NVML wants the "GPU-" prefix, which torch's UUID text may lack.
            handle = nvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith("GPU-") else f"GPU-{text}"
            )
        else:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None
    return GpuProbe(nvml, handle)
