"""Run configuration: dataclasses hold every default; YAML files and dotted overrides fill them.

`load_config(path, overrides)` parses, applies `section.key=value` overrides, resolves relative
data paths against the config file's folder, and validates every field before anything loads.
Every error names the field (and the YAML line when it came from a file) and what would be valid.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


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
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel."""


@dataclass
class DataConfig:
    train: str | None = None
    """Training JSONL file."""
    eval: str | None = None
    """Held-out JSONL file (loss, perplexity and, for chat/alpaca, exact match)."""
    format: Literal["alpaca", "chat", "text"] = "chat"
    """Record format: alpaca (instruction/input/output), chat (messages), text (text)."""
    max_seq_len: int = 1024
    """Longest tokenised example; longer ones are reported as bad lines."""
    pack: bool = True
    """Pack several examples into one sequence (they never attend to each other)."""
    max_bad_fraction: float = 0.05
    """Refuse to start when more than this share of lines is bad (0 = any bad line stops)."""
    system_prompt: str | None = None
    """System message added to alpaca records and to chat records that have none."""


@dataclass
class MethodConfig:
    name: Literal["full", "lora", "dora", "ia3", "freeze"] = "lora"
    """Fine-tuning method: full, lora, dora (weight-decomposed LoRA), ia3 (learned rescaling) or
    freeze (train only the last blocks and/or norms)."""
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
    """Module names to adapt, or ["all-linear"] (lora/dora preset value, or peft's per-architecture
    IA3 default, when unset)."""


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int | Literal["auto"] = 4
    """Sequences per forward/backward pass; auto = the largest divisor of train.global_batch_size
    that the memory planner predicts fits train.memory_budget (grad_accum then fills the rest)."""
    global_batch_size: int | None = None
    """Rows per optimizer step when micro_batch_size=auto (required then; ignored otherwise)."""
    memory_budget: str | None = None
    """Memory the run may use, e.g. 20GiB (default: 90% of free CUDA memory or available RAM);
    read by micro_batch_size=auto."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float | None = None
    """Peak learning rate (default by method: full/freeze 2e-5, lora/dora 2e-4, ia3 3e-3)."""
    weight_decay: float = 0.01
    """AdamW weight decay (never applied to biases and norms)."""
    warmup_ratio: float = 0.1
    """Share of steps spent in linear warmup."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a share of the peak learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision; fp16 uses a GradScaler and needs CUDA."""
    seed: int = 42
    """Seed for initialisation, data order and dropout."""
    save_every: int = 50
    """Write a checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = 2
    """Complete checkpoints to keep."""
    kl_coef: float = 0.0
    """Weight of KL(model || base model) added to the loss (adapter methods only; 0 = off)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    eval_exact_match: bool = False
    """Measure exact match on the eval set before and after training (chat/alpaca)."""
    eval_limit: int | None = None
    """Use only the first N eval examples (loss, perplexity and exact match)."""
    eval_batch_size: int = 16
    """Batch size for evaluation and generation."""
    max_new_tokens: int = 128
    """Generation length limit for exact match."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train."""


@dataclass
class RunConfig:
    name: str = "demo"
    """Run name; the default run directory is runs/<name>."""
    dir: str | None = None
    """Run directory (default runs/<name>)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest complete checkpoint in the run directory."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name


class ConfigError(ValueError):
    """A config value is missing, unknown or invalid; the message names the field and the fix."""


# ---------------------------------------------------------------------------------------------
# Parsing


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Coerce `value` to the annotated type `tp` or raise ConfigError naming `key`."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(key, value, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {' | '.join(map(str, choices))}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_value(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _yaml_lines(text: str) -> dict[str, int]:
    """Map `section.key` to its 1-based line in the YAML text."""
    lines: dict[str, int] = {}
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return lines
    for k, v in root.value:
        lines[str(k.value)] = k.start_mark.line + 1
        if isinstance(v, yaml.MappingNode):
            for k2, _ in v.value:
                lines[f"{k.value}.{k2.value}"] = k2.start_mark.line + 1
    return lines


def _set(cfg: Config, dotted: str, value: Any, where: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    parts = dotted.split(".")
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"{where}{dotted}: unknown key; keys look like section.field with section one of "
            f"{', '.join(sections)}"
        )
    section, name = parts
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    if name not in types_:
        raise ConfigError(
            f"{where}{dotted}: unknown field of '{section}'; valid: {', '.join(sorted(types_))}"
        )
    setattr(obj, name, _check_value(f"{where}{dotted}", value, types_[name]))


def parse_override(text: str) -> tuple[str, Any]:
    """Split `section.key=value`; the value is parsed as YAML (`1e-4`, `true`, `[a, b]`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else None
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated Config from a YAML file (None = the built-in demo) and overrides.

    Raises:
        ConfigError: unknown keys, wrong types or invalid combinations, naming the field.
    """
    cfg = Config()
    cfg_path = Path(path) if path is not None else DEMO_CONFIG
    if not cfg_path.is_file():
        raise ConfigError(f"config file {cfg_path} does not exist")
    text = cfg_path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{cfg_path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_path}: expected a mapping of sections at the top level")
    lines = _yaml_lines(text)
    base = cfg_path.parent.resolve()
    for section, values in data.items():
        where = f"{cfg_path}:{lines.get(str(section), 1)}: "
        if not isinstance(values, dict):
            raise ConfigError(f"{where}{section}: expected a mapping of fields")
        for name, value in values.items():
            key = f"{section}.{name}"
            _set(cfg, key, value, f"{cfg_path}:{lines.get(key, 1)}: ")
    # Relative data paths in a file are relative to that file.
    for name in ("train", "eval"):
        value = getattr(cfg.data, name)
        if value is not None and not Path(value).is_absolute():
            setattr(cfg.data, name, str(base / value))
    for item in overrides or []:
        key, value = parse_override(item)
        _set(cfg, key, value, "override ")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> list[str]:
    """Cross-field checks: raises ConfigError when invalid, returns warnings for risky settings."""
    t, d, m = cfg.train, cfg.data, cfg.method
    positive = {
        "train.max_steps": t.max_steps,
        "train.micro_batch_size": 1 if t.micro_batch_size == "auto" else t.micro_batch_size,
        "train.grad_accum": t.grad_accum,
        "train.keep_last": t.keep_last,
        "train.eval_batch_size": t.eval_batch_size,
        "train.max_new_tokens": t.max_new_tokens,
        "data.max_seq_len": d.max_seq_len,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if t.micro_batch_size == "auto" and (t.global_batch_size or 0) < 1:
        raise ConfigError(
            "train.micro_batch_size=auto needs train.global_batch_size (rows per optimizer "
            "step, >= 1); the planner splits it into micro-batch x grad_accum"
        )
    if t.memory_budget is not None:
        from leantune.memory.planner import parse_size

        try:
            parse_size(t.memory_budget)
        except ValueError as e:
            raise ConfigError(f"train.memory_budget: {e}") from e
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
    if t.kl_coef > 0 and m.name in ("full", "freeze"):
        raise ConfigError(
            f"train.kl_coef needs an adapter method (lora, dora, ia3), not method.name={m.name}: "
            "the base is the same model with its adapters disabled"
        )
    if t.weight_decay < 0 or t.max_grad_norm < 0:
        raise ConfigError("train.weight_decay and train.max_grad_norm must be >= 0")
    if d.train is None:
        raise ConfigError("data.train: required; set it to a JSONL file (data.train=path.jsonl)")
    for key, file in (("data.train", d.train), ("data.eval", d.eval)):
        if file is not None and not Path(file).is_file():
            raise ConfigError(f"{key}: file {file} does not exist")
    if t.eval_exact_match and (d.eval is None or d.format == "text"):
        raise ConfigError(
            "train.eval_exact_match: needs data.eval and a chat or alpaca data.format"
        )
    if t.precision == "fp16" and t.device == "cpu":
        raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); use bf16 on CPU")
    if m.last_blocks < 0:
        raise ConfigError(f"method.last_blocks: must be >= 0, got {m.last_blocks}")
    if m.name == "freeze" and m.last_blocks == 0 and not m.norms:
        raise ConfigError("method.name=freeze trains nothing: set method.last_blocks or norms")
    if m.r is not None and m.r < 1:
        raise ConfigError(f"method.r: must be >= 1, got {m.r}")
    if m.dropout is not None and not 0 <= m.dropout < 1:
        raise ConfigError(f"method.dropout: must be in [0, 1), got {m.dropout}")
    warnings: list[str] = []
    lr = t.lr
    if m.name == "full" and lr is not None and lr >= 1e-4:
        warnings.append(
            f"train.lr={lr:g} is high for full fine-tuning; the usual range is 1e-5..5e-5"
        )
    if m.name in ("lora", "dora") and m.r is not None and m.r > 64:
        warnings.append(f"method.r={m.r}: LoRA ranks above 64 rarely help; 8..64 is usual")
    if t.max_steps >= 30 and 0 < t.warmup_ratio < 0.03:
        warnings.append(f"train.warmup_ratio={t.warmup_ratio:g} is short; 0.03..0.1 is usual")
    return warnings


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
