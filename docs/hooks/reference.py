"""The reference pages, generated from the code at every `mkdocs build` (none is checked in).

- reference/cli.md: every command and subcommand of the parser `leantune` itself builds, with
  every flag, its default and its help;
- reference/config.md: every config field, walked from `Config` through its nested dataclasses,
  with its type, default and the field's own docstring (the text `validate --help-fields` shows);
- reference/metrics.md: every Prometheus metric a run serves, read from the sink's own registry,
  and the metrics.jsonl fields the code names;
- reference/api.md: mkdocstrings renders `leantune.api`.

The modules that own these facts are found by what they define (`build_parser`,
`PrometheusSink`, `TIMING_FIELDS`), not by their path, so a module that moves keeps its page.
tests/integration/test_docs.py calls the page functions in-process; `make docs` builds the site
with them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import re
import tempfile
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

import leantune
from leantune.config import Config, field_roles
from leantune.config.roles import MEANINGS

PACKAGE_DIR = Path(leantune.__file__).parent


# ---------------------------------------------------------------------------------------------
# Shared


def owner(name: str) -> ModuleType:
    """The one leantune module that defines `name` at its top level (class, function or
    constant), imported. Raises LookupError unless exactly one does: the page would be wrong."""
    pattern = re.compile(rf"^(?:class |def )?{re.escape(name)}\b(?=[\s(:=\[])", re.MULTILINE)
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if pattern.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    if len(found) != 1:
        raise LookupError(f"{name}: defined in {found or 'no module'} of leantune; expected one")
    return importlib.import_module(found[0])


def md(text: str) -> str:
    """`text` as Markdown that shows it as written (in a table cell too): the characters
    Markdown reads as markup are escaped outside `code spans`, which stay code."""
    parts = text.split("`")
    # An unpaired backtick opens no code span: what follows it is plain text.
    tail = parts.pop() if len(parts) % 2 == 0 else None
    parts[::2] = [_escape(p) for p in parts[::2]]  # even parts are outside backticks
    return "`".join(parts) + ("" if tail is None else "\\`" + _escape(tail))


def _escape(plain: str) -> str:
    plain = plain.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([|*\[\]])", r"\\\1", plain)


def code(text: str) -> str:
    """`text` as one code span, whatever backticks it holds."""
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# ---------------------------------------------------------------------------------------------
# reference/cli.md


def commands(
    parser: argparse.ArgumentParser, path: str, about: str = ""
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(command line, one-line help, parser) of `parser` and of every subcommand below it."""
    yield path, about, parser
    # argparse has no public way to list a parser's arguments or subparsers: _actions it is.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias names the same parser again
                    seen.add(id(sub))
                    yield from commands(sub, f"{path} {name}", helps.get(name, ""))


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own arguments: options and positionals, not -h/--help or subcommands."""
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


def _invocation(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    elif isinstance(action.metavar, tuple):
        metavar = " ".join(action.metavar)
    else:
        metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if not action.option_strings:
        return metavar + (" ..." if action.nargs in ("*", "+") else "")
    return ", ".join(f"{o} {metavar}" for o in action.option_strings)


def _help(action: argparse.Action, prog: str) -> str:
    """The help as `--help` prints it: %(default)s and the like filled in, as argparse does."""
    params: dict[str, Any] = dict(vars(action), prog=prog)
    params = {k: v for k, v in params.items() if v is not argparse.SUPPRESS}
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    text = action.help or ""
    return " ".join((text % params if "%" in text else text).split())


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or not action.option_strings:
        return ""  # an on/off flag is off unless given; a positional has no default
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""  # the help says what happens without it
    return code(str(action.default))


def _command_section(
    line: str, about: str, parser: argparse.ArgumentParser, subcommands: list[tuple[str, str]]
) -> list[str]:
    out = [f"## {line}", ""]
    described = parser.description or about
    if described:
        out += [md(" ".join(described.split())), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    if subcommands:
        out += ["| Command | What it does |", "|---|---|"]
        out += [f"| [{code(c)}](#{c.replace(' ', '-')}) | {md(h)} |" for c, h in subcommands]
        out.append("")
    rows = flags(parser)
    if rows:
        out += ["| Argument | Default | Help |", "|---|---|---|"]
        out += [
            f"| {code(_invocation(a))} | {_default(a)} | {md(_help(a, parser.prog))} |"
            for a in rows
        ]
        out.append("")
    if parser.epilog:
        out += ["```text", textwrap.dedent(parser.epilog).strip(), "```", ""]
    return out


def cli_page() -> str:
    """reference/cli.md: every command of the `leantune` parser with every flag."""
    parser: argparse.ArgumentParser = owner("build_parser").build_parser()
    found = list(commands(parser, parser.prog))
    out = [
        "# Command line",
        "",
        "Generated from the parser `leantune` builds, so it lists exactly what `leantune "
        "COMMAND --help` shows. Every command also takes `-h`/`--help`.",
        "",
    ]
    for line, about, sub in found:
        below = [(c, h) for c, h, _ in found if c.rsplit(" ", 1)[0] == line]
        out += _command_section(line, about, sub, below)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# reference/config.md


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (whitespace folded)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def nested_dataclasses(hint: Any) -> list[type]:
    """The dataclasses a type hint names (`X`, `X | None`, `list[X]`, ...)."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return [hint]
    return [c for arg in typing.get_args(hint) for c in nested_dataclasses(arg)]


@dataclasses.dataclass(frozen=True)
class FieldRow:
    """One config field as the reference shows it."""

    key: str  # section.field, section.sub.field
    type: str
    default: str  # JSON as `validate --help-fields` prints it; "required" when none
    doc: str
    role: str = ""  # its fingerprint role (config.roles); a nested field's is its section's


def field_rows(cls: type, prefix: str) -> Iterator[tuple[str, list[FieldRow]]]:
    """(section, its fields) for `cls` and then every dataclass nested in it, depth first."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        default = "required" if value is dataclasses.MISSING else _json(value)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        key = f"{prefix}{f.name}"
        rows.append(FieldRow(key, kind, default, docs.get(f.name, ""), role_of(key)))
        nested += [(f"{prefix}{f.name}.", c) for c in nested_dataclasses(hints[f.name])]
    yield prefix.rstrip("."), rows
    for sub_prefix, sub in nested:
        yield from field_rows(sub, sub_prefix)


def role_of(key: str) -> str:
    """The fingerprint role of `key`, or of the section field that holds it (monitor.wandb.x)."""
    roles = field_roles()
    while key not in roles and "." in key:
        key = key.rsplit(".", 1)[0]
    return str(roles.get(key, ""))


def _json(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "(section below)"
    return json.dumps(value, default=str)


def config_fields() -> list[tuple[str, list[FieldRow]]]:
    """Every section of `Config` (nested ones after their parent) with its fields."""
    sections = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        sections += list(field_rows(cls, f"{section.name}."))
    return sections


def config_page() -> str:
    """reference/config.md: every config field with its type, default and docstring."""
    out = [
        "# Configuration",
        "",
        "Generated from the config dataclasses: every field with its type, its default and "
        "the docstring written under it in the code (`leantune validate --help-fields` prints "
        "the same). Set a field in the YAML file under its section, or on the command line as "
        "`section.field=value` (`monitor.wandb.project=x` for a nested one).",
        "",
        "Each field's *resume* column is its fingerprint role (`config.roles`, declared on the "
        "field): what a change to it does to a run that resumes.",
        "",
        "| Role | On resume |",
        "|---|---|",
        *(f"| {code(str(role))} | {md(meaning)} |" for role, meaning in MEANINGS.items()),
        "",
    ]
    for section, rows in config_fields():
        out += [f"## {section}", "", "| Field | Type | Default | Resume | What it means |"]
        out += ["|" + "---|" * 5]
        out += [
            f"| {code(r.key)} | {code(r.type)} | {code(r.default)} | {code(r.role)} | {md(r.doc)} |"
            for r in rows
        ]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# reference/metrics.md

_EXPOSED_SUFFIX = {"counter": "_total", "info": "_info"}


@dataclasses.dataclass(frozen=True)
class MetricRow:
    """One metric family of the /metrics endpoint."""

    name: str  # as a scrape shows it (counters end in _total)
    kind: str
    labels: tuple[str, ...]
    doc: str
    record_field: str  # the metrics.jsonl field it is set from, if any


def prometheus_metrics() -> list[MetricRow]:
    """Every metric family a run's `PrometheusSink` registers, read from its own registry (the
    sink is built on a free port and never started)."""
    module = owner("PrometheusSink")
    facts = module.RunFacts("run", "lora", "model", "cpu", "fp32", 1, 1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        sink = module.PrometheusSink("127.0.0.1", 0, facts, Path(tmp), lambda _: None)
        families = list(sink.registry.collect())
    gauges: dict[str, tuple[str, str]] = module.RECORD_GAUGES
    rows = []
    for fam in families:
        labels = sorted({k for s in fam.samples for k in s.labels})
        rows.append(
            MetricRow(
                name=fam.name + _EXPOSED_SUFFIX.get(fam.type, ""),
                kind=fam.type,
                labels=tuple(labels),
                doc=fam.documentation,
                record_field=gauges.get(fam.name, ("", ""))[0],
            )
        )
    return rows


def metrics_page() -> str:
    """reference/metrics.md: the Prometheus metrics and the metrics.jsonl fields code names."""
    prom = owner("PrometheusSink")
    timing: tuple[str, ...] = owner("TIMING_FIELDS").TIMING_FIELDS
    out = [
        "# Metrics",
        "",
        "Generated from the code. `leantune train --metrics-port N` (`monitor.metrics_port`) "
        "serves these on `http://127.0.0.1:N/metrics`; a value the run does not have (eval loss "
        "before the first evaluation, GPU figures on CPU) is NaN. The `leantune_process_*` "
        "metrics are the Prometheus client's process collector (Linux), and the client adds "
        "a `NAME_created` timestamp beside each counter's `NAME_total`.",
        "",
        "| Metric | Type | Labels | metrics.jsonl field | What it is |",
        "|---|---|---|---|---|",
    ]
    for m in prometheus_metrics():
        labels = ", ".join(code(x) for x in m.labels)
        field = code(m.record_field) if m.record_field else ""
        out.append(f"| {code(m.name)} | {m.kind} | {labels} | {field} | {md(m.doc)} |")
    out += [
        "",
        "## Event kinds",
        "",
        "The `kind` of an `events.jsonl` line, and the label values of `leantune_events_total`: "
        + ", ".join(code(k) for k in prom.EVENT_KINDS)
        + ". The guard's own (`leantune_guard_events_total`): "
        + ", ".join(code(k) for k in prom.GUARD_KINDS)
        + ".",
        "",
        "## metrics.jsonl",
        "",
        "One JSON object per optimizer step. The fields the Prometheus gauges read are in the "
        "table above; these depend on the machine's speed and load rather than on the run's "
        "arithmetic (two runs of one config differ there and nowhere else): "
        + ", ".join(code(f) for f in timing)
        + ".",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# reference/api.md


def api_page() -> str:
    """reference/api.md: the Python API, rendered by mkdocstrings from `leantune.api`."""
    return "# Python API\n\n::: leantune.api\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/metrics.md": metrics_page,
    "reference/api.md": api_page,
}


def on_files(files: Files, config: Any) -> Files:
    """mkdocs hook: add the generated pages to the site's files."""
    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    return files
