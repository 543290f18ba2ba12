"""Only the entry points read the whole config (STYLE.md 3): the memory planner takes a
`PlanInputs`, the fingerprint and the resume policy the sections they read, so none of their
functions has a parameter of type `Config`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "leantune"
READERS = sorted(
    [
        *(PACKAGE / "memory").glob("*.py"),
        PACKAGE / "training" / "run" / "fingerprint.py",
        PACKAGE / "training" / "run" / "resume.py",
    ]
)


def _config_parameters(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None and ast.unparse(arg.annotation) == "Config":
                    found.append(f"{node.name}({arg.arg}: Config) at line {node.lineno}")
    return found


@pytest.mark.parametrize("path", READERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_takes_the_whole_config(path: Path) -> None:
    assert path.exists()
    assert _config_parameters(path) == []


def test_the_check_finds_a_config_parameter(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def plan(cfg: Config, device: str) -> None: ...\n", encoding="utf-8")
    assert _config_parameters(source) == ["plan(cfg: Config) at line 1"]
