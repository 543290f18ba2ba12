"""What the model libraries print that a user cannot act on, held back by the entry points.

The command line (`leantune.cli.app`) and the Python API (`leantune.api`) call both functions
before they import or load a model, so a command and its API call print the same lines. The
library itself never calls them: a program that imports leantune's modules keeps its own
logging as it set it.
"""

from __future__ import annotations

import logging
import os

from leantune.models.bnb_notice import hold_back_kernel_notice, import_offline


class _CpuAcceleratorNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" warning (CPU is what leantune runs on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def quiet_import_noise() -> None:
    """Hold back the import-time warnings of the libraries peft and transformers import.

    peft imports torchao when it is installed; on a CPU build torchao logs a warning per
    CUDA-only extension it cannot load, and torch one per pytree registration. peft and
    transformers import bitsandbytes, whose CPU backend logs a notice about an optional kernel
    on AVX512-BF16 CPUs: held back, and explained only when a 4-bit model loads
    (`models.bnb_notice`), and imported with the Hugging Face Hub offline unless
    HF_HUB_OFFLINE=0. Call before anything imports peft.
    """
    # ERROR, not disabled: a real failure in those libraries still shows.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hold_back_kernel_notice()
    import_offline()
    # With DeepSpeed installed (dist.strategy=deepspeed), transformers imports it inside every
    # save_pretrained, and on a machine without CUDA its accelerator detection prints a warning
    # (on stdout) that it picked the CPU. Its logger keeps this filter when DeepSpeed sets it up.
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _CpuAcceleratorNotice) for f in deepspeed.filters):
        deepspeed.addFilter(_CpuAcceleratorNotice())


def quiet_libraries() -> None:
    """No progress bars or info logs from transformers and tokenizers' threads (the commands
    that load models print their own lines)."""
    # setdefault: a user's own setting stays. Unset, tokenizers warns at a fork after its
    # threads have run (and disables them then).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers takes seconds to import: only the commands that load a model pay for it.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
