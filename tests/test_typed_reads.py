"""The report and analysis modules read a run folder only through the typed models of
:mod:`qeval.results`, never by string key: read with ``ast`` from every file under
qeval/report/ and qeval/analysis/.

Three rules:

1. No JSON or YAML parsing there (``json.loads``, ``read_json``, ``yaml.safe_load`` ...):
   a run file is read by its reader in qeval/results.py (``load_run``, ``read_gate``,
   ``read_answers`` ...). Named exceptions: files that are not run files.
2. No string-constant subscript or ``.get("key")`` on data that came from a run file
   untyped: a name bound (assignment, loop, comprehension) from a parse, from the recorded
   recipe (``.recipe``) or from the load section (``.load``, ``get_path(t, "load", ...)``).
3. Every ``get_path(obj, "a", "b", ...)`` whose first key is a field of
   :class:`~qeval.results.TierResult` or :class:`~qeval.results.RunInfo` names declared
   fields all the way (a typo fails here, not as a silent None), and never goes past an
   untyped ``dict[str, Any]`` section with more string keys.

Pending: the load section (``TierResult.load``, a ``dict[str, Any]`` checked by hand in
``results.check_load_section``) is being typed on its own; its reads are listed as pending
(:data:`PENDING`) and pass for now. Once it is typed, drop ``"load"`` from :data:`PENDING`
and this test holds it to the same rules.
"""
from __future__ import annotations

import ast
import typing
from pathlib import Path

from pydantic import BaseModel

from qeval.results import RunInfo, TierResult

PKG = Path(__file__).resolve().parent.parent / "qeval"
SCANNED = sorted([*(PKG / "report").glob("*.py"), *(PKG / "analysis").glob("*.py")])

#: Calls that parse JSON or YAML text or files.
PARSERS = {"loads", "load_json", "read_json", "safe_load", "parse_json", "parse_yaml", "load_yaml"}
#: ``(file relative to qeval/, function)`` allowed to parse, and why: none of them is a run file.
PARSE_EXCEPTIONS = {
    ("analysis/plan.py", "read_config"): "a model's config.json (qeval plan), not a run file",
    ("analysis/gpus.py", "known_gpus"): "the GPU table shipped as package data (qeval/data/gpus.yaml)",
}
#: Where untyped data comes from (rule 2): an attribute of a run model that is a ``dict``.
UNTYPED_ATTRS = {"load": "load", "recipe": "recipe"}
#: Origins whose string-key reads are allowed, and why.
ALLOWED = {"recipe": "run.json's recorded recipe: the sections the analysis reads are validated against the "
                     "recipe's own models first (qeval.analysis.gate.load_run_checked, validate_section)"}
#: Origins whose string-key reads are pending: the load section, typed separately (module docstring).
PENDING: set[str] = set()  # the load section is typed (qeval/results_load.py): no pending reads


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix() if path.is_relative_to(PKG) else path.name


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _const_keys(call: ast.Call) -> list[str] | None:
    """The string keys of ``get_path(obj, "a", "b")``; None when one is not a string constant."""
    keys = []
    for a in call.args[1:]:
        if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
            return keys or None
        keys.append(a.value)
    return keys


class _Reads(ast.NodeVisitor):
    """Rule 1 and 2 findings of one module: ``(origin, "file:line: source")``."""

    def __init__(self, rel: str, source: str) -> None:
        self.rel, self.lines = rel, source.splitlines()
        self.func: list[str] = ["<module>"]
        self.tainted: list[dict[str, str]] = [{}]
        self.found: list[tuple[str, str]] = []

    def _at(self, node: ast.AST) -> str:
        return f"{self.rel}:{node.lineno}: {self.lines[node.lineno - 1].strip()}"

    def origin(self, node: ast.AST | None) -> str | None:
        """Where the value of ``node`` comes from when it is untyped run data, else None."""
        if node is None:
            return None
        if isinstance(node, ast.Name):
            return self.tainted[-1].get(node.id)
        if isinstance(node, ast.Attribute):
            if node.attr in UNTYPED_ATTRS:
                return UNTYPED_ATTRS[node.attr]
            return self.origin(node.value) if self.origin(node.value) else None
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name in PARSERS:  # a named exception parses a file that is no run file
                return None if (self.rel, self.func[-1]) in PARSE_EXCEPTIONS else "parse"
            if name == "get_path" and node.args:
                keys = _const_keys(node) or []
                if keys and keys[0] in UNTYPED_ATTRS:
                    return UNTYPED_ATTRS[keys[0]]
                return self.origin(node.args[0])
            if name in ("get", "items", "values", "keys", "sorted", "list", "next", "reversed", "dict"):
                inner = node.func.value if isinstance(node.func, ast.Attribute) and name in (
                    "get", "items", "values", "keys") else (node.args[0] if node.args else None)
                return self.origin(inner)
            return None
        if isinstance(node, ast.Subscript):
            return self.origin(node.value)
        if isinstance(node, ast.BoolOp):
            return next((o for o in map(self.origin, node.values) if o), None)
        if isinstance(node, ast.IfExp):
            return self.origin(node.body) or self.origin(node.orelse)
        if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
            return self.origin(node.elt)
        return None

    def _bind(self, target: ast.AST, origin: str | None) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                if origin:
                    self.tainted[-1][n.id] = origin
                else:
                    self.tainted[-1].pop(n.id, None)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.func.append(node.name)
        self.tainted.append(dict(self.tainted[-1]))
        self.generic_visit(node)
        self.tainted.pop()
        self.func.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for t in node.targets:
            self._bind(t, self.origin(node.value))

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, self.origin(node.value))

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self._bind(node.target, self.origin(node.iter))
        for s in node.body + node.orelse:
            self.visit(s)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.visit(node.iter)
        self._bind(node.target, self.origin(node.iter))
        for c in node.ifs:
            self.visit(c)

    def _comp(self, node: ast.AST) -> None:
        for g in node.generators:
            self.visit_comprehension(g)
        for part in ("elt", "key", "value"):
            if getattr(node, part, None) is not None:
                self.visit(getattr(node, part))

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comp

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            o = self.origin(node.value)
            if o:
                self.found.append((o, self._at(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node)
        if name in PARSERS and (self.rel, self.func[-1]) not in PARSE_EXCEPTIONS:
            self.found.append(("parse", self._at(node)))
        if (name == "get" and isinstance(node.func, ast.Attribute) and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            o = self.origin(node.func.value)
            if o:
                self.found.append((o, self._at(node)))
        if name == "get_path" and node.args:
            o = self.origin(node.args[0])
            if o and _const_keys(node):
                self.found.append((o, self._at(node)))
        self.generic_visit(node)


def string_reads(paths: list[Path] = SCANNED) -> list[tuple[str, str]]:
    """Rule 1 and 2 findings over ``paths``: ``(origin, "file:line: source")``."""
    out = []
    for p in paths:
        text = p.read_text()
        v = _Reads(_rel(p), text)
        v.visit(ast.parse(text, str(p)))
        out += v.found
    return out


def _unwrap(annotation):
    """``X | None`` -> ``X``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
            and len(args) == 1:
        return args[0]
    return annotation


def path_problem(model: type[BaseModel], keys: list[str]) -> str | None:
    """Why ``get_path(<model>, *keys)`` is not a read of declared fields, or None when it is:
    an undeclared field, or a string key into an untyped ``dict[str, Any]``."""
    cur = model
    for i, k in enumerate(keys):
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            if k not in cur.model_fields:
                return f"{'.'.join(keys[:i + 1])}: no such field of {cur.__name__}"
            cur = _unwrap(cur.model_fields[k].annotation)
        elif typing.get_origin(cur) is dict:
            value = typing.get_args(cur)[1]
            if value is typing.Any:
                return f"{'.'.join(keys[:i + 1])}: a string key into an untyped dict"
            cur = _unwrap(value)  # a data key (a depth, a bucket): the value's type goes on
        else:
            return f"{'.'.join(keys[:i + 1])}: past a {cur}"
    return None


def get_path_problems(paths: list[Path] = SCANNED) -> list[tuple[str, str]]:
    """Rule 3 findings: ``(root key, "file:line: problem")`` for each ``get_path`` whose
    first key is a TierResult or RunInfo field."""
    out = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if _call_name(node) != "get_path" or len(node.args) < 2:
                continue
            keys = _const_keys(node)
            if not keys:
                continue
            models = [m for m in (TierResult, RunInfo) if keys[0] in m.model_fields]
            problems = [path_problem(m, keys) for m in models]
            if models and all(problems):
                out.append((keys[0], f"{_rel(p)}:{node.lineno}: {problems[0]}"))
    return out


# ---- the rules find what they should ------------------------------------------------------

def test_the_rules_find_string_reads(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\n"
                   "def f(path, t):\n"
                   "    doc = json.loads(path.read_text())\n"
                   "    lad = doc.get('ladder') or {}\n"
                   "    for s in lad['steps']:\n"
                   "        print(s['tier'])\n"
                   "    pts = get_path(t, 'load', 'points') or []\n"
                   "    ok = [p['concurrency'] for p in pts]\n"
                   "    return t.memory.kind, get_path(t, 'memory', 'kind')\n")
    got = [(o, line.split(": ", 1)[1]) for o, line in string_reads([bad])]
    assert ("parse", "doc = json.loads(path.read_text())") in got
    assert ("parse", "lad = doc.get('ladder') or {}") in got
    assert ("parse", "for s in lad['steps']:") in got and ("parse", "print(s['tier'])") in got
    assert ("load", "ok = [p['concurrency'] for p in pts]") in got
    assert not any("memory" in line for _, line in got)  # typed attributes and fields are fine


def test_get_path_must_name_declared_fields():
    assert path_problem(TierResult, ["memory", "weight_bytes"]) is None
    assert path_problem(TierResult, ["speed", "1024", "decode_tokens_per_s"]) is None  # a depth key, then a field
    assert "no such field of Memory" in path_problem(TierResult, ["memory", "weight_byte"])
    assert "untyped dict" in path_problem(TierResult, ["attention", "implementation"])
    assert path_problem(TierResult, ["quality", "lm_eval"]) is None  # the section itself: task names are data


# ---- the rules hold on qeval --------------------------------------------------------------

def test_report_and_analysis_read_run_files_through_typed_models():
    found = string_reads()
    assert [line for o, line in found if o not in PENDING and o not in ALLOWED] == []
    assert any(o == "recipe" for o, _ in found)  # the allowed reads are still there (keep ALLOWED true)


def test_get_path_reads_declared_fields():
    assert [line for root, line in get_path_problems() if root not in PENDING and root not in ALLOWED] == []



def test_open_seconds_reads_older_runs_load_seconds_and_writes_open_seconds(tmp_path):
    """Issue 45: the seconds to open a tier's model are ``open_seconds``; run folders from
    before (the fixtures, left as written) have ``load_seconds`` and still read, into
    ``open_seconds``, through the closed models; a rewrite says ``open_seconds``."""
    import json

    from qeval.results import MeasureStage, json_text, load_run

    fixture = Path(__file__).resolve().parent / "fixtures" / "run_synthetic"
    raw = json.loads((fixture / "tiers" / "bf16.json").read_text())
    assert "load_seconds" in raw and "open_seconds" not in raw
    _, tiers = load_run(fixture)
    assert tiers["bf16"].open_seconds == raw["load_seconds"]
    out = json.loads(json_text(tiers["bf16"]))
    assert out["open_seconds"] == raw["load_seconds"] and "load_seconds" not in out
    assert TierResult.model_validate(out).open_seconds == raw["load_seconds"]
    assert MeasureStage.model_validate({"load_seconds": 1.5}).open_seconds == 1.5
    assert MeasureStage.model_validate({"open_seconds": 2.5}).open_seconds == 2.5
