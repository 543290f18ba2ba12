"""bitsandbytes' import-time notice about its optional CPU 4-bit kernel, held back and explained.

On CPUs with AVX512-BF16, importing bitsandbytes (0.50; peft and transformers import it whenever
it is installed) tries to load an optional 4-bit inference kernel from the `kernels` package and,
when that is not installed, logs "Failed to load CPU gemm_4bit_forward from kernels-community".
Every command printed it, fp32 LoRA included. The kernel only serves 4-bit layers in
bitsandbytes' repacked eval layout, which leantune turns off (`quantize.keep_training_layout`), so
it is never used: the notice is held back, and explained once when a 4-bit model is loaded.

No torch import here: the CLI installs the filter before any command imports a library.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
"""The logger bitsandbytes' CPU backend logs the notice on."""
NOTICE_START = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _HeldNotice(logging.Filter):
    """Drops bitsandbytes' kernel notice from its logger and keeps its text."""

    def __init__(self) -> None:
        super().__init__()
        self.held: str | None = None
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(NOTICE_START):
            self.held = message
            return False
        return True


_NOTICE = _HeldNotice()


def hold_back_kernel_notice() -> None:
    """Keep bitsandbytes' kernel notice off the terminal (call before bitsandbytes is imported;
    calling it again changes nothing)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if _NOTICE not in logger.filters:
        logger.addFilter(_NOTICE)


def explain_kernel_notice(stream: TextIO | None = None) -> str | None:
    """Say once per process, when 4-bit layers are in use, what the held-back notice meant.

    Returns the explanation printed (to `stream`, default stderr), or None: no notice was
    held back, or it was explained already.
    """
    if _NOTICE.held is None or _NOTICE.explained:
        return None
    _NOTICE.explained = True
    reason = _NOTICE.held.removeprefix(NOTICE_START).lstrip(": ").split(". Please", 1)[0]
    text = (
        "note: bitsandbytes could not load its optional AVX512-BF16 kernel for 4-bit inference "
        f"(kernels-community/quantization-bitsandbytes: {reason}). bitsandbytes runs the 4-bit "
        "layers on its own kernel, the one training uses; results are the same and there is "
        "nothing to do."
    )
    print(text, file=stream if stream is not None else sys.stderr, flush=True)
    return text
