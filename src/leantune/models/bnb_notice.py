"""bitsandbytes' import-time notice about its optional CPU 4-bit kernel, held back and explained.

On CPUs with AVX512-BF16, importing bitsandbytes (0.50; peft and transformers import it whenever
it is installed) tries to load an optional 4-bit inference kernel from the `kernels` package and,
when that is not installed, logs "Failed to load CPU gemm_4bit_forward from kernels-community".
Every command printed it, fp32 LoRA included. The kernel only serves 4-bit layers in
bitsandbytes' repacked eval layout, which leantune turns off (`quantize.keep_training_layout`), so
it is never used: the notice is held back, and explained once when a 4-bit model is loaded.

With the `kernels` package installed (transformers 5.25 requires it), that import-time lookup
asks the Hugging Face Hub for the kernel (a publisher check, then a download): a network call
from every process that imports bitsandbytes, for a kernel leantune never runs. leantune reaches
the Hub only when the user sets HF_HUB_OFFLINE=0 (`paths.downloads_allowed`), so bitsandbytes is
imported with huggingface_hub offline (`import_offline`): the lookup fails at once, from the
local cache, and its notice is held back like the others.

No torch import here: the CLI installs the filter before any command imports a library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, TextIO

from leantune.models.bnb_import import PACKAGE

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
"""The logger bitsandbytes' CPU backend logs the notice on."""
NOTICE_START = "Failed to load CPU gemm_4bit_forward from kernels-community"
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
"""Where `kernels` says it skips its publisher check because the Hub is offline: leantune's
default (`import_offline`), so the user has nothing to act on."""
OFFLINE_TRUST_START = "Skipping publisher trust check for "


class _HeldNotice(logging.Filter):
    """Drops bitsandbytes' kernel notice from its logger and keeps its text."""

    def __init__(self) -> None:
        super().__init__()
        self.held: str | None = None
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(NOTICE_START):
            # Kept, not just dropped: its reason is quoted if a 4-bit model loads later.
            self.held = message
            return False
        return True


_NOTICE = _HeldNotice()


class _OfflineTrustCheck(logging.Filter):
    """Drops `kernels`' note that it skips its publisher check offline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(OFFLINE_TRUST_START)


def hold_back_kernel_notice() -> None:
    """Keep bitsandbytes' kernel notice, and `kernels`' note that it skips its publisher check
    offline, off the terminal (call before bitsandbytes is imported; calling it again changes
    nothing)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if _NOTICE not in logger.filters:
        logger.addFilter(_NOTICE)
    kernels = logging.getLogger(KERNELS_HUB_LOGGER)
    if not any(isinstance(f, _OfflineTrustCheck) for f in kernels.filters):
        kernels.addFilter(_OfflineTrustCheck())


class _OfflineLoader(importlib.abc.Loader):
    """Runs a package's loader with huggingface_hub offline unless downloads are allowed;
    everything else is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # paths imports the Hub client: loaded with the held package, not at the CLI's start.
        from leantune.models.paths import hub_offline_unless_allowed

        with hub_offline_unless_allowed():  # the package's own imports run inside it too
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resource readers, is_package, get_code, ...
        return getattr(self._loader, name)


class _OfflineImport(importlib.abc.MetaPathFinder):
    """Finds one top-level package as the path finder does, and loads it offline."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        # The top-level package only: its submodules are imported while it executes, inside
        # the offline block of `_OfflineLoader.exec_module`.
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _OfflineLoader(spec.loader)
        return spec


def import_offline(name: str = PACKAGE) -> None:
    """Import the top-level package `name` (default bitsandbytes) with huggingface_hub offline
    unless the user allows downloads with HF_HUB_OFFLINE=0. Call before it is imported; calling
    it again changes nothing. A package held out of the process (`bnb_import.hold_back`) stays
    out: Python refuses it before any finder is asked."""
    if not any(isinstance(f, _OfflineImport) and f.name == name for f in sys.meta_path):
        # First: the standard path finder would otherwise find the package and load it online.
        sys.meta_path.insert(0, _OfflineImport(name))


def explain_kernel_notice(stream: TextIO | None = None) -> str | None:
    """Say once per process, when 4-bit layers are in use, what the held-back notice meant.

    Returns the explanation printed (to `stream`, default stderr), or None: no notice was
    held back, or it was explained already.
    """
    if _NOTICE.held is None or _NOTICE.explained:
        return None
    _NOTICE.explained = True
    # The reason's first sentence: what follows is advice for bitsandbytes' kernel (install
    # kernels, download it while online) that a leantune run does not need.
    reason = _NOTICE.held.removeprefix(NOTICE_START).lstrip(": ").split(". ", 1)[0].rstrip(".")
    text = (
        "note: bitsandbytes could not load its optional AVX512-BF16 kernel for 4-bit inference "
        f"(kernels-community/quantization-bitsandbytes: {reason}). bitsandbytes runs the 4-bit "
        "layers on its own kernel, the one training uses; results are the same and there is "
        "nothing to do."
    )
    print(text, file=stream if stream is not None else sys.stderr, flush=True)
    return text
