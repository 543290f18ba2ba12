"""Config parsing, overrides and validation errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantune.config import (
    DEMO_CONFIG,
    ConfigError,
    field_docs,
    parse_override,
)
from leantune.training.checks import check_config, load_config

REPO = Path(__file__).resolve().parents[3]


def _write(tmp_path: Path, text: str, data: bool = True) -> Path:
    if data:
        (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_demo_config_is_valid_and_resolves_packaged_data() -> None:
    cfg = load_config(None)
    assert cfg.model.path == "smollm2-135m-instruct"
    assert cfg.method.name == "lora"
    assert cfg.data.train is not None and Path(cfg.data.train).is_file()
    assert cfg.data.eval is not None and Path(cfg.data.eval).is_file()
    assert cfg.train.eval_exact_match


def test_every_shipped_config_validates() -> None:
    configs = sorted((REPO / "src").rglob("*.yaml")) + sorted((REPO / "examples").rglob("*.yaml"))
    assert DEMO_CONFIG in configs
    for path in configs:
        load_config(path)


def test_overrides_apply_to_any_field_with_types() -> None:
    cfg = load_config(
        None,
        [
            "train.lr=2e-4",
            "train.max_steps=7",
            "train.micro_batch_size=3",
            "train.grad_accum=2",
            "train.precision=bf16",
            "train.seed=5",
            "train.save_every=0",
            "method.name=full",
            "method.target_modules=[q_proj, v_proj]",
            "run.dir=/tmp/x",
            "run.resume=never",
            "data.format=chat",
            "model.path=/some/model",
        ],
    )
    assert cfg.train.lr == pytest.approx(2e-4)
    assert (cfg.train.max_steps, cfg.train.micro_batch_size, cfg.train.grad_accum) == (7, 3, 2)
    assert cfg.train.precision == "bf16" and cfg.train.seed == 5 and cfg.train.save_every == 0
    assert cfg.method.name == "full" and cfg.method.target_modules == ["q_proj", "v_proj"]
    assert cfg.run_dir == Path("/tmp/x") and cfg.run.resume == "never"
    assert cfg.model.path == "/some/model"


def test_relative_data_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "data:\n  train: train.jsonl\n  format: text\n")
    cfg = load_config(path)
    assert cfg.data.train == str(tmp_path.resolve() / "train.jsonl")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.lr=abc", "train.lr: expected a number"),
        ("train.max_steps=0", "train.max_steps: must be >= 1"),
        ("train.precision=fp8", "train.precision: 'fp8' is not one of auto | fp32 | bf16 | fp16"),
        ("method.name=magic", "method.name: 'magic' is not one of"),
        ("train.nope=1", "unknown field of 'train'; valid:"),
        ("nope.x=1", "unknown key"),
        ("data.train=/does/not/exist.jsonl", "data.train: file /does/not/exist.jsonl does not"),
        ("train.gradient_checkpointing=maybe", "expected true or false"),
        ("data.max_bad_fraction=2", "data.max_bad_fraction: must be in [0, 1]"),
        ("train.precision=fp16", None),
    ],
)
def test_override_errors_name_the_field(override: str, needle: str | None) -> None:
    if needle is None:  # fp16 is valid when the device may be CUDA
        load_config(None, [override, "train.device=auto"])
        with pytest.raises(ConfigError, match="needs CUDA"):
            load_config(None, [override, "train.device=cpu"])
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_yaml_errors_name_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "data:\n  train: train.jsonl\n  format: text\ntrain:\n  lr: fast\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:5: train.lr: expected a number" in str(err.value)
    path = _write(tmp_path, "data:\n  train: train.jsonl\n  fromat: text\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:3: data.fromat: unknown field" in str(err.value)


def test_missing_train_file_and_exact_match_needs_eval(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: x\n", data=False)
    with pytest.raises(ConfigError, match=r"data\.train: required"):
        load_config(path)
    path = _write(
        tmp_path, "data:\n  train: train.jsonl\n  format: chat\ntrain:\n  eval_exact_match: true\n"
    )
    with pytest.raises(ConfigError, match=r"train\.eval_exact_match: needs data\.eval"):
        load_config(path)


def test_risky_settings_warn() -> None:
    cfg = load_config(None, ["method.name=full", "train.lr=3e-4", "train.warmup_ratio=0.01"])
    warnings = check_config(cfg)
    assert any("high for full fine-tuning" in w for w in warnings)
    assert any("warmup_ratio" in w for w in warnings)
    assert check_config(load_config(None)) == []


def test_parse_override_values() -> None:
    assert parse_override("train.lr=2e-4") == ("train.lr", "2e-4")  # coerced by the field type
    assert parse_override("run.resume=never") == ("run.resume", "never")
    assert parse_override("data.eval=null") == ("data.eval", None)
    with pytest.raises(ConfigError):
        parse_override("train.lr")


def test_every_field_is_documented() -> None:
    docs = field_docs()
    for key in ("model.path", "data.train", "train.grad_accum", "run.resume", "method.r"):
        assert docs[key]


# ---------------------------------------------------------------------------------------------
# Values that would train wrongly or crash later are refused up front


def _float_fields() -> list[str]:
    """Every `section.field` (and nested `section.field.key`) whose type admits a float."""
    import dataclasses
    import typing

    from leantune.config import Config

    def walk(cls: type, prefix: str) -> list[str]:
        found: list[str] = []
        for name, tp in typing.get_type_hints(cls).items():
            options = typing.get_args(tp) or (tp,)
            if float in options:
                found.append(f"{prefix}{name}")
            for option in options:
                if isinstance(option, type) and dataclasses.is_dataclass(option):
                    found += walk(option, f"{prefix}{name}.")
        return found

    return [k for f in dataclasses.fields(Config) for k in walk(f.default_factory, f"{f.name}.")]  # type: ignore[arg-type]


FLOAT_FIELDS = [
    "model.rope_scaling.factor",
    "data.max_bad_fraction",
    "data.near_dup_threshold",
    "data.partition_mb",
    "method.dropout",
    "train.lr",
    "train.weight_decay",
    "train.warmup_ratio",
    "train.min_lr_ratio",
    "train.max_grad_norm",
    "train.kl_coef",
    "guard.loss_sigmas",
    "guard.loss_min_ratio",
    "guard.grad_sigmas",
    "guard.grad_min_ratio",
    "guard.lr_factor",
    "dist.timeout_s",
    "preference.beta",
    "preference.label_smoothing",
    "preference.sft_weight",
    "preference.simpo_gamma",
    "preference.orpo_lambda",
    "preference.desirable_weight",
    "preference.undesirable_weight",
]


def test_the_non_finite_cases_cover_every_float_field() -> None:
    assert sorted(_float_fields()) == sorted(FLOAT_FIELDS)


def _yaml_for(key: str, value: str) -> str:
    """A config setting `key` (two or three levels) to the YAML scalar `value`, on line 5."""
    parts = key.split(".")
    head = "data:\n  train: train.jsonl\n  format: text\n"
    if parts[0] == "data":
        return head + f"  {parts[1]}: {value}\n"
    if len(parts) == 3:  # model.rope_scaling.factor
        return head + f"{parts[0]}:\n  {parts[1]}: {{type: linear, {parts[2]}: {value}}}\n"
    return head + f"{parts[0]}:\n  {parts[1]}: {value}\n"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1e999", "-1e999"])
@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_non_finite_numbers_are_refused_in_files(tmp_path: Path, key: str, value: str) -> None:
    # Today weight_decay=.inf trains NaN weights, and a NaN max_grad_norm or kl_coef silently
    # turns clipping or the KL term off (every comparison with NaN is false).
    path = _write(tmp_path, _yaml_for(key, value))
    line = 4 if key.startswith("data.") else 5
    with pytest.raises(ConfigError) as err:
        load_config(path)
    field = key.rsplit(".", 1)[0] if key.count(".") == 2 else key
    assert f"{path}:{line}: {field}" in str(err.value)
    assert key in str(err.value) and "finite" in str(err.value)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "nan", "inf", "1e999", "1" + "0" * 400])
@pytest.mark.parametrize("key", [k for k in FLOAT_FIELDS if k.count(".") == 1])
def test_non_finite_numbers_are_refused_in_overrides(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"])
    assert f"override {key}: must be a finite number" in str(err.value)


def test_non_finite_rope_factor_override_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.factor: must be a finite"):
        load_config(None, ["model.rope_scaling={type: yarn, factor: .nan}"])


@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_validate_refuses_non_finite_values_set_in_code(key: str) -> None:
    import math

    from leantune.config import RopeScalingConfig

    cfg = load_config(None)
    cfg.model.rope_scaling = RopeScalingConfig("linear", 2.0)
    *path, name = key.split(".")
    obj: object = cfg
    for part in path:
        obj = getattr(obj, part)
    for bad in (math.nan, math.inf, -math.inf):
        setattr(obj, name, bad)
        with pytest.raises(ConfigError, match=rf"{key}: must be a finite number"):
            check_config(cfg)


def test_duplicated_yaml_keys_name_the_key_and_both_lines(tmp_path: Path) -> None:
    # Today the second value silently wins.
    path = _write(
        tmp_path,
        "data:\n  train: train.jsonl\n  format: text\ntrain:\n  lr: 1e-4\n"
        "  max_steps: 3\n  lr: 1e-3\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:7: train.lr: duplicated key (first on line 5)" == str(err.value).split(";")[0]
    path = _write(
        tmp_path,
        "train:\n  lr: 1e-4\ndata:\n  train: train.jsonl\n  format: text\ntrain:\n  max_steps: 3\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:6: train: duplicated key (first on line 1)" == str(err.value).split(";")[0]
    path = _write(
        tmp_path,
        "data:\n  train: train.jsonl\n  format: text\nmodel:\n"
        "  rope_scaling:\n    type: yarn\n    factor: 2\n    factor: 4\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(
        f"{path}:8: model.rope_scaling.factor: duplicated key (first on line 7)"
    )


def test_a_yaml_merge_key_is_not_a_duplicate(tmp_path: Path) -> None:
    path = _write(tmp_path, "base: &b\n  lr: 1e-4\n")  # written over below; only the data file
    path.write_text(
        "data:\n  train: train.jsonl\n  format: text\n"
        "train: &t\n  lr: 1.0e-4\n  max_steps: 3\nguard:\n  window: 64\n"
    )
    assert load_config(path).train.lr == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        # Would crash or exhaust memory later: torch seeds are 64-bit, packing allocates per
        # token of max_seq_len, and the sample order is built per optimizer step.
        ("train.seed=18446744073709551616", "train.seed: must be between"),
        ("train.seed=100000000000000", "train.seed: must be in"),
        ("data.max_seq_len=1000000000", "data.max_seq_len: must be <= 1048576"),
        ("train.micro_batch_size=1000000000", "train.micro_batch_size: must be <= 1048576"),
        ("train.grad_accum=1000000000", "train.grad_accum: must be <= 1048576"),
        ("train.micro_batch_size=2048", None),
        ("method.r=1000000000", "method.r: must be <= 65536"),
        ("method.num_virtual_tokens=1000000000", "method.num_virtual_tokens: must be <= 65536"),
        ("method.prefix_hidden_size=1000000000", "method.prefix_hidden_size: must be <= 65536"),
        ("train.max_steps=" + "9" * 30, "train.max_steps: must be between -(2**63 - 1) and"),
        ("guard.window=" + "9" * 30, "guard.window: must be between"),
        ("train.memory_budget=nan", "train.memory_budget: 'nan' is not a memory size"),
        ("train.memory_budget=inf", "train.memory_budget: 'inf' is not a memory size"),
        ("train.memory_budget=1e999GiB", "train.memory_budget: '1e999GiB' is not a memory size"),
        ("train.lr=[", "override train.lr=[: invalid YAML value"),
        ("train.lr={a: [}", "override train.lr={a: [}: invalid YAML value"),
        ("model.rope_scaling={1: a, b: c}", "model.rope_scaling: unknown key(s) 1, b"),
        ("data.train=" + "x" * 5000, "data.train: file xxxxxxxx"),
    ],
)
def test_values_that_would_crash_later_are_refused(override: str, needle: str | None) -> None:
    if needle is None:
        load_config(None, [override, "train.grad_accum=512"])
        with pytest.raises(ConfigError, match="rows per optimizer step"):
            load_config(None, [override, "train.grad_accum=1024"])
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_unreadable_config_files_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"train:\n  lr: 1e-4 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}: not UTF-8 text"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a directory"):
        load_config(tmp_path)
    deep = tmp_path / "deep.yaml"
    deep.write_text("train:\n  lr: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{deep}: invalid YAML: nested too deeply"):
        load_config(deep)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None, ["train.lr=" + "[" * 100_000])


def test_unknown_sections_and_unprintable_text_are_config_errors(tmp_path: Path) -> None:
    # Cases from tests/unit/config/test_fuzz_config.py: an unknown section is named (not only
    # "expected a mapping of fields"), and a control character is a ConfigError, not a
    # ReaderError.
    path = _write(tmp_path, "'': 1\n")
    with pytest.raises(ConfigError, match=rf"{path}:1: '': unknown section; valid: model, data"):
        load_config(path)
    path = _write(tmp_path, "train:\n  lr: 1e-4\n  seed: \x07\n")
    with pytest.raises(ConfigError, match=rf"{path}: invalid YAML: unacceptable character #x0007"):
        load_config(path)
    path = _write(tmp_path, "data:\n  train: train.jsonl\n  format: text\ntrain:\n  true: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: train.True: unknown field"):
        load_config(path)
