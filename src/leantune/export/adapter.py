"""`adapter`: the PEFT adapter directory alone (with `leantune_base.json` naming its base)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from leantune.export.parity import LogitsFn
from leantune.export.source import ExportError, model_logits_fn
from leantune.methods.artifacts import load_for_inference


def write_adapter(adapter_dir: Path | None, out: Path) -> dict[str, Any]:
    """Copy the adapter directory's files into `out`.

    Raises:
        ExportError: the source is not an adapter (a full fine-tune has none).
    """
    if adapter_dir is None:
        raise ExportError(
            "--format adapter: the source is a full model, not a PEFT adapter "
            "(a full fine-tune has no adapter); use --format hf"
        )
    for f in sorted(adapter_dir.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return {"files": sorted(p.name for p in out.iterdir())}


def load_adapter(out: Path) -> LogitsFn:
    """Rebuild base + adapter from the exported directory, as `eval`/`generate` would."""
    model, _ = load_for_inference(str(out), "fp32")  # the parity reference is float32 too
    return model_logits_fn(model)
