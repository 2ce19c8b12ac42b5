"""Artifact cache keys, the reference-pass key and tier fingerprints must not move when the
code around them is restructured: a moved key rebuilds every cached artifact, a moved
fingerprint refuses every ``--resume``. The values below were recorded with the code
before the run format, engine registry and tier schemas moved (issue 12); library
versions are pinned to fixed strings so the keys do not depend on this machine. (Recorded
with main's own code: the artifact keys and the reference key at 018066d, the fingerprints
again at abdac54, whose recipe path fields (``speed.depth_text``, ``builtin:`` defaults)
moved them; the artifact keys and the reference key did not move.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from qeval.artifacts import artifact_key
from qeval.recipe import parse_recipe
from qeval.run import tier_fingerprint
from qeval.tiers import get_method
from qeval.tiers.base import TierContext

REPO = Path(__file__).resolve().parent.parent
RECIPE = """name: keys
model: {source: /nonexistent/model}
tiers:
  - {name: bf16, method: bf16}
  - {name: int8, method: int8}
  - {name: gptq, method: gptq, group_size: 64}
  - {name: awq, method: awq, group_size: 64}
  - {name: q4, method: gguf, type: q4_k_m}
  - {name: q4-kv8, method: gguf, type: Q4_K_M, kv_cache: int8}
  - {name: bf16-kv8, method: bf16, kv_cache: int8}
suites:
  - {name: lo, path: tests/data/suite_long.jsonl, kind: long_output, max_new_tokens: 12, limit: 2}
  - {name: mt, path: tests/data/suite_multi.jsonl, kind: multi_turn, max_new_tokens: 8}
"""

# artifact_key(method.key_fields(spec, ctx)) with every library version "1.0"
KEYS = {"int8": "52233b6458e85d23", "gptq": "e397c4ef98ffd11d", "awq": "deaf80d065496e0b",
        "q4": "ac61c774ce82fcc6", "q4-kv8": "ac61c774ce82fcc6"}
REFERENCE_KEY = "8546a39e3e133ea6"
FINGERPRINTS = {"bf16": "712046c295918a7c", "int8": "007c3ed2749e4778", "gptq": "68f24d3527877bad",
                "awq": "8d6929a2c9fc9bec", "q4": "6650ef606a954307", "q4-kv8": "336e11fe798f3d1c",
                "bf16-kv8": "614af18a0b2a471c"}


@pytest.fixture()
def pinned(monkeypatch):
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    import qeval.engines.gguf_convert as gc
    import qeval.quality_stages as q
    for mod in (gc, q):  # modules that bound importlib.metadata.version at import
        monkeypatch.setattr(mod, "version", lambda name: "1.0")


def _ctx() -> TierContext:
    return TierContext(source_path="/nonexistent/model", source_sha256="a" * 64, device="cpu",
                       calibration_fields={"sha256": "b" * 64, "samples": 32, "seq_len": 256})


def test_artifact_keys_are_unchanged(pinned, monkeypatch):
    from qeval.engines import bf16_matmul
    # AWQ calibrated natively (a CPU with a fast bfloat16 path, or CUDA) keeps its key
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: True)
    r = parse_recipe(RECIPE)
    got = {}
    for name in KEYS:
        spec = r.tier(name)
        got[name] = artifact_key(get_method(spec.method).key_fields(spec, _ctx()))
    assert got == KEYS
    # with float32 calibration matmuls (calibration_matmul auto on a CPU without one) it is another artifact
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: False)
    spec = r.tier("awq")
    assert artifact_key(get_method("awq").key_fields(spec, _ctx())) != KEYS["awq"]


def test_reference_key_is_unchanged(pinned, monkeypatch):
    from qeval.quality_stages import reference_fields
    monkeypatch.chdir(REPO)  # the suite paths are relative to the repository
    r = parse_recipe(RECIPE)
    from qeval.engines import bf16_matmul
    # a bfloat16 reference computed natively (a CPU with a fast bfloat16 path, or CUDA) keeps its key
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: True)
    assert artifact_key(reference_fields(r, _ctx())) == REFERENCE_KEY
    # as float32 matmuls (quality.bf16_matmul auto on a CPU without one) it is another pass
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: False)
    assert artifact_key(reference_fields(r, _ctx())) != REFERENCE_KEY
    # a reference computed in float32 (quality.reference_dtype, CPU default) is another pass
    from qeval.quality_stages import reference_context
    assert artifact_key(reference_fields(r, reference_context(r, _ctx()))) != REFERENCE_KEY


def test_tier_fingerprints_are_unchanged():
    r = parse_recipe(RECIPE)
    d = r.model_dump(mode="json")
    assert {t.name: tier_fingerprint(d, t.name) for t in r.tiers} == FINGERPRINTS
