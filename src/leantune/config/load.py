"""Loading a config: a YAML file and `section.field=value` overrides over the defaults.

`read_config(path, overrides)` parses, applies the overrides, resolves relative data paths
against the config file's folder and runs `config.validate`. Every error names the field (and
the YAML line when it came from a file) and what would be valid.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml

from leantune.config.parse import (
    ConfigError,
    ParseError,
    check_value,
    field_types,
    load_yaml,
    set_nested_field,
    shorten,
    show,
)
from leantune.config.schema import DEMO_CONFIG, Config
from leantune.config.validate import validate


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
            # The message names the key and the fix; the parser's traceback adds nothing.
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
    # Only the first '=' splits: a value may hold one (a URL with a query).
    key, raw = text.split("=", 1)
    # `section.key=` unsets an optional field.
    if not raw.strip():
        return key.strip(), None
    try:
        value, _ = load_yaml(raw, f"override {shorten(text)}")
    except ParseError as e:
        # Only the value was parsed as YAML: say so, or the user looks for a broken file.
        raise ConfigError(str(e).replace(": invalid YAML:", ": invalid YAML value:", 1)) from None
    return key.strip(), value


def _read_config_file(cfg_path: Path) -> str:
    """The text of a config file, or ConfigError saying why it cannot be read."""
    try:
        # Checked first: reading a directory or a missing file raises OSErrors whose messages
        # say less than these.
        if cfg_path.is_dir():
            raise ConfigError(f"config file {cfg_path} is a directory; give a YAML file")
        if not cfg_path.is_file():
            raise ConfigError(f"config file {cfg_path} does not exist")
        raw = cfg_path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {cfg_path}: cannot be read ({e.strerror})") from None
    # Decoded here rather than by read_text, so the message can name the byte and its offset.
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
    # Naming the training data means a run on the user's data, not a variation of the demo.
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


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a Config from a YAML file and overrides, checked within and across its fields
    (`config.validate`; the registries' checks are `training.checks.load_config`'s).

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
    # The overrides apply after the file, so the command line wins over it.
    for item in overrides or []:
        key, value = parse_override(item)
        _set(cfg, key, value, "override ")
    # Once, on the final values: a file may hold a combination an override then fixes.
    validate(cfg)
    return cfg


def _apply_file(cfg: Config, cfg_path: Path) -> None:
    """Set every field a YAML config file gives; relative data paths are the file's."""
    text = _read_config_file(cfg_path)
    try:
        data, lines = load_yaml(text, str(cfg_path))
    except ParseError as e:
        raise ConfigError(str(e)) from None
    data = {} if data is None else data  # an empty file (or only comments): the base as is
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_path}: expected a mapping of sections at the top level")
    # Absolute, so the paths saved with the run hold from any working directory.
    base = cfg_path.parent.resolve()
    sections = [f.name for f in dataclasses.fields(Config)]
    for section, values in data.items():
        # Line 1 for a key YAML reads as a non-string (true, 1): `lines` holds the key's text.
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
        # A template name (chatml) stays a name unless a file of that name is beside the config.
        if name != "chat_template" or (base / value).is_file():
            setattr(cfg.data, name, str(base / value))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (saved with every run and checkpoint)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML."""
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
