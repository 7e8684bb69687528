"""The project's import graph, read from the source (the AST) without importing anything:
every import a module can run, at its top or inside a function, and not those under
`if TYPE_CHECKING:` (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The project's top-level packages; bench/ (run from a checkout, not installed) once there.
PACKAGES = ("scheduler_core", "producer", "consumer", "batchgate", "bench")


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the packages present."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runs(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `tree`, leaving out `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. `from pkg import name` counts as an import
    of the module pkg.name where there is one, else of pkg."""
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in _runs(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[:len(here) - node.level + 1], *filter(None, [base])])
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                         for alias in node.names]
            targets.update(t for t in map(known, names) if t is not None and t != module)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import cycles: each strongly connected set of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph.get(node, ())):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(members)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing `start` can load (itself included)."""
    seen, todo = {start}, [start]
    while todo:
        for after in graph.get(todo.pop(), ()):
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return seen
