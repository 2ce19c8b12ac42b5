"""The engine registry: engines found by module, what each declares it can do, the
recipe's ``engine:`` per tier (default per method), and a tier loading on an engine
that only declares the format it opens."""
from __future__ import annotations

import pytest

from qeval import engines
from qeval.engines import engine_names, engines_for_format, get_engine
from qeval.engines.base import Capabilities, EngineOptions
from qeval.errors import QevalInputError
from qeval.recipe import parse_recipe
from qeval.tiers import get_method
from qeval.tiers.base import TierContext


def test_registry_finds_the_engine_modules():
    assert set(engine_names()) >= {"hf", "llamacpp"}
    for name in engine_names():
        cls = get_engine(name)
        assert cls.name == name and isinstance(cls.capabilities, Capabilities) and cls.formats
    assert engines_for_format("hf") == ("hf", "openai") and engines_for_format("gguf") == ("llamacpp", "openai")
    with pytest.raises(KeyError, match="unknown engine 'nope'.*hf"):
        get_engine("nope")


def test_capabilities_are_declared_not_probed():
    hf, cpp = get_engine("hf").capabilities, get_engine("llamacpp").capabilities
    assert hf.batch and hf.lm_eval and hf.memory_counter == "torch"
    assert cpp.batch and not cpp.lm_eval and cpp.memory_counter == "process"  # generate_batch (issue 18)
    assert hf.score and hf.generate and hf.kv_bytes and cpp.score and cpp.generate and cpp.kv_bytes


def test_each_method_has_a_default_engine_first():
    assert get_method("bf16").engines() == ("hf", "openai") and get_method("int8").engines() == ("hf", "openai")
    assert get_method("gptq").engines() == ("hf", "openai") and get_method("awq").engines() == ("hf", "openai")
    assert get_method("gguf").engines() == ("llamacpp", "openai")
    r = parse_recipe("name: x\nmodel: {source: /m}\ntiers: [{name: a, method: gguf}, {name: b, method: bf16, "
                     "engine: hf}]\ngate: {reference: b}\n")
    assert [get_method(t.method).engine_name(t) for t in r.tiers] == ["llamacpp", "hf"]


@pytest.mark.parametrize("tier, want", [
    ("{name: b, method: bf16, engine: llamacpp}", "engine 'llamacpp' cannot serve method bf16 (engines for bf16: hf, openai)"),
    ("{name: b, method: gguf, engine: vllm}", "unknown engine 'vllm' (known: "),
])
def test_recipe_engine_errors_name_the_line_and_field(tmp_path, tier, want):
    text = f"name: x\nmodel: {{source: /m}}\ntiers:\n  - {{name: a, method: bf16}}\n  - {tier}\n"
    with pytest.raises(QevalInputError) as e:
        parse_recipe(text, tmp_path / "r.yaml")
    assert str(e.value).startswith(f"{tmp_path / 'r.yaml'}:5: tiers[1].engine: {want}")


class _FakeEngine:
    """An engine that opens transformers checkpoints and records how it was asked."""
    name = "fake"
    formats = ("hf",)
    capabilities = Capabilities(batch=False, memory_counter="process", lm_eval=False)
    opened: list = []

    @classmethod
    def open(cls, fmt, path, options):
        cls.opened.append((fmt, str(path), options))
        return cls()


def test_a_new_engine_serves_every_method_of_its_format(monkeypatch):
    """Registering an engine (as its module's ``ENGINE`` would) is all it takes: the
    methods whose artifact format it opens can be served by it, chosen in the recipe."""
    monkeypatch.setattr(engines, "_REGISTRY", {**engines._registry(), "fake": _FakeEngine})
    assert "fake" in get_method("bf16").engines() and "fake" in get_method("int8").engines()
    assert "fake" not in get_method("gguf").engines() and "fake" not in get_method("gptq").engines()
    r = parse_recipe("name: x\nmodel: {source: /m}\ntiers: [{name: b, method: bf16, engine: fake, kv_cache: int8}]\n"
                     "gate: {reference: b}\n")
    ctx = TierContext(source_path="/m/src", source_sha256="0", device="cpu", threads=3)
    eng = get_method("bf16").open_engine(r.tier("b"), ctx, None)
    assert isinstance(eng, _FakeEngine)
    fmt, path, opts = _FakeEngine.opened[-1]
    assert (fmt, path) == ("hf", "/m/src")
    assert opts == EngineOptions(device="cpu", dtype="bfloat16", threads=3, kv_cache="int8", backend="torch-bfloat16")
