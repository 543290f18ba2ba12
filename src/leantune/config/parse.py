"""The config parser's generic half: YAML text to data, and values checked against annotations.

`load_yaml` reads one document with the line of every key, refusing duplicated keys and alias
bombs. `check_value` coerces a value to a dataclass field's annotated type (numbers must be
finite, integers fit 64 bits). Every failure is a :class:`ParseError` whose message names where
it is (file, line, field); `leantune.config`, which knows the config sections, turns it into a
`ConfigError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

import yaml

from leantune.errors import UserError

_MERGE_TAG = "tag:yaml.org,2002:merge"  # the tag of a `<<:` key
ALIAS_EXPANSION = 1 << 20
"""Nodes plus scalar characters that aliases (`*name`, `<<: *name`) may add to a document
written out in full: a config that reuses a block a few times adds kilobytes; an alias bomb
adds billions."""


class ConfigError(ValueError, UserError):
    """A config value is missing, unknown or invalid; the message names the field and the fix."""


class MissingPackage(ConfigError):
    """A setting needs an optional package that is not installed: `install` installs it."""

    def __init__(self, message: str, install: str) -> None:
        super().__init__(message)
        self.install = install


class ParseError(ValueError):
    """A config text or value cannot be used; the message names the file, line or field."""


def load_yaml(text: str, where: str) -> tuple[Any, dict[str, int]]:
    """Parse one YAML document; returns its data and `key.subkey` -> 1-based line of each key.

    Args:
        text: the YAML text.
        where: how messages name the text (a file name, or `override train.lr=...`).

    Raises:
        ParseError: invalid YAML, a duplicated key, or nesting too deep to parse.
    """
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # refuses non-printable characters
        # Composed, not yet constructed: the checks walk the node graph, where an alias is one
        # shared node (not a copy) and every key still carries its line.
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            # A few hundred bytes of aliases ("billion laughs") can stand for hundreds of
            # millions of values that every later walk (a check, a message, JSON) visits one by
            # one: refuse them before anything is built.
            _check_expansion(node, len(text), where)
            # safe_load would keep a duplicated key's last value silently.
            _check_keys(node, "", lines, where, set())
        return (loader.construct_document(node) if node is not None else None), lines
    except ParseError:
        raise
    except yaml.YAMLError as e:
        raise ParseError(f"{where}: invalid YAML: {e}") from None
    except RecursionError:  # nesting deeper than Python's recursion limit
        raise ParseError(f"{where}: invalid YAML: nested too deeply") from None
    except ValueError as e:  # e.g. an integer longer than Python converts (4300 digits)
        raise ParseError(f"{where}: invalid YAML: {e}") from None
    finally:
        if loader is not None:
            loader.dispose()  # PyYAML's parser state refers to itself; this breaks the cycle


def _check_expansion(node: yaml.Node, text_size: int, where: str) -> None:
    """Refuse a document that, its aliases written out, is far larger than its text."""
    # Without aliases the count stays under twice the text's length (each node and character
    # comes from the text), so only what aliases add can reach the bound.
    limit = 2 * text_size + ALIAS_EXPANSION
    if _expanded_size(node, {}) > limit:
        raise ParseError(
            f"{where}: its aliases (*name, <<: *name) expand it to more than {limit:,} values "
            "and characters (an alias bomb?); write the repeated values out, or repeat fewer"
        )


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes plus scalar characters of `node` with every alias written out, each distinct node
    counted once (`sizes`, by id): time linear in the text, however far it expands."""
    known = sizes.get(id(node))
    if known is not None:
        if known < 0:
            raise ValueError("an alias inside its own anchor repeats without end")
        return known
    sizes[id(node)] = -1  # in progress: meeting it again below means a cycle
    if isinstance(node, yaml.ScalarNode):
        size = 1 + len(node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(item, sizes) for item in node.value)
    else:
        size = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


def _check_keys(
    node: yaml.Node, prefix: str, lines: dict[str, int], where: str, seen: set[int]
) -> None:
    """Record each mapping key's line under `prefix`; refuse a key given twice in one mapping."""
    if id(node) in seen:  # an alias: its node was checked where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_keys(item, f"{prefix}[{i}].", lines, where, seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first: dict[str, int] = {}
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
            key = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if key in first:
                raise ParseError(
                    f"{where}:{line}: {key}: duplicated key (first on line {first[key]}); "
                    "keep one of them"
                )
            first[key] = line
            lines.setdefault(key, line)
            _check_keys(value_node, f"{key}.", lines, where, seen)
        # A merge key (<<: *defaults) brings keys checked where they were defined; a complex
        # (non-scalar) key is refused when the document is constructed.


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field of the dataclass `cls`."""
    return typing.get_type_hints(cls)


INT_LIMIT = 2**63 - 1
"""Largest magnitude of an integer field: torch, numpy and safetensors take 64-bit integers."""


def shorten(text: str, limit: int = 80) -> str:
    """`text`, cut to about `limit` characters: a message must stay readable whatever was given."""
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def show(value: Any) -> str:
    """`repr(value)`, shortened."""
    return shorten(repr(value))


def _check_number(key: str, value: Any) -> float:
    """A finite float from a number or numeric string, or ParseError naming `key`."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = math.inf
    elif isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ParseError(f"{key}: expected a number, got {show(value)}")
    # NaN passes every range check (all its comparisons are false) and inf trains NaN weights.
    if not math.isfinite(number):
        raise ParseError(f"{key}: must be a finite number, got {show(value)}")
    return number


def check_value(key: str, value: Any, tp: Any) -> Any:
    """Coerce `value` to the annotated type `tp` or raise ParseError naming `key`."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        # The first option that accepts the value wins; on failure the first option's message
        # is shown, as annotations list the main type first (int | Literal["auto"]).
        for option in options:
            if option is type(None):
                continue
            try:
                return check_value(key, value, option)
            except ParseError as e:
                errors.append(str(e))
        raise ParseError(errors[0] if errors else f"{key}: invalid value {show(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _check_mapping(key, value, tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ParseError(f"{key}: {show(value)} is not one of {' | '.join(map(str, choices))}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        # A command-line override gives a list as one string: data.clean=html,nfkc
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ParseError(f"{key}: expected a list, got {show(value)}")
        return [check_value(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        # Only a YAML boolean: 1 or the string "false" must not pass as a truth value.
        if isinstance(value, bool):
            return value
        raise ParseError(f"{key}: expected true or false, got {show(value)}")
    if tp is int:
        # bool is a subclass of int, but `true` is not a count.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ParseError(f"{key}: expected an integer, got {show(value)}")
        if not -INT_LIMIT <= value <= INT_LIMIT:
            raise ParseError(
                f"{key}: must be between -(2**63 - 1) and 2**63 - 1, got {show(value)}"
            )
        return value
    if tp is float:
        return _check_number(key, value)
    if tp is str:
        # YAML reads an unquoted 123 or 1.5 as a number; a string field takes its text.
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ParseError(f"{key}: expected a string, got {show(value)}")
    raise ParseError(f"{key}: unsupported type {tp}")


def _check_mapping(key: str, value: Any, cls: type) -> Any:
    """Build the nested dataclass `cls` from a mapping, checking every key like a field."""
    if isinstance(value, cls):
        return value
    types_ = field_types(cls)
    if not isinstance(value, dict):
        raise ParseError(
            f"{key}: expected a mapping with keys {', '.join(types_)}, got {show(value)}"
        )
    unknown = sorted(str(k) for k in value if k not in types_)  # keys may be of any type
    if unknown:
        raise ParseError(
            f"{key}: unknown key(s) {shorten(', '.join(unknown))}; valid: {', '.join(types_)}"
        )
    # Fields without a default (model.rope_scaling's type and factor) must be given.
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in value]
    if missing:
        raise ParseError(f"{key}: missing {', '.join(missing)}")
    return cls(**{k: check_value(f"{key}.{k}", v, types_[k]) for k, v in value.items()})


def set_nested_field(obj: Any, sub: str, name: str, value: Any, key: str) -> None:
    """Set `obj.sub.name` where `obj.sub` is a nested section (a dataclass, or None for one
    that is off: it starts from its defaults); `key` names the setting in messages.

    Raises:
        ParseError: `sub` is not a nested section, `name` not one of its fields, a value of the
            wrong type, or an unset section whose required keys must be given together.
    """
    tp = field_types(type(obj)).get(sub)
    # An optional section is annotated `Section | None`: find the dataclass among the members.
    nested = [
        t for t in get_args(tp) or (tp,) if isinstance(t, type) and dataclasses.is_dataclass(t)
    ]
    if not nested:
        raise ParseError(f"{key}: unknown key; '{sub}' is not a section with fields")
    cls = nested[0]
    types_ = field_types(cls)
    if name not in types_:
        raise ParseError(f"{key}: unknown field; valid: {', '.join(types_)}")
    current = getattr(obj, sub)
    if current is None:
        try:
            current = cls()
        except TypeError:  # it has required keys: they come together, as one mapping
            example = ", ".join(f"{k}: ..." for k in types_)
            raise ParseError(f"{key}: its section is unset; give it whole: {{{example}}}") from None
    setattr(obj, sub, dataclasses.replace(current, **{name: check_value(key, value, types_[name])}))


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
# A bare letter (24G, as in `leantune plan --budget 24G`) is binary, like ulimit and docker.
_SIZE_UNITS.update({"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40})


def memory_size(text: str, key: str = "memory size") -> int:
    """Bytes in a size such as "20GiB", "512 MiB", "1.5GB" or "1000000" (binary and SI units).

    Raises:
        ParseError: not a positive size, naming `key`.
    """
    raw = text.strip().lower().replace(" ", "")
    # The unit is the trailing letters; an unknown one fails the lookup below.
    number = raw.rstrip("kmgtib")
    unit = raw[len(number) :]
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        value = math.nan
    if not math.isfinite(value):  # float() also reads "nan", "inf" and "1e999"
        raise ParseError(
            f"{key}: {show(text)} is not a memory size; write e.g. 20GiB, 512MiB or 1.5GB"
        ) from None
    if value < 1:
        raise ParseError(f"{key}: must be positive, got {text!r}")
    return int(value)
