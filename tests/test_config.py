"""Config parsing, overrides and validation errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantune.config import (
    DEMO_CONFIG,
    ConfigError,
    field_docs,
    load_config,
    parse_override,
    validate,
)

REPO = Path(__file__).resolve().parents[1]


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
        ("train.precision=fp8", "train.precision: 'fp8' is not one of fp32 | bf16 | fp16"),
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
    cfg = load_config(None, ["method.name=full", "train.lr=1e-4", "train.warmup_ratio=0.01"])
    warnings = validate(cfg)
    assert any("high for full fine-tuning" in w for w in warnings)
    assert any("warmup_ratio" in w for w in warnings)
    assert validate(load_config(None)) == []


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
