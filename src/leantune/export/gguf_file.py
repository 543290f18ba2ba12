"""`gguf`: `model.gguf` for llama.cpp / Ollama, written with `gguf.GGUFWriter`.

Tensor names, the Llama Q/K row permutation and the tokenizer metadata follow llama.cpp's
`convert_hf_to_gguf.py`; what differs per architecture is in `gguf_arch.ARCHITECTURES`. The
tokenizer must be byte-level BPE (GPT-2 style, as SmolLM2, Qwen, Llama 3 and Phi-4 use). 1-D
tensors (norms, biases) stay float32; the others are f16, bf16 or q8_0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.export.gguf_arch import ARCHITECTURES, Fields, GgufArch, supported_list
from leantune.export.parity import LogitsFn, ParityError, Samples
from leantune.export.source import ExportError, model_logits_fn

MODEL_FILE = "model.gguf"

GGUF_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Split regexes of byte-level tokenizers and the llama.cpp pre-tokenizer name for each.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Matched exactly: llama.cpp picks its splitter by this name, not by the pattern, so a regex
# that differs by one character would split text differently from the source tokenizer.
PRE_TOKENIZER_NAMES = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Llama q/k projection from HF's rotate-half layout to llama.cpp's
    interleaved one (llama.cpp `LlamaModel.permute`; transformers undoes it on load)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    # Gemma 3 keeps one rope per attention kind; GGUF's base is the full-attention layers' one
    # (llama.cpp fixes the sliding layers' at 10000, which `gguf_arch` checks).
    params = params.get("full_attention", params)
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ExportError(f"--format gguf: rope_type {rope_type!r} is not supported (only default)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ExportError("--format gguf: the model config has no rope_theta")
    return float(theta)


def _context_length(config: Any, spec: GgufArch) -> int:
    """The context llama.cpp may use: a Mistral-style sliding window is not in llama.cpp's Llama
    architecture, so it matches transformers only up to the window."""
    window = getattr(config, "sliding_window", None)
    if spec.arch == gguf.MODEL_ARCH.LLAMA and window:
        return min(int(config.max_position_embeddings), int(window))
    return int(config.max_position_embeddings)


def _write_hparams(
    w: gguf.GGUFWriter, config: Any, spec: GgufArch, name: str, ftype: gguf.LlamaFileType
) -> None:
    # A config may lack head_dim or hold None, both meaning hidden_size / heads.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(name)
    w.add_context_length(_context_length(config, spec))
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(config))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config.vocab_size)
    spec.write_extra(w, config)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """Array to store and its raw GGML type (None: numpy dtype decides)."""
    # As llama.cpp's converter: 1-D tensors (norms, biases) are tiny and stay float32.
    if array.ndim < 2:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    # q8_0 quantises blocks of 32 values along a row; a row that does not divide falls back to
    # f16, as llama.cpp's converter does.
    if qtype == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32 != 0:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def _gguf_tensors(
    hf_name: str, array: np.ndarray, spec: GgufArch, config: Any, name_map: gguf.TensorNameMap
) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors one HF tensor becomes, with llama.cpp's names and layouts."""
    base, _, suffix = hf_name.rpartition(".")
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        # transformers fuses the experts' gate and up rows ([experts, 2 * ff, hidden], gate
        # first); llama.cpp keeps them as two stacked tensors.
        bid = int(hf_name.split(".layers.")[1].split(".")[0])
        half = array.shape[1] // 2
        gate = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_EXP].format(bid=bid)
        up = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_UP_EXP].format(bid=bid)
        return [(f"{gate}.weight", array[:, :half]), (f"{up}.weight", array[:, half:])]
    if hf_name.endswith("mlp.experts.down_proj"):
        base, suffix = hf_name, "weight"  # a bare parameter: transformers' name has no suffix
    gguf_name = name_map.get_name(base)
    if gguf_name is None:
        raise ExportError(f"--format gguf: no GGUF name for tensor {hf_name}")
    if spec.permute_qk and base.endswith("self_attn.q_proj"):
        array = permute_qk(array, config.num_attention_heads)
    elif spec.permute_qk and base.endswith("self_attn.k_proj"):
        array = permute_qk(array, config.num_key_value_heads)
    elif spec.norm_offset and base.endswith("norm") and suffix == "weight":
        array = array + spec.norm_offset
    elif base.endswith("shared_expert_gate"):
        array = array.reshape(-1)  # [1, hidden] in transformers, a vector in llama.cpp
    return [(f"{gguf_name}.{suffix}", array)]


def _write_tensors(
    w: gguf.GGUFWriter,
    model: PreTrainedModel,
    spec: GgufArch,
    qtype: gguf.GGMLQuantizationType,
) -> int:
    config = model.config
    name_map = gguf.get_tensor_name_map(spec.arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    count = 0
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # a GGUF without output.weight means tied embeddings
        # numpy has no bfloat16, and every GGUF type is encoded from float32.
        array = tensor.detach().to(torch.float32).cpu().numpy()
        for gguf_name, part in _gguf_tensors(hf_name, array, spec, config, name_map):
            data, raw_dtype = _encode(np.ascontiguousarray(part), qtype)
            w.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
            count += 1
    return count


def _is_byte_level(step: dict[str, Any], use_regex: bool) -> bool:
    return (
        step.get("type") == "ByteLevel"
        and bool(step.get("use_regex", True)) == use_regex
        and not step.get("add_prefix_space", False)  # llama.cpp never adds a prefix space
    )


def _pre_tokenizer_name(tok_json: dict[str, Any]) -> str:
    """llama.cpp's name for the pre-tokenizer, only when it splits text exactly as this one:
    GPT-2's byte level alone, or one known regex split followed by a byte level that does not
    split again (Llama 3, Qwen2)."""
    pre = tok_json.get("pre_tokenizer") or {}
    if _is_byte_level(pre, use_regex=True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and _is_byte_level(steps[1], use_regex=False):
        split = steps[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") == "Split"
            and split.get("behavior") == "Isolated"
            and not split.get("invert", False)
            and pattern in PRE_TOKENIZER_NAMES
        ):
            return PRE_TOKENIZER_NAMES[pattern]
    raise ExportError(
        f"--format gguf: pre-tokenizer {json.dumps(pre)[:200]} is not one llama.cpp reproduces "
        "(supported: GPT-2 byte level, Qwen2 and Llama 3 splits); export --format hf and "
        "convert with llama.cpp's convert_hf_to_gguf.py"
    )


def _merges(tok_json: dict[str, Any]) -> list[str]:
    merges = tok_json["model"].get("merges") or []
    # tokenizer.json holds merges as "a b" strings (older files) or as [a, b] pairs (newer).
    if merges and isinstance(merges[0], list):
        # llama.cpp spells a space inside a merge part as chr(ord(' ') + 256) (convert_hf_to_gguf).
        return [
            " ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
            for pair in merges
        ]
    return list(merges)


def _tokenizer_json(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The tokenizer as `tokenizer.json`, when GGUF's byte-level BPE ("gpt2") describes it.

    Raises:
        ExportError: not a fast tokenizer, not byte-level BPE, or a pre-tokenizer llama.cpp
            does not reproduce.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("--format gguf needs a fast (tokenizers) tokenizer")
    tok_json: dict[str, Any] = json.loads(backend.to_str())
    if (
        tok_json["model"].get("type") != "BPE"
        or (tok_json.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        raise ExportError(
            "--format gguf: only byte-level BPE tokenizers are supported (not SentencePiece "
            "ones, as Mistral, Gemma and Phi-3 ship); export --format hf and convert with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    _pre_tokenizer_name(tok_json)  # for its refusal, before any weight is written
    return tok_json


def _write_tokenizer(w: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase, n_vocab: int) -> None:
    tok_json = _tokenizer_json(tokenizer)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    # One token per embedding row: a vocab_size padded past the tokenizer gets UNUSED fillers,
    # so that llama.cpp's token list and the tensors agree.
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            # Special added tokens are CONTROL: llama.cpp treats them as markers, not text.
            tokens.append(by_id[i])
            special = added[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer_name(tok_json))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_merges(tok_json))
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None and token_id < n_vocab:
            getattr(w, f"add_{kind}_token_id")(int(token_id))
    # Probed rather than read: tokenizers keep this in a flag or in tokenizer.json's
    # post-processor, and the probe covers both.
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]
    w.add_add_bos_token(bool(adds_bos))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        w.add_chat_template(template)


def check_gguf_config(config: Any) -> GgufArch:
    """The architecture entry for `config`, or the reasons it cannot be written as GGUF.

    Raises:
        ExportError: the model type is not supported, or llama.cpp would run this configuration
            differently from transformers.
    """
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(str(model_type))
    if spec is None:
        raise ExportError(
            f"--format gguf: model type {model_type!r} is not supported; supported: "
            f"{supported_list()}. Export --format hf and convert with llama.cpp's "
            "convert_hf_to_gguf.py (leantune writes only what it can read back to check parity)"
        )
    reasons = spec.refuse(config)
    if reasons:
        raise ExportError(
            f"--format gguf: this {model_type} model cannot run the same in llama.cpp: "
            f"{'; '.join(reasons)}. Export --format hf instead"
        )
    _rope_theta(config)  # for its refusal (unsupported rope scaling), before weights load
    return spec


def check_gguf_source(config: Any, tokenizer: PreTrainedTokenizerBase) -> GgufArch:
    """Everything `write_gguf` would refuse, from the config and tokenizer alone.

    Raises:
        ExportError: see `check_gguf_config` and `_tokenizer_json`.
    """
    spec = check_gguf_config(config)
    _tokenizer_json(tokenizer)
    return spec


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    gguf_type: str,
    name: str | None = None,
) -> dict[str, Any]:
    """Write `out/model.gguf` in `gguf_type` ("f16", "bf16" or "q8_0"), named `name` in its
    metadata (default: the folder's name).

    Raises:
        ExportError: the architecture, its configuration, rope scaling or tokenizer is not
            supported.
    """
    spec = check_gguf_source(model.config, tokenizer)
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type!r}: choose one of {sorted(GGUF_TYPES)}")
    qtype, ftype = GGUF_TYPES[gguf_type]
    path = out / MODEL_FILE
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[spec.arch])
    _write_hparams(w, model.config, spec, name or out.name or "model", ftype)
    _write_tokenizer(w, tokenizer, model.config.vocab_size)
    n = _write_tensors(w, model, spec, qtype)
    # GGUFWriter's required order: header, metadata, then tensor data.
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"gguf_type": gguf_type, "tensors": n, "bytes": path.stat().st_size}


def read_fields(path: Path) -> Fields:
    """The GGUF metadata of `path`, scalars and strings, keyed without the `{arch}.` prefix."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    prefix = f"{arch}."
    out: Fields = {}
    for key, fld in reader.fields.items():
        # An array field lists two types (the array's and its items'): only scalars and strings.
        if key.startswith(prefix) and len(fld.types) == 1:
            out[key[len(prefix) :]] = fld.contents()
    return out


def load_gguf(out: Path) -> LogitsFn:
    """Load `model.gguf` back with transformers (dequantised to float32), completing its config
    with what transformers' GGUF loader leaves at the defaults (`GgufArch.readback`).

    Raises:
        ParityError: transformers cannot load the file (a failed check, not a user's mistake).
    """
    config = AutoConfig.from_pretrained(out, gguf_file=MODEL_FILE)
    spec = ARCHITECTURES.get(config.model_type)
    if spec is not None:
        for key, value in spec.readback(read_fields(out / MODEL_FILE)).items():
            setattr(config, key, value)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            out, gguf_file=MODEL_FILE, config=config, dtype=torch.float32
        )
    # e.g. tensor shapes the config does not describe. ParityError, not a user error: the
    # file was written by leantune, so failing to read it back is the export's failure.
    except (ValueError, RuntimeError) as e:
        raise ParityError(f"{out / MODEL_FILE}: transformers cannot read it back: {e}") from e
    return model_logits_fn(model.eval())


def check_gguf_tokenizer(
    out: Path, source: PreTrainedTokenizerBase, samples: Samples
) -> tuple[dict[str, Any], list[str]]:
    """Rebuild the tokenizer from the GGUF metadata (transformers' GGUF conversion) and compare
    token ids of every sample and the chat template with the source tokenizer."""
    loaded = AutoTokenizer.from_pretrained(out, gguf_file=MODEL_FILE)
    mismatched = [
        i
        for i, text in enumerate(samples.texts)
        # The samples' ids are cut at build_samples' max_tokens: compare that prefix.
        if list(loaded(text, add_special_tokens=True)["input_ids"])[: len(samples.ids[i])]
        != samples.ids[i]
    ]
    same_template = getattr(loaded, "chat_template", None) == getattr(source, "chat_template", None)
    failures = []
    if mismatched:
        failures.append(f"tokenizer loaded from GGUF encodes samples {mismatched} differently")
    if not same_template:
        failures.append("chat template loaded from GGUF differs from the source's")
    info = {
        "tokenizer_samples_matched": len(samples.texts) - len(mismatched),
        "chat_template_ok": same_template,
    }
    return info, failures
