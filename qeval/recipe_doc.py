"""The recipe reference (``docs/recipe.md``), generated from the recipe schema.

Every section of :class:`qeval.recipe.Recipe` and every tier method's spec
(:func:`qeval.tiers.tier_specs`) becomes a table of its fields: type with bounds, default
and meaning. The meaning is the field's pydantic ``description``, else its entry in the
class docstring's ``Attributes:`` section. ``python -m qeval.recipe_doc`` rewrites the
file; ``python -m qeval.recipe_doc --check`` exits 1 when the file differs from the
schema (tests/test_recipe_doc.py runs the same comparison).

Checked before writing this: pydantic's ``model_json_schema`` gives the same facts as JSON
Schema, but loses the recipe's order of sections and renders unions and ``Literal`` values
as nested schema objects; walking ``model_fields`` keeps the table to what a recipe writer
types.
"""
from __future__ import annotations

import argparse
import enum
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .recipe import Recipe
from .tiers import get_method, method_names, tier_specs
from .tiers.base import TierSpec

#: Where the reference lives in the repository (relative to its root).
DOC_PATH = Path("docs") / "recipe.md"
COMMAND = "python -m qeval.recipe_doc"

INTRO = f"""# Recipe reference

Generated from the recipe schema (`qeval/recipe.py` and each tier method's spec in
`qeval/tiers/`) by `{COMMAND}`; do not edit by hand: a test fails when this file and the
schema differ.

A recipe is one YAML file. Every field has a strict type (`threads: "4"` or
`trust_remote_code: 1` is an error) and a bound; an unknown key is an error. A bad field
is one line naming the file, the line and the field, exit 2. Paths (`model.source` when
local, `speed.depth_text`, `calibration.path`, `suites[].path`, `quality.lm_eval_tasks`, a
mounted `storage`) are relative to the recipe file's folder, or `builtin:<name>` for the
data qeval ships. `qeval validate RECIPE` checks a recipe and prints the resolved plan.

Types: `int > 0` and similar give the bounds; `a | b` is one of the values; `null` means
unset. "required" marks a field without a default.
"""


def _doc_attributes(cls: type) -> dict[str, str]:
    """``{name: text}`` from the ``Attributes:`` section of ``cls``'s docstring and its bases'
    (Google style: ``name: text`` lines, continuation lines indented deeper)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        if "Attributes:" not in doc:
            continue
        block = doc.split("Attributes:", 1)[1].splitlines()
        name = None
        for line in block:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:
                break  # the next section
            m = re.match(r"\s+([A-Za-z_][A-Za-z0-9_, ]*):\s*(.*)$", line)
            if m and indent <= 4:
                names = [n.strip() for n in m.group(1).split(",")]
                for n in names:
                    out[n] = m.group(2).strip()
                name = names
            elif name:
                for n in name:
                    out[n] = (out[n] + " " + line.strip()).strip()
    return out


def _rst(text: str) -> str:
    """Docstring markup as Markdown: ``x`` and :role:`x` become `x`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _one_line(text: str) -> str:
    return _rst(" ".join(text.split())).replace("|", "\\|")


def _summary(cls: type) -> str:
    """The class docstring before its ``Attributes:`` section, as one paragraph per block."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    doc = doc.split("Attributes:", 1)[0].strip()
    return "\n\n".join(_rst(" ".join(p.split())) for p in doc.split("\n\n") if p.strip())


def _num(v: Any) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _bounds(meta: list) -> str:
    parts = []
    for m in meta:
        if isinstance(m, annotated_types.Gt):
            parts.append(f"> {_num(m.gt)}")
        elif isinstance(m, annotated_types.Ge):
            parts.append(f">= {_num(m.ge)}")
        elif isinstance(m, annotated_types.Lt):
            parts.append(f"< {_num(m.lt)}")
        elif isinstance(m, annotated_types.Le):
            parts.append(f"<= {_num(m.le)}")
        elif isinstance(m, annotated_types.MinLen) and m.min_length:
            parts.append(f"length >= {m.min_length}")
        elif isinstance(m, annotated_types.MaxLen):
            parts.append(f"length <= {m.max_length}")
    return ", ".join(parts)


def _type(tp: Any, links: dict[type, str]) -> str:
    """A type annotation as a recipe writer reads it."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        inner, *meta = args
        bound = _bounds(list(meta))
        return _type(inner, links) + (f" {bound}" if bound else "")
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) if isinstance(a, str) else str(a).lower() if isinstance(a, bool) else str(a)
                            for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, links) for a in args)
    if origin in (list, tuple):
        return f"list of {_type(args[0], links)}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        anchor = links.get(tp)
        return f"[{tp.__name__}](#{anchor})" if anchor else tp.__name__
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(str(e.value) for e in tp)
    return {str: "string", int: "int", float: "number", bool: "bool"}.get(tp, getattr(tp, "__name__", str(tp)))


def _value(v: Any) -> str:
    if isinstance(v, BaseModel):
        return "see below"
    if isinstance(v, enum.Enum):
        v = v.value
    return json.dumps(v) if not isinstance(v, str) else v


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        v = f.default_factory()  # type: ignore[call-arg]
        if isinstance(v, BaseModel):
            return "see below"
        return f"`{_value(v)}`"
    if f.default is PydanticUndefined:
        return "required"
    if f.default is None:
        return "null"
    return f"`{_value(f.default)}`"


def _field_type(f: FieldInfo, links: dict[type, str]) -> str:
    args = typing.get_args(f.annotation)
    if typing.get_origin(f.annotation) is list and args and typing.get_origin(args[0]) is typing.Annotated \
            and any(isinstance(a, type) and issubclass(a, TierSpec) for a in typing.get_args(typing.get_args(args[0])[0])):
        t = "list of [tiers](#tiers)"  # the union of every method's spec
    else:
        t = _type(f.annotation, links)
    bound = _bounds(list(f.metadata))
    return t + (f" {bound}" if bound else "")


def _table(cls: type[BaseModel], links: dict[type, str], skip: tuple[str, ...] = (),
           missing: list[str] | None = None, where: str = "") -> list[str]:
    attrs = _doc_attributes(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, f in cls.model_fields.items():
        if name in skip:
            continue
        text = f.description or attrs.get(name) or ""
        nested = [m for n, m in _nested_models(cls) if n == name]
        if not text and nested and nested[0] in links:
            text = f"the section [{nested[0].__name__}](#{links[nested[0]]}) below"
        if not text and missing is not None:
            missing.append(f"{where}{name}")
        rows.append(f"| `{name}` | {_field_type(f, links)} | {_default(f)} | {_one_line(text) or '-'} |")
    return rows


def _nested_models(cls: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """``(field name, model)`` of every field whose type holds a pydantic model (recipe order)."""
    out = []
    for name, f in cls.model_fields.items():
        stack = [f.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel) and not issubclass(tp, TierSpec):
                out.append((name, tp))
                break
            stack.extend(reversed(typing.get_args(tp)))
    return out


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def generate(missing: list[str] | None = None) -> str:
    """The whole reference as Markdown (deterministic: the schema alone decides it).

    Args:
        missing: when given, receives ``section.field`` of every field without a meaning.
    """
    sections: list[tuple[str, str, type[BaseModel]]] = []  # (path, title, model)

    def walk(path: str, cls: type[BaseModel]) -> None:
        for name, model in _nested_models(cls):
            sub = f"{path}.{name}" if path else name
            if name == "tiers":
                continue
            sections.append((sub, f"{sub}", model))
            walk(sub, model)

    walk("", Recipe)
    links: dict[type, str] = {}
    for path, title, model in sections:
        links.setdefault(model, _anchor(title))
    links[Recipe] = _anchor("top level")
    tier_title = "tiers[]"
    lines = [INTRO, "## Top level", "", _summary(Recipe), ""]
    lines += _table(Recipe, links, missing=missing)
    lines.append("")
    for path, title, model in sections:
        lines += [f"## {title}", "", _summary(model), ""] if _summary(model) else [f"## {title}", ""]
        lines += _table(model, links, missing=missing, where=f"{path}.")
        lines.append("")
    # tiers: the fields every tier has, then each method's own
    for name, model in _nested_models(TierSpec):
        links[model] = _anchor(f"tiers[].{name}")
    lines += [f"## {tier_title}", "",
              "Each tier is a `name`, a `method` (which builds its artifact) and that method's fields below; "
              "every tier also takes these:", ""]
    common = set(TierSpec.model_fields)
    table = _table(TierSpec, links, missing=missing, where="tiers[].")
    methods = " \\| ".join(f'"{m}"' for m in method_names())
    table.insert(3, f"| `method` | {methods} | required | how the tier's artifact is built (its own fields below) |")
    lines += table
    lines.append("")
    for spec in tier_specs():
        methods = [m for m in method_names() if get_method(m).spec is spec]  # type: ignore[union-attr]
        title = f"tiers[] method: {', '.join(methods)}"
        lines += [f"### {title}", "", _summary(spec), ""]
        own = [n for n in spec.model_fields if n not in common and n != "method"]
        if own:
            lines += _table(spec, links, skip=tuple(common | {"method"}), missing=missing,
                            where=f"tiers[{methods[0]}].")
        else:
            lines.append("No fields beyond those every tier takes.")
        lines.append("")
    # nested models of the common tier fields (endpoint, serve)
    for name, model in _nested_models(TierSpec):
        title = f"tiers[].{name}"
        lines += [f"### {title}", "", _summary(model), ""]
        lines += _table(model, links, missing=missing, where=f"tiers[].{name}.")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m qeval.recipe_doc [--check] [--out docs/recipe.md]``: write the reference
    (or, with ``--check``, exit 1 when the file differs). Fields without a meaning are
    listed on stderr."""
    ap = argparse.ArgumentParser(prog=COMMAND, description="write the recipe reference from the schema")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / DOC_PATH)
    ap.add_argument("--check", action="store_true", help="exit 1 when the file is not what the schema gives")
    args = ap.parse_args(argv)
    missing: list[str] = []
    text = generate(missing)
    for m in missing:
        print(f"no description: {m}", file=sys.stderr)
    if args.check:
        have = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if have != text:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
