"""Load a causal LM and its tokenizer from a local directory, a hub id, or a GGUF file.

The demo model name `smollm2-135m-instruct` resolves through `leantune.models.demo_model`. Hub
ids are read from the local HF cache only, unless the user sets HF_HUB_OFFLINE=0 explicitly
(`downloads_allowed`): nothing waits on the network by default.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import RopeScalingConfig
from leantune.errors import UserError
from leantune.layout import ModelPaths
from leantune.models.attention import (
    FIELD,
    AttnImplementation,
    check_supported,
    resolve_attention,
    transformers_name,
)
from leantune.models.demo_model import DEMO_MODEL_NAMES, ensure_demo_model
from leantune.models.output_head import decide_output_head
from leantune.models.paths import (
    ModelPathError,
    downloads_allowed,
    file_given_message,
    hub_id_problem,
    hub_offline_unless_allowed,
    hub_snapshot,
    looks_like_hub_id,
    missing_path_message,
    refuse_pickled_weights,
)
from leantune.models.quantize import Quantization, bnb_config, keep_training_layout
from leantune.models.rope import apply_rope_scaling
from leantune.models.weight_files import checkpoint_shards, pread_state_dict

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a directory or hub id, plus a GGUF file name inside it if any."""

    location: str
    gguf_file: str | None = None


class ModelNotFoundError(FileNotFoundError, UserError):
    """Raised when a model path is neither a directory, a GGUF file nor a cached hub id."""


# What the loaders raise for files that are missing, unreadable or not what they claim (a broken
# config.json is an OSError, an empty directory a ValueError, a truncated GGUF a struct.error, a
# config.json nested thousands deep a RecursionError from json).
LOAD_ERRORS = (OSError, ValueError, struct.error, SafetensorError, RecursionError)


@contextmanager
def loading(location: str) -> Iterator[None]:
    """Turn a loader's failure on `location` into a ModelPathError naming it; the hub stays
    offline inside unless the user opted in (`downloads_allowed`)."""
    try:
        with hub_offline_unless_allowed():
            yield
    except UserError:  # already names the path and the fix; wrapping would bury that
        raise
    except LOAD_ERRORS as e:
        damaged = " (truncated, or not a GGUF file?)" if location.lower().endswith(".gguf") else ""
        raise ModelPathError(f"{location}: cannot be loaded as a model{damaged}: {e}") from e


def resolve_model(path: str, gguf_file: str | None = None) -> ModelSource:
    """Turn a user-facing model path into a loadable source.

    Args:
        path: a local directory, a `.gguf` file, a hub id (`org/name`) in the local HF cache
            (or any hub id with `downloads_allowed()`), or the demo name `smollm2-135m-instruct`.
        gguf_file: a GGUF file name inside `path`, when `path` is a directory.

    Returns:
        The resolved source.

    Raises:
        ModelNotFoundError: the path does not exist locally, and is not a hub id in the cache.
    """
    # Checked in this order: a local folder named like a hub id (`org/name`) is the folder,
    # and the demo name wins over a folder of that name in the working directory.
    if path.lower() in DEMO_MODEL_NAMES:
        return ModelSource(str(ensure_demo_model()))
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name)
    if p.is_dir():
        return ModelSource(str(p), gguf_file)
    where = f"model.path={path}"
    if p.is_file():  # a file of a model directory (its weights, its config.json), not the model
        raise ModelNotFoundError(file_given_message(p, where))
    if not looks_like_hub_id(path):
        raise ModelNotFoundError(missing_path_message(path, where))
    problem = hub_id_problem(path, where, gguf_file or ModelPaths.config)
    if problem is not None:
        raise ModelNotFoundError(problem)
    return ModelSource(path, gguf_file)


# Files that hold a tokenizer's vocabulary; a directory with none of them has no tokenizer
# (transformers then builds an empty one for some models, or fails about sentencepiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
    "tekken.json",
)


def _local_dir(source: ModelSource) -> Path | None:
    """The directory the tokenizer is read from, when it is on this machine."""
    p = Path(source.location)
    if p.is_dir():
        return p
    if not downloads_allowed() and looks_like_hub_id(source.location):
        return hub_snapshot(source.location)
    # Downloads allowed: the snapshot may not exist yet, and from_pretrained fetches it.
    return None


def check_tokenizer_files(source: ModelSource, trust_remote_code: bool = False) -> None:
    """Refuse a model directory without tokenizer files, naming it and what is missing.

    Raises:
        ModelPathError: no tokenizer file in the directory.
    """
    folder = None if source.gguf_file else _local_dir(source)  # a GGUF file holds its own
    if folder is None:
        return
    if any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    files = ModelPaths(folder)
    if trust_remote_code and files.tokenizer_config.is_file():
        return  # a tokenizer of its own code may keep its vocabulary under any name
    if not files.config.is_file() and not files.tokenizer_config.is_file():
        raise ModelPathError(
            f"{_name(source)}: not a model directory (no config.json, no tokenizer files such "
            "as tokenizer.json); give a Hugging Face model directory"
        )
    raise ModelPathError(
        f"{_name(source)}: no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ... is "
        "there). Copy the tokenizer files of the model it came from into it (tokenizer.json "
        "and tokenizer_config.json, or what that model has), or give that model instead"
    )


@contextmanager
def _tokenizer_loading(source: ModelSource) -> Iterator[None]:
    """`loading`, with a tokenizer that needs a missing package said in one line (transformers
    says it in six, about converting a slow tokenizer)."""
    name = _name(source)
    try:
        with loading(name):
            yield
    except ModelPathError as e:
        cause = e.__cause__
        needs = isinstance(cause, (ValueError, ImportError)) and any(
            package in str(cause) for package in ("sentencepiece", "tiktoken")
        )
        if not needs:
            raise
        raise ModelPathError(
            f"{name}: its tokenizer needs the sentencepiece or tiktoken package to load "
            "(pip install sentencepiece tiktoken), or a tokenizer.json beside it"
        ) from cause


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer and make sure it has a pad token (falls back to eos).

    Raises:
        ModelPathError: the source holds no loadable tokenizer (no tokenizer files, or a
            tokenizer that needs a package that is not installed).
    """
    check_tokenizer_files(source, trust_remote_code)
    with _tokenizer_loading(source):
        tok = AutoTokenizer.from_pretrained(
            source.location,
            gguf_file=source.gguf_file,
            trust_remote_code=trust_remote_code,
            local_files_only=not downloads_allowed(),
        )
    # Batching pads rows, and many causal LMs ship no pad token: eos is the usual stand-in.
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(source: ModelSource, trust_remote_code: bool = False) -> PreTrainedConfig:
    """The model's transformers config (no weights read).

    Raises:
        ModelPathError: the source holds no loadable config.
    """
    with loading(_name(source)):
        return _model_config(source, trust_remote_code)


def _model_config(source: ModelSource, trust_remote_code: bool) -> PreTrainedConfig:
    config: PreTrainedConfig = AutoConfig.from_pretrained(
        source.location,
        gguf_file=source.gguf_file,
        trust_remote_code=trust_remote_code,
        local_files_only=not downloads_allowed(),
    )
    return config


def load_model(
    source: ModelSource,
    *,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
    attn_implementation: AttnImplementation = "auto",
    attn_field: str = FIELD,
    rope_scaling: RopeScalingConfig | None = None,
    quantization: Quantization | None = None,
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """Load a causal LM with its frozen weights in `dtype` ("fp32", "bf16" or "fp16"), its
    output transform checked against its own forward (`models.output_head`).

    Args:
        source: where the model lives.
        dtype: dtype of the weights that are not quantised.
        trust_remote_code: allow model code from the model directory.
        attn_implementation: a model.attn_implementation (see `leantune.models.attention`);
            auto is the masked attention the model supports (sdpa, or eager where
            transformers has none).
        attn_field: how a refusal of `attn_implementation` names the setting.
        rope_scaling: RoPE scaling written into the model config before the model is built.
        quantization: quantise the blocks' linear layers to 4 bits while loading (QLoRA); the
            model is then loaded straight onto `device`, where bitsandbytes quantises it.
        device: target device of a quantised load (others load on CPU and are moved by the caller).

    Raises:
        ModelPathError: the source holds no loadable model (missing or broken config or weights).
        UnsupportedAttention: an explicit `attn_implementation` the model cannot use.
    """
    with loading(_name(source)):
        config = _model_config(source, trust_remote_code)
        # packed=False: a loaded model's own callers (eval, generate, export) pass padded rows,
        # never packed ones; training resolves its attention itself.
        attention = resolve_attention(
            attn_implementation,
            packed=False,
            model_config=config,
            remote_code=trust_remote_code,
            field=attn_field,
        )
        return _load_model(
            source,
            config,
            dtype,
            trust_remote_code,
            attention.name,
            rope_scaling,
            quantization,
            device,
        )


def _name(source: ModelSource) -> str:
    """How messages name a source: the GGUF file itself when there is one."""
    return str(Path(source.location) / source.gguf_file) if source.gguf_file else source.location


def _load_model(
    source: ModelSource,
    config: PreTrainedConfig,
    dtype: str,
    trust_remote_code: bool,
    attn_implementation: str,
    rope_scaling: RopeScalingConfig | None,
    quantization: Quantization | None,
    device: torch.device | str,
) -> PreTrainedModel:
    kwargs: dict[str, Any] = {
        "local_files_only": not downloads_allowed(),
        "dtype": DTYPES[dtype],
        "trust_remote_code": trust_remote_code,
        "attn_implementation": transformers_name(attn_implementation),
    }
    if source.gguf_file is None:  # never a pickle: refused by name, and never loaded at all
        local = _local_dir(source)
        if local is not None:
            refuse_pickled_weights(local)
    if rope_scaling is not None:
        # Into the config before the model is built: the rotary embedding reads it once, at
        # construction.
        apply_rope_scaling(config, rope_scaling)
        kwargs["config"] = config
    if quantization is not None:
        kwargs["quantization_config"] = bnb_config(quantization)
        # Straight onto the device: bitsandbytes quantises as the weights arrive there, and
        # a full-precision copy on the CPU first would cost the memory QLoRA saves.
        kwargs["device_map"] = {"": str(device)}
    shards = streamed_shards(source, config, trust_remote_code)
    if shards is not None:
        model = _from_shards(_model_class(config), source.location, config, shards, kwargs)
    else:  # a hub id, a GGUF file or remote code: transformers reads the files
        model = AutoModelForCausalLM.from_pretrained(
            source.location,
            gguf_file=source.gguf_file,
            # never a pickle (refused above by name where the folder is local)
            use_safetensors=None if source.gguf_file else True,
            **kwargs,
        )
    check_supported(model, attn_implementation)
    if quantization is not None:
        keep_training_layout(model)
    # Once, here, for every user of the model (train, eval, the wrappers around it): how the
    # loss gets its logits (`output_head(model).note` says why when it is the slow way).
    decide_output_head(model)
    return model


def streamed_shards(
    source: ModelSource, config: PreTrainedConfig, trust_remote_code: bool
) -> list[Path] | None:
    """The safetensors files loading reads tensor by tensor (`models.weight_files`), or None
    where transformers reads the files itself: a GGUF file, .bin weights, a hub id not on disk,
    or a model class that is not transformers' own."""
    if source.gguf_file or trust_remote_code or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    return checkpoint_shards(source.location)


def _model_class(config: PreTrainedConfig) -> type[PreTrainedModel]:
    """The class AutoModelForCausalLM builds for `config`: of several for one config type, the
    one its `architectures` names, else the first (as transformers' auto classes choose)."""
    found = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not isinstance(found, list | tuple):
        return cast(type[PreTrainedModel], found)
    named = {c.__name__: c for c in found if c is not None}  # entries can be None: skipped
    arch = next((a for a in getattr(config, "architectures", None) or [] if a in named), None)
    return cast(type[PreTrainedModel], named[arch] if arch else found[0])


def _from_shards(
    model_class: type[PreTrainedModel],
    location: str,
    config: PreTrainedConfig,
    shards: list[Path],
    kwargs: dict[str, Any],
) -> PreTrainedModel:
    """`from_pretrained` of the model's own class over the shards read tensor by tensor
    (`models.weight_files`: never the checkpoint's pages and the weights together)."""
    with pread_state_dict(shards) as tensors:
        model = model_class.from_pretrained(
            None, **{"config": config, **kwargs}, state_dict=tensors
        )
    model.name_or_path = model.config.name_or_path = location  # from_pretrained(None): "None"
    if ModelPaths(Path(location)).generation_config.is_file():
        # Read by from_pretrained from a folder; with a state dict there is none to read from.
        model.generation_config = GenerationConfig.from_pretrained(location)
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (non-reentrant, so frozen inputs need no grad hooks).

    Raises:
        ValueError: the model has no gradient-checkpointing support.
    """
    # Non-reentrant: the reentrant variant gives no gradient to a block whose inputs do not
    # require grad, which is every block of a model with frozen embeddings (adapters).
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed it; the old name warns and goes in v6.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise ValueError("train.gradient_checkpointing: this model does not support it")
    enable(gradient_checkpointing_kwargs=kwargs)
