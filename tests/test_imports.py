"""qeval's import graph has no cycle: module-level imports only (function-level ones are
for optional dependencies or start-up time), read with ``ast`` from every file under qeval/."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "qeval"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: qeval modules it imports at module level}`` (``if TYPE_CHECKING`` blocks left out)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()

        def add(target: str) -> None:
            while target and target not in modules:  # "from .x import name": name may be an attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)

        def visit(stmts) -> None:
            for node in stmts:
                if isinstance(node, ast.Import):
                    for a in node.names:
                        add(a.name)
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = name if is_pkg else name.rpartition(".")[0]
                        for _ in range(node.level - 1):
                            base = base.rpartition(".")[0]
                        mod = f"{base}.{node.module}" if node.module else base
                    else:
                        mod = node.module or ""
                    for a in node.names:
                        add(f"{mod}.{a.name}")
                elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                elif isinstance(node, (ast.If, ast.Try, ast.With)):
                    visit(getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                          + [s for h in getattr(node, "handlers", []) for s in h.body])
        visit(tree.body)
        graph[name] = {d for d in deps if d.startswith("qeval")}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_is_read():
    g = import_graph()
    assert "qeval.results" in g["qeval.run"] and "qeval.errors" in g["qeval.recipe"]
    assert "qeval.tiers.base" in g["qeval.tiers.gptq"]


def test_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def test_function_level_imports_say_why():
    """An import inside a function is for an optional dependency or start-up time, and its
    line says which (``# optional: ...`` or ``# start-up time: ...``)."""
    bare = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        line = lines[node.lineno - 1]
                        if "# optional" not in line and "# start-up time" not in line:
                            bare.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {line.strip()}")
    assert bare == []
