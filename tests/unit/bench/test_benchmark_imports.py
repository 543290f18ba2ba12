"""Benchmarks are scripts nothing else imports: check that every leantune name they import
(at the top or inside functions) still exists, so a refactor cannot leave one broken."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[3] / "benchmarks").glob("*.py"))


def _exists(module: str, name: str) -> bool:
    if hasattr(importlib.import_module(module), name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_every_leantune_import_of_a_benchmark_resolves(script: Path) -> None:
    tree = ast.parse(script.read_text(encoding="utf-8"))
    missing = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("leantune")
        for alias in node.names
        if not _exists(node.module, alias.name)
    ]
    assert missing == []
