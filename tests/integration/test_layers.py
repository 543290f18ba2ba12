"""The imports point one way: each layer imports only from the layers before it.

Every `import` of leantune's own modules counts: at module level, inside functions (a deferred
import cannot hide a cycle) and under `if TYPE_CHECKING` (an annotation is a dependency too).
The order is the folders' (README "Package map"):

    errors, config, layout -> core -> data -> models -> methods, objectives -> eval, memory
    -> monitor -> export -> training -> api, cli, bench, demo, testing

Modules of one layer may import each other, without cycles.
"""

from __future__ import annotations

import ast
import collections
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
LAYERS: list[tuple[str, ...]] = [
    ("errors", "config", "layout"),
    ("core",),
    ("data",),
    ("models",),
    ("methods", "objectives"),
    ("eval", "memory"),
    ("monitor",),
    ("export",),
    ("training",),
    ("api", "cli", "bench", "demo", "testing", "__main__", "__init__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    kind: str  # "module", "function" or "typing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import in `tree` with where it sits (module level, a function, TYPE_CHECKING)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, kind))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, "function")
            elif _is_type_checking(child):
                visit(child, "typing" if kind == "module" else kind)
            else:
                visit(child, kind)

    visit(tree, "module")
    return found


def leantune_edges() -> list[Edge]:
    modules = {module_name(p): p for p in (SRC / "leantune").rglob("*.py")}
    edges = []
    for source, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, kind in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert node.level == 0, f"{path}:{node.lineno}: relative import"
                base = node.module or ""
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in targets:
                if target.split(".")[0] == "leantune" and target != source:
                    edges.append(Edge(source, target, node.lineno, kind))
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


EDGES = leantune_edges()


def test_every_top_level_module_and_package_has_a_layer() -> None:
    names = {layer(e.source) for e in EDGES} | {layer(e.target) for e in EDGES}
    names |= {p.stem for p in (SRC / "leantune").iterdir() if p.suffix == ".py" or p.is_dir()}
    names -= {"__pycache__", "configs"}
    assert sorted(names - set(RANK)) == []


def test_no_import_points_up_a_layer() -> None:
    upward = [
        f"{e.source}:{e.line} ({e.kind}) imports {e.target}: layer {layer(e.target)} is above "
        f"{layer(e.source)}"
        for e in EDGES
        if RANK[layer(e.target)] > RANK[layer(e.source)]
    ]
    assert upward == []


def test_config_imports_nothing_of_leantune_but_errors() -> None:
    reached = {e.target for e in EDGES if layer(e.source) == "config"}
    assert sorted(t for t in reached if layer(t) not in ("config", "errors")) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules() -> None:
    """Annotations under TYPE_CHECKING never run, so only they may close a loop."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for e in EDGES:
        # A package's __init__ importing its own submodules is how it re-exports them.
        if e.kind != "typing" and not e.target.startswith(e.source + "."):
            graph[e.source].add(e.target)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("kind", ["module", "function", "typing"])
def test_imports_are_found_wherever_they_sit(kind: str) -> None:
    code = {
        "module": "from leantune.core import writes\n",
        "function": "def f():\n    from leantune.core import writes\n",
        "typing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from leantune.core import writes\n",
    }[kind]
    found = [k for node, k in _imports(ast.parse(code)) if isinstance(node, ast.ImportFrom)]
    assert found[-1] == kind


def test_the_package_graph_has_no_upward_edge(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the package graph (`pytest -s tests/integration/test_layers.py -k graph`)."""
    counts = collections.Counter(
        (layer(e.source), layer(e.target)) for e in EDGES if layer(e.source) != layer(e.target)
    )
    lines = []
    for (source, target), n in sorted(counts.items(), key=lambda kv: (RANK[kv[0][0]], kv[0])):
        direction = "UP" if RANK[target] > RANK[source] else "down"
        lines.append(f"{source:>10} -> {target:<10} {n:4d} {direction}")
    print("\n".join(lines))
    assert not [line for line in lines if line.endswith("UP")]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


@pytest.mark.parametrize("top", ["api", "cli", "bench"])
def test_the_top_layer_imports_no_private_name(top: str) -> None:
    """api, cli and bench use the library's public names only (api once imported the CLI's
    private helpers: the library then depended on its command line)."""
    private = []
    for path in (SRC / "leantune").rglob("*.py"):
        if layer(module_name(path)) != top:
            continue
        for node, _ in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leantune"):
                names = [*(node.module or "").split("."), *(a.name for a in node.names)]
                if any(_private(n) for n in names):
                    private.append(f"{module_name(path)}:{node.lineno}")
    assert private == []


def test_every_import_inside_a_function_says_why() -> None:
    """A function-local import of leantune's own modules hides a dependency: it stays only where
    an optional or heavy dependency justifies it, with the reason in a comment at its line, or on
    the line before it or its block of imports (`leantune --help` stays fast through
    `cli.app.command_function` alone)."""
    silent = []
    for path in sorted((SRC / "leantune").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, kind in _imports(ast.parse("\n".join(lines))):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if kind == "function" and (module or "").startswith("leantune"):
                above = node.lineno - 2  # the comment may head a block of imports
                while lines[above].strip().startswith(("from ", "import ")):
                    above -= 1
                if "#" not in lines[node.lineno - 1] and not lines[above].strip().startswith("#"):
                    silent.append(
                        f"{module_name(path)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                    )
    assert silent == [], "\n".join(silent)
