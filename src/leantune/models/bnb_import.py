"""bitsandbytes kept out of a training process that does not use it.

peft imports bitsandbytes whenever it is installed (`peft.helpers`: `import bitsandbytes`), and
bitsandbytes 0.50 wraps its CPU kernels in `torch.compile` at import, which imports TorchDynamo
and Inductor: about 2.5 s of every `leantune train` start on a 2-core machine (a tiny run: 10.0
s, 7.5 s without it), for LoRA, full fine-tuning and every other method that never touches a
4-bit or 8-bit kernel. `hold_back` marks the package as absent for the rest of the process
(`sys.modules["bitsandbytes"] = None`, which Python documents as "the import raises
ModuleNotFoundError", and `importlib.util.find_spec` then answers None), so peft and
transformers see what they see on an install without the `lowbit` extra: the state the base
install and `make demo` always run in.

Only a run that cannot need it is held back: not QLoRA, no optimizer with a bitsandbytes
backend, and a base model known to be unquantised (its config.json has no
`quantization_config`, or it is the demo model or a GGUF file). Anything unknown (an adapter
directory, an unreadable config) keeps the import.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from leantune.layout import ModelPaths

PACKAGE = "bitsandbytes"


def _config_json(model_path: str) -> Path | None:
    """The config.json a model path loads, when it can be found without loading anything."""
    # The CLI calls this module before torch or the Hub load; these helpers import them.
    from leantune.models.paths import hub_snapshot, looks_like_hub_id, model_of_run

    local = ModelPaths(Path(model_of_run(model_path)).expanduser()).config
    try:
        if local.is_file():
            return local
    except OSError:
        return None
    if looks_like_hub_id(model_path):
        snapshot = hub_snapshot(model_path)
        return ModelPaths(snapshot).config if snapshot is not None else None
    return None


def model_is_unquantised(model_path: str) -> bool:
    """True when the model at `model_path` is known to load without bitsandbytes: the demo
    model, a GGUF file (the gguf package dequantises it), or a config.json without a
    `quantization_config`. False when it is quantised or cannot be told."""
    from leantune.models.demo_model import DEMO_MODEL_NAMES  # as above: before torch loads

    # The demo is converted to plain safetensors; a GGUF file is dequantised by the gguf package.
    if model_path in DEMO_MODEL_NAMES or model_path.lower().endswith(".gguf"):
        return True
    found = _config_json(model_path)
    if found is None:  # unknown (an adapter, a hub id not cached): keep the import, to be safe
        return False
    try:
        config = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "quantization_config" not in config


def needed(quantized_base: bool, optimizer: str, model_path: str) -> bool:
    """Whether a training run may import bitsandbytes: a 4-bit base (`quantized_base`), an
    optimizer name with a bitsandbytes backend on any device, or a model not known to be
    unquantised."""
    from leantune.core.optim import OPTIMIZER_BACKENDS  # as above: before torch loads

    backends = OPTIMIZER_BACKENDS.get(optimizer, {})
    libraries = {b.library for per_device in backends.values() for b in per_device}
    return quantized_base or PACKAGE in libraries or not model_is_unquantised(model_path)


def hold_back(needed: bool) -> bool:
    """Keep bitsandbytes out of this process unless `needed`; True when it was held back.

    Nothing changes when it is needed, not installed, or already imported (then it is in use).
    Call before peft or transformers is imported.
    """
    # Already imported: something uses it, and a None entry now would break that user.
    if needed or PACKAGE in sys.modules or importlib.util.find_spec(PACKAGE) is None:
        return False
    # None in sys.modules makes `import bitsandbytes` raise ModuleNotFoundError and find_spec
    # answer None (Python documents both), so peft and transformers take their no-bitsandbytes
    # path, the one the base install always runs (its import costs ~2.5 s of every start).
    sys.modules[PACKAGE] = None  # type: ignore[assignment]
    return True
