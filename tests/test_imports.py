"""qeval's import graph has no cycle: module-level imports only (function-level ones are
for optional dependencies or start-up time), read with ``ast`` from every file under qeval/;
and every import, function-level ones too, points down the layers (:data:`LAYERS`)."""
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


def test_no_import_cycles_through_function_level_imports_either():
    """A function-level import closes a circle too when the function runs (the fork server's
    preload imported ``qeval.worker``, which imported ``qeval.stages``, which starts the fork
    server): every import counts here, module level or not."""
    assert find_cycles(all_imports()) == []


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


# ---- layers ------------------------------------------------------------------------------
#: qeval's layers, top first: a module may import its own layer and the layers below it, never
#: one above. A module belongs to the layer of its longest matching prefix (a package name
#: covers its modules); every module must have one, so a new module is placed on purpose.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("qeval.cli",)),
    ("stages", ("qeval.run", "qeval.executors", "qeval.pipeline", "qeval.stages", "qeval.worker",
                "qeval.quality_stages", "qeval.progress", "qeval.validate", "qeval.recipe_doc",
                "qeval.stage_proc", "qeval.stage_preload", "qeval.stage_keys", "qeval.speculative_stage")),
    ("report", ("qeval.report",)),
    ("analysis", ("qeval.analysis",)),
    ("recipe", ("qeval.recipe", "qeval.source")),
    ("tiers", ("qeval.tiers",)),
    ("engines", ("qeval.engines",)),
    ("serving", ("qeval.serving",)),
    ("measure", ("qeval.measure",)),
    ("results", ("qeval.results", "qeval.results_load", "qeval.results_speculative", "qeval.metrics", "qeval.storage", "qeval.artifacts")),
    ("base", ("qeval.errors", "qeval.bounded", "qeval.hashing", "qeval.paths", "qeval.plugins", "qeval.osutil",
              "qeval.failures", "qeval.model_config", "qeval.weight_formats", "qeval.calibration", "qeval.data")),
)

#: Imports allowed to point up the layers, ``(importer, imported)``, each with the reason. None
#: today: the quality stage drivers moved from measure/ to the stage layer (quality_stages.py).
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` (0 = top) of ``module``'s longest matching prefix; the
    package ``qeval`` itself (its ``__version__``) is a base module. None: not placed."""
    if module == "qeval":
        return len(LAYERS) - 1
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return best[0] if best else None


def all_imports() -> dict[str, set[str]]:
    """``{module: qeval modules it imports anywhere}``: module level (``import_graph``) plus
    every import inside a function (``TYPE_CHECKING`` blocks left out)."""
    graph = import_graph()
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = []
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mod = node.module or ""
                    if node.level:
                        base = name if is_pkg else name.rpartition(".")[0]
                        for _ in range(node.level - 1):
                            base = base.rpartition(".")[0]
                        mod = f"{base}.{mod}" if mod else base
                    targets = [f"{mod}.{a.name}" for a in node.names]
                for t in targets:
                    while t and t not in modules:  # "from .x import name": name may be an attribute
                        t = t.rpartition(".")[0]
                    if t and t != name and t.startswith("qeval"):
                        graph[name].add(t)
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every import from a layer to one above it."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if layer_of(m) is not None and layer_of(d) is not None and layer_of(d) < layer_of(m)
                  and (m, d) not in UPWARD_EXCEPTIONS)


def test_every_module_has_a_layer():
    assert sorted(m for m in import_graph() if layer_of(m) is None) == []


def test_finds_an_upward_import():
    g = {"qeval.measure.quality": {"qeval.tiers", "qeval.results"}, "qeval.tiers": {"qeval.engines"}}
    assert upward_imports(g) == ["qeval.measure.quality -> qeval.tiers"]
    assert layer_of("qeval.engines.openai") == layer_of("qeval.engines") > layer_of("qeval.tiers.gguf")
    assert layer_of("qeval.stages") != layer_of("qeval.measure")  # a prefix is a whole name part


def test_imports_point_down_the_layers():
    """recipe -> tiers -> engines -> measure -> results (and the layers above and below
    them, :data:`LAYERS`): no import, at module or function level, points up, bar the
    named :data:`UPWARD_EXCEPTIONS`."""
    graph = all_imports()
    assert "qeval.measure.speed" in graph["qeval.engines.openai"]  # function-level imports are read
    assert upward_imports(graph) == []
    assert [e for e in UPWARD_EXCEPTIONS if e[1] not in graph.get(e[0], ())] == []  # each exception still used
