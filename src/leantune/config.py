"""Run configuration: dataclasses hold every default; YAML files and dotted overrides fill them.

`load_config(path, overrides)` parses, applies `section.key=value` overrides, resolves relative
data paths against the config file's folder, and validates every field before anything loads.
Every error names the field (and the YAML line when it came from a file) and what would be valid.
Reading YAML and coercing a value to its field's type are in `config_parse`; the sections and
the checks across fields are here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from leantune.config_checks import (
    check_libraries,
    check_sizes,
)
from leantune.config_dist import DistConfig, check_deepspeed, check_dist
from leantune.config_monitor import MonitorConfig, check_monitor
from leantune.config_parse import (
    ConfigError,
    ParseError,
    check_value,
    field_types,
    load_yaml,
    memory_size,
    set_nested_field,
    shorten,
    show,
)
from leantune.config_preference import (
    PreferenceConfig,
    check_objective,
    check_preference,
)
from leantune.methods.registry import METHODS

DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
AUTO_RUN_NAME = "auto"
"""run.name that `train` replaces with one derived from the run (training.run_setup)."""
DEFAULT_BATCH_EXAMPLES = 8
"""Examples per optimizer step with micro_batch_size=auto and no train.global_batch_size (HF
Trainer's default batch): the rows that hold that many examples on average (8 unpacked rows;
see training.run_setup.default_global_batch)."""


@dataclass
class RopeScalingConfig:
    type: Literal["linear", "dynamic", "yarn"]
    """linear (position interpolation), dynamic (NTK-aware, grows with the input) or yarn."""
    factor: float
    """Context extension factor (> 1): the new context is factor x the original one."""
    original_max_position_embeddings: int | None = None
    """The context the model was pretrained with (default: the model's max_position_embeddings)."""


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """Local HF directory, .gguf file, hub id (offline from the HF cache) or the demo model name."""
    gguf_file: str | None = None
    """GGUF file name inside `path` when `path` is a directory holding one."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """dtype of the frozen weights."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (off unless you trust it)."""
    attn_implementation: Literal["auto", "segments", "sdpa", "eager"] = "auto"
    """Attention kernel for training: segments (causal SDPA per example of a packed row: no
    row x row mask, work only where examples attend), sdpa or eager; auto = segments when rows
    are packed, else sdpa (a resumed run keeps its own). Evaluation and generation use sdpa."""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE scaling to train beyond the model's context, e.g. {type: yarn, factor: 4}; keys: type
    (linear | dynamic | yarn), factor, original_max_position_embeddings (optional)."""


@dataclass
class DataConfig:
    train: str | None = None
    """Training JSONL file, or a directory written by `leantune prepare`."""
    eval: str | None = None
    """Held-out JSONL file (loss, perplexity and, for chat/alpaca, exact match)."""
    format: Literal[
        "alpaca", "chat", "text", "sharegpt", "prompt_completion", "preference", "kto"
    ] = "chat"
    """Record format: alpaca (instruction/input/output), chat (messages), text (text), sharegpt
    (conversations of from/value turns), prompt_completion (TRL's prompt and completion),
    preference (TRL's prompt/chosen/rejected pairs, or chosen/rejected conversations), kto
    (TRL's prompt/completion/label)."""
    max_seq_len: int | Literal["auto"] = "auto"
    """Longest tokenised example (at most 1,048,576); longer ones are reported as bad lines.
    auto = the longest example of data.train, up to the model's context (max_position_embeddings,
    times model.rope_scaling's factor); examples beyond the context are the bad lines then."""
    pack: bool | Literal["auto"] = "auto"
    """Pack several examples into one sequence (they never attend to each other); auto = pack
    unless the method needs one example per row (prefix, ptuning_v2, prompt)."""
    max_bad_fraction: float = 0.05
    """Refuse to start when more than this share of lines is bad (0 = any bad line stops)."""
    system_prompt: str | None = None
    """System message added to alpaca records and to chat records that have none."""
    system_message: Literal["auto", "keep", "fold", "drop"] = "auto"
    """System messages: keep them as the chat template writes them, fold each into the next
    user turn (its text, a blank line, the user's), or drop them. auto = keep where the
    template writes them, fold where it refuses or leaves them out (Gemma 2, Mistral v0.3)."""
    clean: list[Literal["html", "control", "nfkc", "whitespace"]] = field(default_factory=list)
    """Cleaning rules for every text field before tokenising (none by default: data is used
    as is; `leantune prepare --data` defaults to all four)."""
    dedup: Literal["none", "exact", "near"] = "none"
    """Drop exact duplicates (content hash) or also near duplicates (MinHash/LSH)."""
    near_dup_threshold: float = 0.85
    """Estimated Jaccard similarity (byte 7-grams) above which a record is a near duplicate."""
    min_tokens: int = 1
    """Shortest tokenised example; shorter ones are reported as bad lines."""
    truncate: bool = False
    """Cut over-long examples to max_seq_len instead of rejecting them (those whose answer is
    cut to nothing are still dropped and counted)."""
    cache_dir: str | None = None
    """Tokenise-once cache for data.train/data.eval files (default <run dir>/prepared)."""
    engine: Literal["local", "dask"] = "local"
    """Where cleaning and tokenisation run: this process, or a Dask cluster."""
    scheduler: str | None = None
    """Dask scheduler address (tcp://host:8786); unset = a LocalCluster per preparation."""
    partition_mb: float | None = None
    """Partition size in MB of input (default 4 for local, 64 for dask)."""
    chat_template: str | None = None
    """Chat template to render conversations with, replacing the tokenizer's (needed when it has
    none): chatml, zephyr, llama3, or a Jinja file (relative to the config file); it is saved
    with the trained model."""


@dataclass
class MethodConfig:
    name: Literal[
        "full",
        "lora",
        "dora",
        "qlora",
        "ia3",
        "freeze",
        "adapter",
        "prefix",
        "ptuning_v2",
        "prompt",
    ] = "lora"
    """Fine-tuning method: full, lora, dora (weight-decomposed LoRA), qlora (LoRA on a 4-bit NF4
    base, needs bitsandbytes), ia3 (learned rescaling), freeze (train only the last blocks and/or
    norms), adapter (bottleneck adapters), prefix (prefix tuning), ptuning_v2 (deep prompt tuning
    on every layer) or prompt (prompt tuning)."""
    preset: Literal["default", "seed"] = "default"
    """LoRA preset: default = all linear layers, r=16, alpha=32; seed = the source articles'
    r=8, alpha=32, q_proj/v_proj, dropout 0.1 (explicit r/alpha/... fields still apply)."""
    r: int | None = None
    """LoRA rank (preset value when unset)."""
    alpha: int | None = None
    """LoRA scaling numerator (preset value when unset)."""
    dropout: float | None = None
    """LoRA dropout (preset value when unset)."""
    last_blocks: int = 2
    """freeze: how many of the last transformer blocks train."""
    norms: bool = True
    """freeze: also train every norm layer."""
    target_modules: list[str] | None = None
    """Module (or fused expert weight) names to adapt, or ["all-linear"]: every linear layer and
    routed-expert weight of the blocks, routers left frozen (lora/dora preset value when unset;
    IA3's default: keys, values and the MLP, through qkv_proj where they are fused)."""
    adapter_placement: Literal["houlsby", "pfeiffer"] = "pfeiffer"
    """adapter: houlsby = after attention and MLP of every block; pfeiffer = after the MLP only."""
    adapter_reduction: int = 16
    """adapter: reduction factor, hidden size / bottleneck size."""
    num_virtual_tokens: int = 20
    """prefix/ptuning_v2/prompt: number of virtual tokens (prefix length)."""
    prefix_projection: bool | None = None
    """prefix/ptuning_v2: train the prefixes through a two-layer MLP (reparameterisation);
    unset = method default (prefix: on, ptuning_v2: off)."""
    prefix_hidden_size: int | None = None
    """prefix/ptuning_v2: hidden width of that MLP (unset = the model's key/value width)."""
    prompt_init: Literal["tokens", "random"] | None = None
    """prefix/ptuning_v2/prompt: tokens (also when unset) = start the virtual tokens from real
    tokens (those of prompt_init_text, else sampled from the vocabulary): their input embeddings
    (prompt) or the model's own keys/values for them (prefix, ptuning_v2); random = peft's
    N(0, 1)."""
    prompt_init_text: str | None = None
    """prefix/ptuning_v2/prompt: the text whose tokens the virtual tokens start from (unset:
    tokens sampled from the vocabulary)."""
    double_quant: bool = True
    """qlora: also quantise the 4-bit blocks' scales (saves ~0.37 bit per parameter)."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """qlora: dtype of the 4-bit layers' matmuls; auto = train.precision as resolved (fp32
    unless autocast)."""


@dataclass
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run; unset = as many as train.epochs take. With train.epochs set too,
    the fewer of the two."""
    epochs: int | None = None
    """Passes over the training rows: rows / global batch (rounded up) steps each. Unset = 1,
    unless train.max_steps is set (then max_steps steps, the data repeating as needed)."""
    micro_batch_size: int | Literal["auto"] = "auto"
    """Sequences per forward/backward pass; auto = the largest divisor of the global batch that
    the memory planner predicts fits train.memory_budget (grad_accum then fills the rest; where
    the planner cannot model the run, 4)."""
    global_batch_size: int | None = None
    """Rows per optimizer step with micro_batch_size=auto (unset: the rows that hold 8 examples
    on average, as HF Trainer's default batch of 8 does: 8 unpacked rows, fewer packed ones);
    with a fixed micro-batch the global batch is micro_batch_size x grad_accum and this is
    ignored. Data with fewer rows makes every step one pass over all of them."""
    memory_budget: str | None = None
    """Memory the run may use, e.g. 20GiB. micro_batch_size=auto plans within it (unset: 90% of
    free CUDA memory or available RAM); on CPU a micro-batch whose resident memory goes above it
    counts as out of memory (halve the micro-batch, replay the step; unset: no limit)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float | None = None
    """Peak learning rate (default by method, measured by sweeps: full 1e-4, freeze 1e-3,
    lora/dora/adapter 2e-3, qlora 6e-4, ia3 1e-2, prefix 3e-4, ptuning_v2/prompt 3e-2)."""
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit"] = "adamw"
    """adamw, or AdamW with 8-bit (bitsandbytes, else torchao) or 4-bit (torchao) state;
    paged_adamw_8bit pages the state to CPU memory under GPU memory pressure (CUDA)."""
    weight_decay: float = 0.01
    """AdamW weight decay (never applied to biases and norms)."""
    warmup_ratio: float = 0.1
    """Share of steps spent in linear warmup."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a share of the peak learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast precision; fp16 uses a GradScaler and needs CUDA. auto: on CUDA bf16 where the
    GPU supports it, else fp16; on CPU bf16 where it runs bf16 matmul clearly faster than fp32
    (measured once per machine), else fp32. A resumed run keeps the precision it started in."""
    seed: int = 42
    """Seed for initialisation, data order and dropout (0 .. 2**32 - 1)."""
    save_every: int = 50
    """Write a checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = 2
    """Complete checkpoints to keep."""
    objective: Literal["sft", "dpo", "simpo", "orpo", "kto"] = "sft"
    """sft: learn the answers (demonstrations); dpo, simpo, orpo: prefer each pair's chosen
    answer over its rejected one; kto: completions labelled desirable or not. Their settings
    are the preference.* fields."""
    kl_coef: float = 0.0
    """Weight of KL(model || base model) added to the loss (adapter methods only; 0 = off)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward to save memory (about a third more compute). auto: on
    only where the memory planner predicts that not even micro-batch 1 (micro_batch_size=auto)
    or the configured micro-batch fits the memory budget without it, and never for a method
    that does not support it."""
    compile: bool = False
    """Compile each transformer block's training forward with torch.compile (one process; needs
    a C++ compiler). The first steps pay the compile (tens of seconds on CPU, less with a warm
    cache: about 70 s and 12 s on the demo); later steps ran 7-19% faster there, so it pays on
    long runs (a few hundred steps cold) or repeated ones only."""
    eval_exact_match: bool = False
    """Measure exact match on the eval set before and after training (chat/alpaca)."""
    eval_every: int = 0
    """Evaluate every N optimizer steps into eval.jsonl (0 = only at the end): eval loss, and for
    chat/alpaca data exact match on the first `eval_every_sample` eval examples."""
    eval_every_sample: int = 20
    """How many eval examples the periodic exact match decodes (0 = loss only)."""
    eval_base: bool = True
    """With eval_exact_match: also measure the base model before training."""
    eval_limit: int | None = None
    """Use only the first N eval examples (loss, perplexity and exact match)."""
    eval_batch_size: int = 16
    """Batch size for evaluation and generation."""
    max_new_tokens: int = 128
    """Generation length limit for exact match."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train."""


@dataclass
class GuardConfig:
    nonfinite: Literal["skip", "pause", "rollback"] = "skip"
    """Action on a NaN/inf loss or gradient: skip the update, pause the run, or roll back."""
    loss_spike: Literal["off", "warn", "skip", "pause", "rollback"] = "warn"
    """Action when the loss jumps far above its recent median."""
    grad_norm: Literal["off", "warn", "skip", "pause", "rollback"] = "warn"
    """Action when the pre-clipping gradient norm jumps far above its recent median."""
    loss_sigmas: float = 6.0
    """Loss spike: robust sigmas (1.4826 x MAD of log loss) above the median that count."""
    loss_min_ratio: float = 3.0
    """Loss spike: never flag a loss below this multiple of the recent median."""
    grad_sigmas: float = 6.0
    """Gradient-norm anomaly: robust sigmas (of log norm) above the median that count."""
    grad_min_ratio: float = 4.0
    """Gradient-norm anomaly: never flag a norm below this multiple of the recent median."""
    window: int = 128
    """Steps of history the robust statistics use."""
    warmup: int = 20
    """Accepted steps before the spike and norm detectors act (non-finite is always on)."""
    max_consecutive_skips: int = 10
    """Stop (with a checkpoint) when this many steps in a row are skipped."""
    lr_factor: float = 0.5
    """Rollback multiplies the learning rate by this (kept on resume)."""
    max_rollbacks: int = 3
    """Stop instead of rolling back once this many rollbacks happened in the run."""


@dataclass
class RunConfig:
    """Where a run lives and whether it continues.

    A run directory records a fingerprint of everything that decides the run's trajectory
    (leantune_run.json): the base model's files and shapes, the train data's contents, the data
    settings (format, max_seq_len, pack, system_prompt, clean, dedup, near_dup_threshold,
    min_tokens, truncate,
    chat_template), model dtype/attn_implementation/rope_scaling, every method setting,
    the optimizer and schedule (lr resolved, optimizer, weight_decay, warmup_ratio,
    min_lr_ratio, max_grad_norm, max_steps, epochs, kl_coef, precision), seed and the global
    batch (micro_batch_size x grad_accum; another split of the same global batch is allowed).
    max_seq_len, pack and max_steps are recorded as the run resolved them from the data.
    Free to change on resume: run.*, evaluation settings and data.eval, save_every, keep_last,
    guard.*, device, memory_budget, gradient_checkpointing, trust_remote_code and the data
    preparation engine and cache.
    """

    name: str = "auto"
    """Run name (1-100 letters, digits, '.', '_', '-'; no path); the run directory is
    runs/<name> unless run.dir is set. auto = <data file stem>-<method>-<8 hex digits of the
    run's settings and input digests>: another run gets another directory, the same command
    the same one (and resumes)."""
    dir: str | None = None
    """Run directory (default runs/<name>): new, empty, or a leantune run."""
    resume: Literal["auto", "never", "force"] = "auto"
    """auto: continue the newest checkpoint of a run with the same fingerprint, else exit 2
    listing the changed fields; force: continue it with the changes (it says what each means;
    weights that cannot load are still refused); never: start over, moving a run that is in
    the directory aside to <dir>.old-<time>."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> Path:
        """The run directory; run.name=auto must have been named first (`train` does it)."""
        if self.run.dir:
            return Path(self.run.dir)
        if self.run.name == AUTO_RUN_NAME:
            raise RuntimeError(
                "run.name=auto: the run is named when it starts (training.run_setup.named_run)"
            )
        return Path("runs") / self.run.name


# ---------------------------------------------------------------------------------------------
# Parsing


def set_field(cfg: Config, dotted: str, value: Any, where: str = "") -> None:
    """Set `section.field` from user input, type-checked as if it came from a config file.

    Raises:
        ConfigError: unknown key or a value of the wrong type, prefixed with `where`.
    """
    _set(cfg, dotted, value, where)


def _set(cfg: Config, dotted: str, value: Any, where: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    parts = dotted.split(".")
    if len(parts) == 3 and parts[0] in sections:  # section.sub.field: monitor.wandb.project=x
        try:
            set_nested_field(getattr(cfg, parts[0]), parts[1], parts[2], value, where + dotted)
        except ParseError as e:
            raise ConfigError(str(e)) from None
        return
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"{where}{dotted}: unknown key; keys look like section.field with section one of "
            f"{', '.join(sections)}"
        )
    section, name = parts
    obj = getattr(cfg, section)
    types_ = field_types(type(obj))
    if name not in types_:
        raise ConfigError(
            f"{where}{dotted}: unknown field of '{section}'; valid: {', '.join(sorted(types_))}"
        )
    try:
        setattr(obj, name, check_value(f"{where}{dotted}", value, types_[name]))
    except ParseError as e:
        raise ConfigError(str(e)) from None


def parse_override(text: str) -> tuple[str, Any]:
    """Split `section.key=value`; the value is parsed as YAML (`1e-4`, `true`, `[a, b]`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    if not raw.strip():
        return key.strip(), None
    try:
        value, _ = load_yaml(raw, f"override {shorten(text)}")
    except ParseError as e:
        raise ConfigError(str(e).replace(": invalid YAML:", ": invalid YAML value:", 1)) from None
    return key.strip(), value


def _read_config_file(cfg_path: Path) -> str:
    """The text of a config file, or ConfigError saying why it cannot be read."""
    try:
        if cfg_path.is_dir():
            raise ConfigError(f"config file {cfg_path} is a directory; give a YAML file")
        if not cfg_path.is_file():
            raise ConfigError(f"config file {cfg_path} does not exist")
        raw = cfg_path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {cfg_path}: cannot be read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{cfg_path}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None


def config_base(
    path: str | Path | None, overrides: list[str] | None = None
) -> Literal["demo", "defaults"]:
    """What `load_config` starts from: the built-in demo config when there is no CONFIG and no
    `data.train=...` override; the library defaults (the dataclasses here) otherwise."""
    if path is not None:
        return "defaults"
    keys = {item.split("=", 1)[0].strip() for item in overrides or [] if "=" in item}
    return "defaults" if "data.train" in keys else "demo"


def describe_base(path: str | Path | None, overrides: list[str] | None = None) -> str:
    """One line saying which base `load_config(path, overrides)` uses."""
    if config_base(path, overrides) == "demo":
        return (
            f"config: the built-in demo ({DEMO_CONFIG.name}); give a CONFIG or data.train=... "
            "to start from the library defaults instead"
        )
    if path is None:
        return "config: the library defaults and the overrides (no CONFIG file)"
    return f"config: {path} over the library defaults"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated Config from a YAML file and overrides.

    The base is the built-in demo config when there is neither a file nor a `data.train`
    override (`config_base`), else the library defaults; the file, then the overrides, apply
    on top of it.

    Raises:
        ConfigError: unknown keys, wrong types or invalid combinations, naming the field.
    """
    cfg = Config()
    if config_base(path, overrides) == "demo":
        _apply_file(cfg, DEMO_CONFIG)
    elif path is not None:
        _apply_file(cfg, Path(path))
    for item in overrides or []:
        key, value = parse_override(item)
        _set(cfg, key, value, "override ")
    validate(cfg)
    return cfg


def _apply_file(cfg: Config, cfg_path: Path) -> None:
    """Set every field a YAML config file gives; relative data paths are the file's."""
    text = _read_config_file(cfg_path)
    try:
        data, lines = load_yaml(text, str(cfg_path))
    except ParseError as e:
        raise ConfigError(str(e)) from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_path}: expected a mapping of sections at the top level")
    base = cfg_path.parent.resolve()
    sections = [f.name for f in dataclasses.fields(Config)]
    for section, values in data.items():
        line = lines.get(str(section), 1)
        where = f"{cfg_path}:{line}: "
        if section not in sections:
            raise ConfigError(
                f"{where}{show(section)}: unknown section; valid: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{where}{section}: expected a mapping of fields")
        for name, value in values.items():
            key = f"{section}.{name}"
            # A key YAML reads as another type (true, 1) is found by its section's line.
            _set(cfg, key, value, f"{cfg_path}:{lines.get(key, line)}: ")
    # Relative data paths in a file are relative to that file.
    for name in ("train", "eval", "chat_template"):
        value = getattr(cfg.data, name)
        if value is None or Path(value).is_absolute():
            continue
        if name != "chat_template" or not _is_builtin_template(value):
            setattr(cfg.data, name, str(base / value))


COMPILE_ONE_PROCESS = (
    "train.compile=true runs in one process; with dist.strategy={strategy} set train.compile=false"
)


def validate(cfg: Config) -> list[str]:
    """Cross-field checks: raises ConfigError when invalid, returns warnings for risky settings."""
    t, d, m = cfg.train, cfg.data, cfg.method
    _check_finite(cfg)
    check_sizes(cfg)
    positive = {
        "train.max_steps": t.max_steps,
        "train.epochs": t.epochs,
        "train.micro_batch_size": None if t.micro_batch_size == "auto" else t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "train.grad_accum": t.grad_accum,
        "train.keep_last": t.keep_last,
        "train.eval_batch_size": t.eval_batch_size,
        "train.max_new_tokens": t.max_new_tokens,
        "data.max_seq_len": None if d.max_seq_len == "auto" else d.max_seq_len,
    }
    for key, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if t.eval_every < 0 or t.eval_every_sample < 0:
        raise ConfigError("train.eval_every and train.eval_every_sample must be >= 0")
    if t.eval_every and d.eval is None:
        raise ConfigError("train.eval_every: needs data.eval (a held-out file)")
    if t.save_every < 0:
        raise ConfigError(
            f"train.save_every: must be >= 0 (0 = only at the end), got {t.save_every}"
        )
    if t.lr is not None and not 0 < t.lr < 1:
        raise ConfigError(f"train.lr: must be in (0, 1), got {t.lr}")
    for key, ratio in {
        "train.warmup_ratio": t.warmup_ratio,
        "train.min_lr_ratio": t.min_lr_ratio,
        "data.max_bad_fraction": d.max_bad_fraction,
    }.items():
        if not 0 <= ratio <= 1:
            raise ConfigError(f"{key}: must be in [0, 1], got {ratio}")
    if t.kl_coef < 0:
        raise ConfigError(f"train.kl_coef: must be >= 0, got {t.kl_coef}")
    if t.kl_coef > 0 and not METHODS[m.name].kl_capable:
        adapters = ", ".join(name for name, spec in METHODS.items() if spec.kl_capable)
        raise ConfigError(
            f"train.kl_coef needs an adapter method ({adapters}), not method.name={m.name}: "
            "the base is the same model with its adapters disabled"
        )
    if t.weight_decay < 0 or t.max_grad_norm < 0:
        raise ConfigError("train.weight_decay and train.max_grad_norm must be >= 0")
    _validate_data(cfg)
    if t.precision == "fp16" and t.device == "cpu":
        raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); use bf16 on CPU")
    if t.memory_budget is not None:
        parse_memory_size(t.memory_budget, "train.memory_budget")
    _validate_guard(cfg.guard)
    _validate_run(cfg.run)
    check_monitor(cfg.monitor)
    _validate_method(cfg)
    check_dist(cfg.dist, t.device, t.eval_every)
    if t.compile and cfg.dist.strategy != "auto":
        raise ConfigError(COMPILE_ONE_PROCESS.format(strategy=cfg.dist.strategy))
    quantized = METHODS[m.name].base_quantization is not None
    check_deepspeed(cfg.dist, t.precision, t.optimizer, m.name, quantized)
    warnings: list[str] = check_libraries(cfg)
    warnings += check_preference(cfg.preference, t.objective, t.kl_coef)
    _validate_objective(cfg)
    lr, advice = t.lr, METHODS[m.name].lr_advice
    if advice is not None and lr is not None and lr >= advice.high:
        warnings.append(
            f"train.lr={lr:g} is high for {advice.what}; the usual range is {advice.usual}"
        )
    if METHODS[m.name].lora_settings and m.r is not None and m.r > 64:
        warnings.append(f"method.r={m.r}: LoRA ranks above 64 rarely help; 8..64 is usual")
    if (t.max_steps or 0) >= 30 and 0 < t.warmup_ratio < 0.03:
        warnings.append(f"train.warmup_ratio={t.warmup_ratio:g} is short; 0.03..0.1 is usual")
    return warnings


def _validate_objective(cfg: Config) -> None:
    spec = METHODS[cfg.method.name]
    check_objective(
        cfg.train.objective,
        cfg.data.format,
        cfg.method.name,
        trains_base_weights=spec.trains_base_weights,
        needs_unpacked_data=spec.needs_unpacked_data,
        eval_file=cfg.data.eval,
    )


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Refuse NaN and infinity in every float field of `obj` and its nested sections."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_finite(value, f"{key}.")


def _validate_data(cfg: Config) -> None:
    t, d = cfg.train, cfg.data
    if d.train is None:
        raise ConfigError("data.train: required; set it to a JSONL file (data.train=path.jsonl)")
    for key, file in (("data.train", d.train), ("data.eval", d.eval)):
        # A directory is a prepared dataset (from `leantune prepare`).
        if file is not None and not _exists(Path(file)):
            raise ConfigError(f"{key}: file {file} does not exist")
    if not 0 < d.near_dup_threshold <= 1:
        raise ConfigError(f"data.near_dup_threshold: must be in (0, 1], got {d.near_dup_threshold}")
    if d.min_tokens < 0 or (d.partition_mb is not None and d.partition_mb <= 0):
        raise ConfigError("data.min_tokens must be >= 0 and data.partition_mb > 0")
    if t.eval_exact_match and (d.eval is None or d.format == "text"):
        raise ConfigError(
            "train.eval_exact_match: needs data.eval and a chat or alpaca data.format"
        )
    if d.chat_template is not None:
        from leantune.data.templates import template_text

        template_text(d.chat_template)  # a ChatTemplateError names the field and the file


def _is_builtin_template(name: str) -> bool:
    from leantune.data.templates import is_builtin

    return is_builtin(name)


def _exists(path: Path) -> bool:
    """True for an existing file or directory; False also for names the OS refuses (too long)."""
    try:
        return path.is_file() or path.is_dir()
    except (OSError, ValueError):
        return False


def _validate_method(cfg: Config) -> None:
    t, d, m = cfg.train, cfg.data, cfg.method
    spec = METHODS[m.name]
    if m.last_blocks < 0:
        raise ConfigError(f"method.last_blocks: must be >= 0, got {m.last_blocks}")
    if spec.check is not None and (error := spec.check(m)) is not None:
        raise ConfigError(error)
    if m.r is not None and m.r < 1:
        raise ConfigError(f"method.r: must be >= 1, got {m.r}")
    if m.dropout is not None and not 0 <= m.dropout < 1:
        raise ConfigError(f"method.dropout: must be in [0, 1), got {m.dropout}")
    sizes: dict[str, int | None] = {
        "method.adapter_reduction": m.adapter_reduction,
        "method.num_virtual_tokens": m.num_virtual_tokens,
        "method.prefix_hidden_size": m.prefix_hidden_size,
    }
    for key, size in sizes.items():
        if size is not None and size < 1:
            raise ConfigError(f"{key}: must be >= 1, got {size}")
    if not spec.supports_gradient_checkpointing and t.gradient_checkpointing is True:
        raise ConfigError(
            f"train.gradient_checkpointing does not work with method.name={m.name}: transformers "
            "drops the KV cache, which holds the prefix, in checkpointed blocks; set it to false"
        )
    if spec.needs_unpacked_data and d.pack is True:
        raise ConfigError(
            f"method.name={m.name} needs data.pack=false (or auto, the default): in a packed row "
            "every example after the first would be computed differently from the same example "
            "alone"
        )


def _validate_guard(g: GuardConfig) -> None:
    for key, value in {
        "guard.loss_sigmas": g.loss_sigmas,
        "guard.grad_sigmas": g.grad_sigmas,
    }.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key, value in {
        "guard.loss_min_ratio": g.loss_min_ratio,
        "guard.grad_min_ratio": g.grad_min_ratio,
    }.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1 (a multiple of the median), got {value}")
    if not 2 <= g.warmup <= g.window:
        raise ConfigError(
            f"guard.warmup={g.warmup}, guard.window={g.window}: need 2 <= warmup <= window"
        )
    if g.max_consecutive_skips < 1 or g.max_rollbacks < 0:
        raise ConfigError("guard.max_consecutive_skips must be >= 1 and guard.max_rollbacks >= 0")
    if not 0 < g.lr_factor < 1:
        raise ConfigError(f"guard.lr_factor: must be in (0, 1), got {g.lr_factor}")


RUN_NAME_MAX = 100
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_NAME_BYTES = 255  # the longest file name ext4, xfs, btrfs, APFS and NTFS allow


def effective_pack(pack: bool | str, method: str) -> bool:
    """data.pack as the run uses it: auto packs unless `method` needs one example per row."""
    if pack == "auto":
        spec = METHODS.get(method)
        return spec is None or not spec.needs_unpacked_data
    return bool(pack)


def configured_global_batch(t: TrainConfig) -> int:
    """Rows per optimizer step as configured; unset with micro_batch_size=auto, the rows of
    DEFAULT_BATCH_EXAMPLES unpacked examples (run_setup resolves it from the data first, and a
    smaller dataset lowers it)."""
    if t.micro_batch_size == "auto":
        return t.global_batch_size or DEFAULT_BATCH_EXAMPLES
    return t.micro_batch_size * t.grad_accum


def _validate_run(r: RunConfig) -> None:
    """run.name is a name (never a path: `../../x` would write outside runs/), run.dir a path
    whose every component a file system can hold."""
    if len(r.name) > RUN_NAME_MAX or not _RUN_NAME.fullmatch(r.name):
        shown = repr(r.name) if len(r.name) <= 40 else f"{r.name[:40]!r}... ({len(r.name)} chars)"
        raise ConfigError(
            f"run.name={shown}: a run name is 1 to {RUN_NAME_MAX} letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (no '/', no '..'); for a path use run.dir"
        )
    if r.dir is None:
        return
    if not r.dir.strip():
        raise ConfigError("run.dir: empty; leave it unset for runs/<run.name>")
    for part in Path(r.dir).parts:
        if len(part.encode()) > _MAX_NAME_BYTES:
            raise ConfigError(
                f"run.dir: the component {part[:40]!r}... is {len(part.encode())} bytes; file "
                f"systems allow at most {_MAX_NAME_BYTES}"
            )


def parse_memory_size(text: str, key: str = "memory size") -> int:
    """Bytes in a size such as "20GiB", "512 MiB", "1.5GB" or "1000000" (binary and SI units).

    Raises:
        ConfigError: not a positive size, naming `key`.
    """
    try:
        return memory_size(text, key)
    except ParseError as e:
        raise ConfigError(str(e)) from None


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (saved with every run and checkpoint)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML."""
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def field_docs() -> dict[str, str]:
    """`section.field` -> its one-line docstring, for `leantune validate --help-fields`."""
    import ast
    import inspect
    import itertools

    docs: dict[str, str] = {}
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        tree = ast.parse(inspect.getsource(cls))  # type: ignore[arg-type]
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[f"{section.name}.{node.target.id}"] = " ".join(str(nxt.value.value).split())
    return docs
