"""leantune: fine-tune text-generation LLMs efficiently on the hardware you have.

The Python API (see `leantune.api`), imported on first use so that `import leantune` stays light:
`Config`, `load_config`, `train`, `evaluate`, `export_model`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from leantune.api import evaluate, export_model, train
    from leantune.config import Config
    from leantune.training.checks import load_config

_LAZY = {
    "Config": "leantune.config",
    "load_config": "leantune.training.checks",
    "train": "leantune.api",
    "evaluate": "leantune.api",
    "export_model": "leantune.api",
}
__all__ = ["Config", "__version__", "evaluate", "export_model", "load_config", "train"]


# PEP 562: Python calls this only for a name not found in the module's globals, so `import
# leantune` loads none of the API's dependencies until one of these names is used.
def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'leantune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:  # the lazy names too, for completion and help()
    return sorted({*globals(), *_LAZY})
