"""Capture and restore every random generator a training step draws from, for exact resume.

The captured state is plain lists, numbers and CPU ``ByteTensor``s, so a checkpoint can store it
and ``torch.load(weights_only=True)`` can read it back.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels in practice
    np = None  # type: ignore[assignment]


def capture_rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy (if importable), torch CPU and all CUDA generators.

    Returns:
        A dict of plain lists, numbers and CPU ``ByteTensor``s that ``torch.load`` can read back
        with ``weights_only=True``.
    """
    version, internal, gauss_next = random.getstate()
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        # The legacy tuple holds an ndarray, which weights-only unpickling refuses.
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        # Every visible device's: each CUDA device has a generator of its own.
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generators captured by :func:`capture_rng_state`.

    Args:
        state: The dict from :func:`capture_rng_state` (possibly after a save/load round trip).

    Warns:
        When the state holds NumPy or CUDA generators that this process cannot restore, or a
        different number of CUDA devices.
    """
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "torch" in state:
        # .cpu(): a checkpoint loaded with map_location to a GPU moves this tensor there too,
        # and set_rng_state takes only a CPU ByteTensor.
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        if np is None:
            warnings.warn(
                "the checkpoint holds a NumPy RNG state but numpy is not installed; "
                "install numpy to resume its random stream exactly",
                stacklevel=2,
            )
        else:
            npy = state["numpy"]
            np.random.set_state(
                (
                    npy["bit_generator"],
                    np.asarray(npy["keys"], dtype=np.uint32),  # MT19937's key words
                    npy["pos"],
                    npy["has_gauss"],
                    npy["cached_gaussian"],
                )
            )
    if "cuda" in state:
        _restore_cuda_rng(state["cuda"])


def _restore_cuda_rng(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        warnings.warn(
            "the checkpoint holds CUDA RNG states but CUDA is not available; "
            "CUDA random streams will not continue where they stopped",
            stacklevel=3,
        )
        return
    count = torch.cuda.device_count()
    if count != len(states):
        warnings.warn(
            f"the checkpoint holds RNG states for {len(states)} CUDA devices but "
            f"{count} are visible; restoring the first {min(count, len(states))}",
            stacklevel=3,
        )
    for index, rng_state in enumerate(states[:count]):
        torch.cuda.set_rng_state(rng_state.cpu(), device=index)
