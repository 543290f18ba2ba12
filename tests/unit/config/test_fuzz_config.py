"""Fuzzing the config: arbitrary YAML documents, values for every field of
every section, dotted overrides and raw bytes go through `load_config` and `leantune validate`.

Each gives a valid config or a ConfigError (exit 2) that names the field (and, from a file, the
line holding it); never another exception, never a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import run_cli

from leantune.config import Config, ConfigError
from leantune.training.checks import check_config, load_config

# LEANTUNE_FUZZ_EXAMPLES=5000 searches harder (the default keeps this file to a few seconds).
EXAMPLES = int(os.environ.get("LEANTUNE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the first example imports torch (optimizer checks)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SECTIONS: dict[str, dict[str, Any]] = {
    f.name: typing.get_type_hints(f.default_factory)  # type: ignore[arg-type]
    for f in dataclasses.fields(Config)
}


def _all_keys() -> set[str]:
    keys = {f"{s}.{name}" for s, fields in SECTIONS.items() for name in fields}
    for section, fields in SECTIONS.items():
        for name, tp in fields.items():
            for option in typing.get_args(tp):
                if dataclasses.is_dataclass(option):
                    keys |= {f"{section}.{name}.{k}" for k in typing.get_type_hints(option)}
    return keys


ALL_KEYS = _all_keys()
KEY_RE = re.compile(r"\b(?:" + "|".join(SECTIONS) + r")\.[a-z_]+")

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
EDGE_INTS = st.sampled_from(
    [-1, 0, 1, 2, 3, 20, 128, 2**16, 2**16 + 1, 2**20, 2**20 + 1, 2**32, 2**63 - 1, 2**63, 2**64]
)
NUMBER_TEXT = st.sampled_from(
    ["nan", "NaN", "inf", "-inf", ".inf", "1e999", "-1e999", "2e-4", "1e-3", "0", "-0.0", "abc"]
)
PATH_TEXT = st.sampled_from(["", "/no/such/file.jsonl", "x" * 300, "x" * 5000, "a\x00b", "."])


def _value(tp: Any) -> st.SearchStrategy[Any]:
    """Values for a field annotated `tp`: plausible ones, boundary ones and arbitrary JSON."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        own: st.SearchStrategy[Any] = st.one_of(
            *[st.none() if a is type(None) else _value(a) for a in args]
        )
    elif origin is Literal:
        own = st.sampled_from(args)
    elif origin is list:
        own = st.lists(_value(args[0]), max_size=4) | st.text(max_size=20)
    elif dataclasses.is_dataclass(tp):
        fields = typing.get_type_hints(tp)
        own = st.fixed_dictionaries(
            {}, optional={k: _value(t) for k, t in fields.items()}
        ) | st.dictionaries(st.text(max_size=6) | st.integers(), JSON, max_size=3)
    elif tp is bool:
        own = st.booleans()
    elif tp is int:
        own = st.integers(-3, 70) | EDGE_INTS | st.integers()
    elif tp is float:
        own = st.floats(allow_nan=True, allow_infinity=True) | NUMBER_TEXT | st.integers()
    else:  # str
        own = st.text(max_size=24) | PATH_TEXT | NUMBER_TEXT
    return own | JSON


SECTION_DOCS = st.fixed_dictionaries(
    {},
    optional={
        section: st.fixed_dictionaries({}, optional={k: _value(t) for k, t in fields.items()})
        for section, fields in SECTIONS.items()
    },
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz_config")
    (out / "train.jsonl").write_text('{"text": "hello"}\n')
    return out


def _check_outcome(path: Path | None, run: typing.Callable[[], Config]) -> None:
    """`run` gives a config that validates, or a ConfigError naming a field (and its line)."""
    try:
        cfg = run()
    except ConfigError as e:
        message = str(e)
        located = re.match(rf"{re.escape(str(path))}:(\d+): ", message) if path else None
        if located:  # from the file: the named line holds the field the message names
            name = message[located.end() :].split(": ", 1)[0]
            if name in ALL_KEYS or name in SECTIONS:
                line = path.read_text(encoding="utf-8").splitlines()[int(located.group(1)) - 1]  # type: ignore[union-attr]
                assert any(part in line for part in name.split(".")), (message, line)
            else:
                assert name, message
        elif path is None or not message.startswith(f"{path}: "):
            # validate's cross-field checks and overrides name the field
            assert any(k in message for k in ALL_KEYS) or message.startswith("override "), message
        return
    assert all(isinstance(w, str) for w in check_config(cfg))


@FUZZ
@given(doc=SECTION_DOCS)
def test_every_field_of_every_section_from_a_file(workdir: Path, doc: dict[str, Any]) -> None:
    doc.setdefault("data", {}).setdefault("train", "train.jsonl")
    path = workdir / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    _check_outcome(path, lambda: load_config(path))


@FUZZ
@given(doc=JSON)
def test_arbitrary_yaml_documents(workdir: Path, doc: Any) -> None:
    path = workdir / "any.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    _check_outcome(path, lambda: load_config(path))


@FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_arbitrary_yaml_text(workdir: Path, text: str) -> None:
    path = workdir / "text.yaml"
    path.write_text(text, encoding="utf-8")
    _check_outcome(path, lambda: load_config(path))


@FUZZ
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(workdir: Path, raw: bytes) -> None:
    path = workdir / "bytes.yaml"
    path.write_bytes(raw)
    _check_outcome(path, lambda: load_config(path))


YAML_SNIPPETS = st.sampled_from(
    [
        *(".nan", ".inf", "-.inf", "[", "{a: [}", "{type: yarn, factor: .nan}", "!!python/x {}"),
        *("&a [*a]", "{a: 1, a: 2}", "null", "~", "[1, 2]", "{}", "1" * 5000, "'", '"\\x"'),
    ]
)
OVERRIDE_KEYS = st.sampled_from(sorted(ALL_KEYS)) | st.text(max_size=12).filter(
    lambda k: "=" not in k
)
OVERRIDE_VALUES = (
    st.text(max_size=30)
    | YAML_SNIPPETS
    | NUMBER_TEXT
    | JSON.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip())
)


@FUZZ
@given(pairs=st.lists(st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES), min_size=1, max_size=3))
def test_arbitrary_overrides_through_load_config(pairs: list[tuple[str, str]]) -> None:
    overrides = [f"{k}={v}" for k, v in pairs]
    _check_outcome(None, lambda: load_config(None, overrides))


@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
@given(pairs=st.lists(st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES), min_size=1, max_size=3))
def test_arbitrary_overrides_through_leantune_validate(pairs: list[tuple[str, str]]) -> None:
    result = run_cli(["validate", *(f"{k}={v}" for k, v in pairs)])  # fails on a traceback
    assert result.code in (0, 2), result
    if result.code == 0:
        assert "is valid" in result.out
    elif any(f"{k}={v}".startswith("-") and " " not in f"{k}={v}" for k, v in pairs):
        # An argument that starts with '-' is an option to argparse, which prints its usage
        # and its own "leantune: error: ..." line (exit 2): unrecognized arguments: -=.
        # (One with a space in it is a positional to argparse: our own error names it.)
        assert result.err.startswith("usage: leantune") and ": error: " in result.err, result
    else:
        assert result.err.startswith("error: "), result


FIELD_VALUES = st.sampled_from(
    [(s, name, tp) for s, fields in SECTIONS.items() for name, tp in fields.items()]
).flatmap(lambda f: st.tuples(st.just(f), _value(f[2])))


@FUZZ
@given(items=st.lists(FIELD_VALUES, min_size=1, max_size=4))
def test_validate_on_configs_built_in_code(workdir: Path, items: list[Any]) -> None:
    """Fields set directly (no parsing) with values of their own type: validate alone decides."""
    base = [f"data.train={workdir / 'train.jsonl'}", "data.eval=null", "data.format=text"]
    cfg = load_config(None, [*base, "train.eval_exact_match=false"])
    for (section, name, tp), value in items:
        if not _has_type(value, tp):
            continue
        setattr(getattr(cfg, section), name, value)
    _check_outcome(None, lambda: (check_config(cfg), cfg)[1])


def _has_type(value: Any, tp: Any) -> bool:
    """True when `value` is a plain instance of `tp` (what code, not a parser, might set)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(tp) and isinstance(value, str)
    if origin is list:
        item = typing.get_args(tp)[0]
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if tp is float:
        return isinstance(value, float)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type) and not dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    return False
