"""`leantune --help` of every command shows every default; `leantune --version`; the list of
config fields with their defaults."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from support import run_cli

import leantune
from leantune.cli.app import build_parser
from leantune.config import Config
from leantune.config.preference import PreferenceConfig


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its name, `bench methods` included."""
    out: dict[str, argparse.ArgumentParser] = {}
    todo = [("", build_parser())]
    while todo:
        name, parser = todo.pop()
        out[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {n}".strip(), p) for n, p in action.choices.items()]
    return out


COMMANDS = _commands()
# Options whose absence is not a default value but "not given" (say what you want).
NOT_GIVEN = {("generate", "--prompt"), ("prepare", "--data"), ("eval", "--data")}


@pytest.mark.parametrize("name", sorted(n for n in COMMANDS if n))
def test_help_shows_every_default(name: str) -> None:
    parser = COMMANDS[name]
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.required:
            continue  # positionals, on/off flags (off unless given), required options
        if (name, action.option_strings[-1]) in NOT_GIVEN:
            continue
        text = formatter._get_help_string(action) or ""
        assert "default" in text, (name, action.option_strings, text)
        if action.default is not None:
            assert "%(default)s" in text or str(action.default) in text, (name, text)
        checked += 1
    if name not in ("train", "validate", "bench"):
        assert checked, f"{name}: no option checked"


@pytest.mark.parametrize("name", sorted(n for n in COMMANDS if n and n != "bench"))
def test_every_command_names_a_function_that_exists(name: str) -> None:
    """`cli.app` imports a command's function by its "module:function" only when it runs: here
    each is found in its module's source, importing nothing."""
    target = COMMANDS[name].get_default("run")
    module, _, function = target.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, target
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert function in defined, target


def test_help_renders_the_values() -> None:
    result = run_cli(["generate", "--help"])
    assert result.code == 0
    flat = " ".join(result.out.split())
    assert "--dtype {fp32,bf16,fp16} dtype of the weights (default: fp32)" in flat
    assert "--seed SEED seeds sampling (default: 0)" in flat
    assert "default: the model's generation_config, else greedy" in flat
    flat = " ".join(run_cli(["eval", "--help"]).out.split())
    assert "(default: 16)" in flat and "(default: 4096)" in flat


def test_version() -> None:
    result = run_cli(["--version"])
    assert result.code == 0
    assert result.out.strip() == f"leantune {leantune.__version__}"


def test_validate_help_fields_lists_every_field_with_its_default() -> None:
    result = run_cli(["validate", "--help-fields"])
    assert result.code == 0, result
    lines = result.out.splitlines()
    cfg = Config()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            value = json.dumps(getattr(getattr(cfg, section.name), f.name), default=str)
            at = lines.index(f"  {key}={value}")  # an override that sets the default
            assert lines[at + 1].strip(), f"{key}: no docstring"


def test_validate_help_fields_lists_the_preference_settings_with_their_objectives() -> None:
    """Every preference.* field and train.objective are listed, each with a doc that names
    the objectives reading it (issue 34: the new settings are covered)."""
    lines = run_cli(["validate", "--help-fields"]).out.splitlines()
    keys = {line.strip().split("=", 1)[0]: n for n, line in enumerate(lines) if "=" in line}
    preference = [f"preference.{f.name}" for f in dataclasses.fields(PreferenceConfig)]
    assert len(preference) >= 8 and "train.objective" in keys
    for key in preference:
        assert key in keys, key
        doc = lines[keys[key] + 1]
        assert any(name in doc for name in ("dpo", "simpo", "orpo", "kto")), (key, doc)
