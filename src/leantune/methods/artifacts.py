"""Save what a run produced and load it back for `eval` and `generate`.

A full fine-tune saves an HF model directory. A peft method saves peft's on-disk adapter format
(loadable by `peft.PeftModel.from_pretrained`), bottleneck adapters their own documented layout
(see `methods.adapter`); both add `leantune_base.json`, which points at the base model so leantune
can rebuild it without a hub lookup, with the RoPE scaling and the load-time quantisation the
adapter was trained with, and records the sha256 of the base's weights and config
(``base_files``, `digests.base_model_files`). Loading the adapter (`eval`, `generate`, `export`)
refuses a base whose files differ (`BaseModelChanged`); an adapter saved before they were
recorded loads with a warning that its base is unchecked.

QLoRA: the saved base stays the unquantised original. Reloading re-quantises it with the recorded
settings; NF4 quantisation is deterministic, so this rebuilds exactly the 4-bit weights the adapter
was trained on (logits equal the trained model's; tests/unit/methods/test_qlora.py). Loading the
adapter on the full-precision base instead would evaluate a different model (W + BA rather than
NF4(W) + BA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import RopeScalingConfig
from leantune.core.digests import base_model_files, local_model_dir
from leantune.core.writes import replacing_dir
from leantune.errors import UserError
from leantune.layout import ModelPaths
from leantune.methods.adapter import adapter_settings, load_adapter, save_adapter
from leantune.methods.lora import quiet_peft
from leantune.methods.prompt import with_virtual_tokens
from leantune.models.attention import AttnImplementation
from leantune.models.loading import (
    ModelSource,
    load_model,
    load_tokenizer,
    loading,
    resolve_model,
)
from leantune.models.paths import (
    ModelPathError,
    hub_offline_unless_allowed,
    is_adapter_dir,
    is_bottleneck_adapter_dir,
    model_of_run,
    refuse_pickled_weights,
)
from leantune.models.paths import check_model_path as check_model_path  # where export finds it
from leantune.models.quantize import Quantization

BASE_FILES_KEY = "base_files"
"""The pointer's ``file name -> sha256`` of the base model's weights and config."""
ATTN_FLAG = "--attn-implementation"
"""How refusals of `load_for_inference`'s attention name it (eval, generate, export)."""


@contextlib.contextmanager
def _offline_save() -> Iterator[None]:
    """peft's save of an adapter on a hub-id base asks the hub whether the base's config.json
    exists (to tell a resized vocabulary, which leantune never makes): offline, it warns twice
    that it cannot, which says nothing to the user."""
    with hub_offline_unless_allowed(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unable to fetch remote file")
        warnings.filterwarnings("ignore", message="Could not find a config file in")
        yield


def save_final(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    base_path: str,
    *,
    base_gguf_file: str | None = None,
    rope_scaling: RopeScalingConfig | None = None,
    quantization: Quantization | None = None,
) -> Path:
    """Write the trained model atomically: into a temporary sibling, then swapped in whole
    (`leantune.core.writes.replacing_dir`; a disk that refuses a write leaves the earlier one).

    `base_path` is the model path as the user gave it (a demo name stays a name, so the pointer
    survives a move of the leantune cache); local paths should be absolute. An adapter's pointer
    also records `rope_scaling` and `quantization`, so the base is rebuilt as it was trained.
    """
    bottleneck = adapter_settings(model) is not None
    # Built in a temporary folder and swapped in whole: a full disk leaves the earlier final/.
    with replacing_dir(out_dir) as tmp:
        if bottleneck:
            save_adapter(model, tmp)
        else:
            with _offline_save():
                model.save_pretrained(tmp)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)
        if isinstance(model, PeftModel) or bottleneck:
            pointer: dict[str, object] = {"base_model": base_path, "gguf_file": base_gguf_file}
            if rope_scaling is not None:
                pointer["rope_scaling"] = dataclasses.asdict(rope_scaling)
            if quantization is not None:
                pointer["quantization"] = quantization.to_json()
            # The base's digests: loading refuses a base whose files have changed, as the
            # adapter on another base is not the model that was trained.
            recorded = _base_digests(base_path, base_gguf_file)
            if recorded is not None:
                pointer[BASE_FILES_KEY] = recorded
            ModelPaths(tmp).base_pointer.write_text(json.dumps(pointer, indent=2) + "\n")
    return out_dir


class BaseModelChanged(ModelPathError):
    """An adapter's base model is not the one it was trained on: its files have changed."""


def _base_digests(base_path: str, gguf_file: str | None) -> dict[str, str] | None:
    """`base_model_files` of the base as it is now (None where it has no local files)."""
    try:
        model_dir = local_model_dir(resolve_model(base_path, gguf_file).location)
        if model_dir is None:
            return None
        return base_model_files(model_dir, gguf_file if model_dir.is_dir() else None)
    except (UserError, OSError):  # not resolvable here: the adapter loads where it is
        return None


def check_base(adapter_dir: Path, base: ModelSource, info: dict) -> None:
    """Refuse `base` unless its weights and config are those the adapter at `adapter_dir` was
    trained on (`info`: its pointer file); print a one-line warning when it recorded none.

    Raises:
        BaseModelChanged: naming the pointer file, the base, each changed file with both
            digests, and the fixes.
    """
    pointer = ModelPaths(adapter_dir).base_pointer
    recorded = info.get(BASE_FILES_KEY)
    if not isinstance(recorded, dict):
        where = pointer if pointer.is_file() else adapter_dir
        print(
            f"warning: {where} records no digest of the adapter's base model (saved by an "
            f"older leantune, or not by leantune): {base.location} is used as it is now, "
            "unchecked",
            file=sys.stderr,
        )
        return
    now = _base_digests(base.location, base.gguf_file)
    if now is None or now == recorded:
        return
    changes = [
        f"{name} (sha256 {_short(recorded.get(name))} -> {_short(now.get(name))})"
        for name in sorted(set(recorded) | set(now))
        if recorded.get(name) != now.get(name)
    ]
    raise BaseModelChanged(
        f"{pointer}: the adapter was trained on the base model {base.location}, whose files "
        f"have changed since: {', '.join(changes)}. The adapter on this base is not the model "
        f"that was trained. Put back the base it was trained on, or point base_model in "
        f"{pointer} at a copy of it; to use this base, train the adapter again on it."
    )


def _short(digest: object) -> str:
    return digest[:12] if isinstance(digest, str) else "none: no such file"


def _base_of(adapter_dir: Path) -> tuple[ModelSource, dict]:
    """The adapter's base model and its pointer file's contents (empty without one)."""
    pointer = ModelPaths(adapter_dir).base_pointer
    if pointer.is_file():
        info = json.loads(pointer.read_text())
        base = info.get("base_model") if isinstance(info, dict) else None
        if not isinstance(base, str):
            raise ModelPathError(f"{pointer}: no 'base_model' naming the adapter's base model")
        return resolve_model(base, info.get("gguf_file")), info
    if not is_adapter_dir(adapter_dir):
        raise FileNotFoundError(
            f"{adapter_dir}: no {ModelPaths.base_pointer} naming the base model"
        )
    cfg = json.loads(ModelPaths(adapter_dir).adapter_config.read_text())
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str):
        raise ModelPathError(f"{adapter_dir}: {ModelPaths.adapter_config} names no base model")
    return resolve_model(base), {}


def _adapter_tokenizer(adapter_dir: Path, base: ModelSource) -> ModelSource:
    """An adapter saved with its tokenizer uses that one, else its base model's."""
    own = ModelPaths(adapter_dir).tokenizer_config.is_file()
    return ModelSource(str(adapter_dir)) if own else base


def config_and_tokenizer_sources(path: str) -> tuple[ModelSource, ModelSource]:
    """Where `load_for_inference(path)` reads the model's config and weights (an adapter's
    base) and its tokenizer (an adapter's own when saved with one), without reading them."""
    path = model_of_run(path)
    p = Path(path).expanduser()
    if p.is_dir() and (is_adapter_dir(p) or is_bottleneck_adapter_dir(p)):
        base, _ = _base_of(p)
        return base, _adapter_tokenizer(p, base)
    source = resolve_model(path)
    return source, source


def model_config_and_tokenizer(
    path: str, trust_remote_code: bool = False
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The config (an adapter's base model's) and tokenizer `load_for_inference(path)` would
    use, read without loading any weights, so that a command can refuse a model before the slow
    part.

    Raises:
        ModelPathError: `path` is not a model or its config or tokenizer cannot be read.
    """
    with loading(path):
        source, tok_source = config_and_tokenizer_sources(path)
        config = AutoConfig.from_pretrained(
            source.location, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
        )
        return config, load_tokenizer(tok_source, trust_remote_code)


def load_for_inference(
    path: str,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
    attn_implementation: AttnImplementation = "auto",
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """Load a model directory, GGUF file, hub id, demo name, adapter directory (with its base),
    or a run directory's `final/` model, for `eval`, `generate` and `export`.

    `attn_implementation` is their --attn-implementation: auto loads the masked attention the
    model supports (sdpa, or eager where transformers has none, e.g. Gemma 2).

    Raises:
        ModelPathError: `path` is not a model or cannot be loaded (unreadable config or weights,
            a truncated GGUF, a hub id not in the cache when offline, an adapter whose base
            model cannot be found).
        UnsupportedAttention: an explicit `attn_implementation` the model cannot use.
    """
    with loading(path):  # also the adapter's pointer file and peft's loading of the adapter
        return _load_for_inference(path, dtype, trust_remote_code, attn_implementation)


def _load_for_inference(
    path: str, dtype: str, trust_remote_code: bool, attn_implementation: AttnImplementation
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    path = model_of_run(path)
    p = Path(path).expanduser()
    if p.is_dir() and (is_adapter_dir(p) or is_bottleneck_adapter_dir(p)):
        base, info = _base_of(p)
        check_base(p, base, info)
        # The tokenizer first: it loads in a moment, and a missing one is the user's to fix.
        tokenizer = load_tokenizer(_adapter_tokenizer(p, base), trust_remote_code)
        rope = RopeScalingConfig(**info["rope_scaling"]) if info.get("rope_scaling") else None
        # A QLoRA adapter's base is re-quantised with the recorded settings: NF4 is
        # deterministic, so this rebuilds exactly the 4-bit weights it was trained on (the
        # full-precision base would be W + BA, not NF4(W) + BA: another model).
        quant = Quantization.from_json(info["quantization"]) if info.get("quantization") else None
        device = "cuda" if quant is not None and torch.cuda.is_available() else "cpu"
        model = load_model(
            base,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            rope_scaling=rope,
            quantization=quant,
            device=device,
            attn_implementation=attn_implementation,
            attn_field=ATTN_FLAG,
        )
        adapted: PreTrainedModel | PeftModel
        if is_bottleneck_adapter_dir(p):
            adapted = load_adapter(model, p)  # type: ignore[assignment]
        else:
            refuse_pickled_weights(p)  # peft would load adapter_model.bin
            with quiet_peft():
                adapted = with_virtual_tokens(PeftModel.from_pretrained(model, p))
        adapted.eval()  # dropout off: eval and generate must be deterministic
        return adapted, tokenizer
    source = resolve_model(path)
    tokenizer = load_tokenizer(source, trust_remote_code)
    model = load_model(
        source,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        attn_field=ATTN_FLAG,
    )
    model.eval()
    return model, tokenizer
