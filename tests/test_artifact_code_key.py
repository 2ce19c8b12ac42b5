"""An artifact's cache key holds the code that builds it (qeval.tiers.base.TierMethod.code_sha256):
after an upgrade that changes a quantizer, the prepare stage builds the artifact again
instead of serving what the old code wrote; a change to code that builds nothing of it does
not move the key."""
from __future__ import annotations

import importlib
import sys

from qeval.artifacts import artifact_key
from qeval.tiers import get_method
from qeval.tiers.base import TierContext, TierMethod


def _ctx() -> TierContext:
    return TierContext(source_path="/nonexistent", source_sha256="0" * 64, device="cpu", dtype="bfloat16")


def test_changing_a_quantizer_module_changes_its_artifact_key_and_no_other(tmp_path, monkeypatch):
    pkg = tmp_path / "qeval_fakequant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("SCALE = 1.0\n")
    (pkg / "other.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    src = ("from qeval.tiers.base import TierMethod\n"
           "class FakeMethod(TierMethod):\n"
           "    method = 'fake'\n"
           "    builder_modules = ('qeval_fakequant.helper',)\n")
    (pkg / "method.py").write_text(src)

    def fresh_key() -> str:
        for name in [n for n in sys.modules if n.startswith("qeval_fakequant")]:
            del sys.modules[name]
        mod = importlib.import_module("qeval_fakequant.method")
        m = mod.FakeMethod()
        m.__class__.__module__ = "qeval.fake_method"  # counted as qeval's own code
        sys.modules["qeval.fake_method"] = mod
        fields = {**TierMethod.key_fields(m, None, _ctx()), "code": m.code_sha256()}  # type: ignore[arg-type]
        return artifact_key(fields)

    base = fresh_key()
    assert fresh_key() == base  # the same code: the same key
    (pkg / "helper.py").write_text("SCALE = 2.0  # the scale off by 2x\n")
    changed = fresh_key()
    assert changed != base  # a builder module changed: the artifact is built again
    (pkg / "other.py").write_text("X = 2\n")
    assert fresh_key() == changed  # a module that builds nothing of it: the key stays
    (pkg / "method.py").write_text(src + "    bytes_per_parameter = 1.0\n")
    assert fresh_key() != changed  # the method's own module changed


def test_every_shipped_method_keys_its_artifacts_by_its_code():
    """The prepare stage's fields (qeval.worker.stage_prepare: ``artifact_fields``) hold the
    method's code hash beside its spec fields; methods built by other code hash differently,
    GPTQ and AWQ (one module, one builder) alike."""
    from qeval.recipe import parse_recipe
    r = parse_recipe("name: k\nmodel: {source: /nonexistent}\ntiers:\n  - {name: bf16, method: bf16}\n  - {name: i8, method: int8}\n")
    spec = r.tier("i8")
    fields = get_method("int8").artifact_fields(spec, _ctx())
    assert fields["code"] == get_method("int8").code_sha256() and fields["method"] == "int8"
    codes = {name: get_method(name).code_sha256() for name in ("int8", "gptq", "awq", "gguf")}
    assert codes["gptq"] == codes["awq"] and len({codes["int8"], codes["gptq"], codes["gguf"]}) == 3
    assert "qeval.engines.gguf_convert" in get_method("gguf").builder_modules
    assert "qeval.tiers.int8" in get_method("gptq").builder_modules
