"""Tier methods own their recipe schema: the registry finds one module per method, each
declares its spec and disk per parameter, and the recipe's tier union is built from them,
so a new method is a new module."""
from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from qeval.recipe import TIER_METHODS, parse_recipe
from qeval.run import estimate_disk_bytes
from qeval.tiers import get_method, method_names, tier_specs
from qeval.tiers.base import TierSpec

REPO = Path(__file__).resolve().parent.parent


def test_every_method_declares_its_schema_and_disk():
    assert set(method_names()) >= {"bf16", "int8", "gptq", "awq", "gguf"} and TIER_METHODS == method_names()
    for name in method_names():
        m = get_method(name)
        assert issubclass(m.spec, TierSpec) and m.method == name
        assert typing.get_args(m.spec.model_fields["method"].annotation) == (name,)
        per = m.artifact_bytes_per_parameter(m.spec(name="t", method=name))
        assert isinstance(per, float) and per >= 0 and m.transient_dtype_copies >= 0
        assert m.default_engine in m.engines()
    assert len(tier_specs()) == len(method_names())


def test_recipe_tiers_are_the_methods_specs():
    r = parse_recipe("name: x\nmodel: {source: /m}\ntiers:\n  - {name: bf16, method: bf16}\n"
                     "  - {name: g, method: gptq, group_size: 64}\n  - {name: q, method: gguf, type: Q8_0}\n")
    assert [type(t) for t in r.tiers] == [get_method(m).spec for m in ("bf16", "gptq", "gguf")]
    assert r.tier("g").group_size == 64 and r.tier("q").type == "Q8_0"


def test_disk_estimate_comes_from_each_method():
    r = parse_recipe("name: x\nmodel: {source: /m}\ntiers:\n  - {name: bf16, method: bf16}\n"
                     "  - {name: i, method: int8}\n  - {name: q, method: gguf}\n")
    n = 1_000_000
    i8, gg = get_method("int8"), get_method("gguf")
    assert estimate_disk_bytes(r, ["bf16"], n) == 0
    kept = int(n * i8.artifact_bytes_per_parameter(r.tier("i"))) + int(n * gg.artifact_bytes_per_parameter(r.tier("q")))
    assert gg.artifact_bytes_per_parameter(r.tier("q")) == 5 / 8  # Q4_K_M: 4 bits + 1 of scales
    assert estimate_disk_bytes(r, ["i", "q"], n) == kept + int(n * 2 * gg.transient_dtype_copies)
    assert estimate_disk_bytes(r, ["i"], None) == 0


FAKE = '''
from typing import Literal
from qeval.tiers.base import TierMethod, TierSpec

class HalfTier(TierSpec):
    method: Literal["half"]
    scale: float = 0.5

class HalfMethod(TierMethod):
    method = "half"
    spec = HalfTier
    bytes_per_parameter = 0.25
    needs_artifact = True

METHODS = {"half": HalfMethod()}
'''


def test_a_new_method_is_one_module(tmp_path):
    """A module added to the tiers package (here on an extra package path) is a recipe
    method with its own fields and disk figure; nothing else is edited."""
    (tmp_path / "half.py").write_text(FAKE)
    code = (f"import qeval.tiers as t; t.__path__.append({str(tmp_path)!r})\n"
            "from qeval.recipe import parse_recipe\nfrom qeval.run import estimate_disk_bytes\n"
            "r = parse_recipe('name: x\\nmodel: {source: /m}\\ntiers: [{name: bf16, method: bf16}, "
            "{name: h, method: half, scale: 0.1}]\\n')\n"
            "print(r.tier('h').scale, estimate_disk_bytes(r, ['h'], 400))\n"
            "parse_recipe('name: x\\nmodel: {source: /m}\\ntiers: [{name: bf16, method: bf16}, "
            "{name: h, method: half, bits: 4}]\\n')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.stdout.split() == ["0.1", "100"], p.stderr[-2000:]
    assert "tiers[1].bits: unknown field" in p.stderr  # its schema is its own: gptq's fields are not


def test_unknown_method_lists_the_registered_ones(tmp_path):
    from qeval.errors import QevalInputError
    with pytest.raises(QevalInputError) as e:
        parse_recipe("name: x\nmodel: {source: /m}\ntiers:\n  - {name: a, method: gtpq}\n", tmp_path / "r.yaml")
    assert str(e.value).startswith(f"{tmp_path / 'r.yaml'}:4: tiers[0].method: unknown method 'gtpq'")
    for m in method_names():
        assert m in str(e.value)


def test_methods_open_engines_with_open_engine_not_load():
    """Issue 45: "load" names the load test; opening a tier's model is ``open_engine``. No
    built-in method still defines ``load`` (it would run through the deprecation shim)."""
    from qeval.tiers.base import TierMethod
    for name in method_names():
        for cls in type(get_method(name)).__mro__:
            if cls is not TierMethod:
                assert "load" not in vars(cls), f"{cls.__qualname__} defines load: rename it open_engine"


def _ctx():
    from qeval.tiers.base import TierContext
    return TierContext(source_path="/m", source_sha256="0" * 64, device="cpu")


def test_a_plugin_that_still_defines_load_keeps_working_with_a_deprecation_warning():
    """A tier method from another package written before the rename (its ``load`` calling
    ``super().load``) is still opened by ``open_engine``, with a DeprecationWarning naming the
    new method; a subclass of it defining ``open_engine`` goes through it without looping."""
    from qeval.tiers.base import TierMethod
    calls = []

    class Old(TierMethod):
        method = "old"
        needs_artifact = False

        def loaders(self):
            return {"hf": lambda spec, ctx, artifact: ("engine", spec.name)}

        def load(self, spec, ctx, artifact):
            calls.append("old")
            return super().load(spec, ctx, artifact)

    class New(Old):
        def open_engine(self, spec, ctx, artifact):
            calls.append("new")
            return super().open_engine(spec, ctx, artifact)

    spec = TierSpec(name="t")
    with pytest.warns(DeprecationWarning, match=r"define open_engine \(renamed from load\)"):
        assert Old().open_engine(spec, _ctx(), None) == ("engine", "t")
    assert calls == ["old"]
    calls.clear()
    with pytest.warns(DeprecationWarning):
        assert New().open_engine(spec, _ctx(), None) == ("engine", "t")
    assert calls == ["new", "old"]


def test_the_old_load_name_still_opens_with_a_deprecation_warning():
    """An old caller's ``method.load(...)`` opens as ``open_engine`` does, overrides included."""
    from qeval.tiers.base import TierMethod

    class Current(TierMethod):
        method = "current"
        needs_artifact = False

        def loaders(self):
            return {"hf": lambda spec, ctx, artifact: "base"}

        def open_engine(self, spec, ctx, artifact):
            return ("own", super().open_engine(spec, ctx, artifact))

    with pytest.warns(DeprecationWarning, match="renamed open_engine"):
        assert Current().load(TierSpec(name="t"), _ctx(), None) == ("own", "base")
