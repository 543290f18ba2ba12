"""The reference pages that docs/hooks/reference.py generates at `mkdocs build`: every command,
flag, config field and metric is on them, and they render as the tables they mean to be.

`make docs` (in CI) builds the whole site with `mkdocs build --strict`; these tests call the
page functions in-process, which is cheaper, and check the pages against sources the hook does
not use (each command's `--help` text, `validate --help-fields`, a Prometheus scrape).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any

import markdown
import pytest
import yaml
from prometheus_client import generate_latest

from leantune.cli.app import main
from leantune.config import field_roles

ROOT = Path(__file__).resolve().parents[2]


def _load_hook() -> ModuleType:
    path = ROOT / "docs" / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("leantune_docs_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


hook = _load_hook()


class _Cells(HTMLParser):
    """The text of every table cell of an HTML page, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _rendered_rows(page: str) -> list[list[str]]:
    """The page's table rows as a reader sees them (Markdown rendered as the site does)."""
    cells = _Cells()
    cells.feed(markdown.markdown(page, extensions=["tables"]))
    return cells.rows


def _sections(page: str) -> dict[str, str]:
    """`## heading` -> the text under it."""
    parts = re.split(r"^## (.+)$", page, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _help(argv: list[str]) -> str:
    """What `leantune ARGV` prints (`--help` unless ARGV names another way to get help)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv if argv[-1:] == ["--help-fields"] else [*argv, "--help"]) == 0
    return out.getvalue()


def _commands_from_help(argv: list[str]) -> dict[str, str]:
    """'leantune cmd sub' -> its --help text, for every command the usage lines offer."""
    text = _help(argv)
    found = {" ".join(["leantune", *argv]): text}
    usage = text.split("\n\n")[0]
    # A subcommand list reads `{a,b} ...` and follows no option (`--device {cpu,cuda}` does).
    choices = re.search(r"(?<![\w-] )\{([\w,-]+)\}\s+\.\.\.", usage)
    for name in choices.group(1).split(",") if choices else []:
        found.update(_commands_from_help([*argv, name]))
    return found


def test_cli_reference_has_every_command_and_flag() -> None:
    page = _sections(hook.cli_page())
    helps = _commands_from_help([])
    assert "leantune bench throughput" in helps and len(helps) >= 14
    for command, text in helps.items():
        assert command in page, f"{command} is not in reference/cli.md"
        # An option's line in --help starts with two spaces and a dash; its help may name other
        # commands' flags (`--chat`), which are not this command's.
        invocations = re.findall(r"^  (-\S.*?)(?:  |$)", text, re.M)
        flags = {f for line in invocations for f in re.findall(r"--[\w-]+", line)} - {"--help"}
        # The Argument column of the section's table, not its usage block (that lists them all).
        arguments = " ".join(row[0] for row in _rendered_rows(page[command]))
        missing = sorted(f for f in flags if not re.search(rf"{f}(?![\w-])", arguments))
        assert flags or command == "leantune bench", command
        assert not missing, f"{command}: {missing} are not in its table"


def test_config_reference_has_every_field_with_its_default_and_doc() -> None:
    rows = {r[0]: r for r in _rendered_rows(hook.config_page()) if r and r[0] != "Field"}
    # `validate --help-fields`: "  section.key=default" then its doc, indented, on the next line.
    listed = re.findall(r"^  (\S+?)=(.*)\n {6}(.*)$", _help(["validate", "--help-fields"]), re.M)
    assert len(listed) > 100
    for key, default, doc in listed:
        assert key in rows, f"{key} is not in reference/config.md"
        assert rows[key][2] == default, key
        assert rows[key][4] == doc.replace("`", ""), key  # `x` renders as code
    # Dataclasses only reachable through a type hint (None by default) are walked too.
    assert rows["model.rope_scaling.factor"][2] == "required"
    assert rows["model.rope_scaling.factor"][4].startswith("Context extension factor")
    assert rows["monitor.wandb.project"][4] == "W&B project to log to (required)."
    # Each field's fingerprint role, from its metadata; a nested field has its section's.
    for key, role in field_roles().items():
        assert rows[key][3] == str(role), key
    assert rows["monitor.wandb.project"][3] == str(field_roles()["monitor.wandb"])


def test_metrics_reference_has_every_metric_a_scrape_shows() -> None:
    page = hook.metrics_page()
    module = hook.owner("PrometheusSink")
    facts = module.RunFacts("run", "lora", "model", "cpu", "fp32", 1, 1, 1)
    sink = module.PrometheusSink("127.0.0.1", 0, facts, ROOT / "no-such-dir", print)
    scraped = re.findall(r"^# HELP (\S+)", generate_latest(sink.registry).decode(), re.M)
    names = {r[0] for r in _rendered_rows(page)}
    assert len(scraped) > 30
    # prometheus_client adds NAME_created (a timestamp) beside each counter's NAME_total.
    created = {n for n in scraped if n.endswith("_created") and f"{n[:-8]}_total" in names}
    assert created and "`NAME_created`" in page
    assert not [n for n in scraped if n not in names | created]
    for name, (field, _) in module.RECORD_GAUGES.items():
        assert f"| `{name}` | gauge |  | `{field}` |" in page


def test_every_generated_page_is_in_the_nav() -> None:
    nav = json.dumps(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    for uri, page in hook.PAGES.items():
        assert f'"{uri}"' in nav
        assert page().startswith("# ")
    assert hook.api_page().strip().endswith("::: leantune.api")


@pytest.mark.parametrize(
    ("text", "cells"),
    [
        ("a | b <run.name> [x] *y*", ["a | b <run.name> [x] *y*"]),
        ("keep `a | b` as code", ["keep a | b as code"]),
        ("one ` unpaired", ["one ` unpaired"]),
    ],
)
def test_help_text_stays_in_its_cell(text: str, cells: list[str]) -> None:
    rows = _rendered_rows(f"| h |\n|---|\n| {hook.md(text)} |\n")
    assert rows[1] == cells
