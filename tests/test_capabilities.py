"""What a tier can run, decided from the model's structure at validate (issue 64, item 3):
the structure read from ``config.json`` (layer types, window, experts; never the model's
name), each tier method's declaration, the refusal of a tier that cannot run in one line
(exit 2, naming the tiers that would run), and README's table generated from the
declarations."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, write_recipe
from qeval.model_config import STRUCTURES, model_structure
from qeval.tiers import get_method, method_names
from qeval.tiers.base import capability_table
from tiny_models import build_tiny_gemma3, build_tiny_mistral, build_tiny_phi3, build_tiny_qwen3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("caps")
    return {"gemma3": build_tiny_gemma3(root / "g3"), "mistral": build_tiny_mistral(root / "mi"),
            "qwen3": build_tiny_qwen3(root / "q3"), "phi3": build_tiny_phi3(root / "p3")}


def _cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_structure_comes_from_the_config(models):
    g3 = model_structure(_cfg(models["gemma3"]))
    assert g3.kinds == ("hybrid",) and (g3.full_layers, g3.sliding_layers, g3.window) == (1, 3, 32)
    assert g3.describe() == "hybrid: 1 full, 3 sliding (window 32) of 4 layers"
    mi = model_structure(_cfg(models["mistral"]))
    assert mi.kinds == ("sliding",) and mi.full_layers == 0
    for fam in ("qwen3", "phi3"):
        assert model_structure(_cfg(models[fam])).kinds == ("full",)
    # the same structure under another name is the same structure (never the name)
    renamed = dict(_cfg(models["gemma3"]), model_type="somethingnew", architectures=["NewForCausalLM"])
    renamed["layer_types"] = ["sliding_attention"] * 3 + ["full_attention"]
    assert model_structure(renamed).kinds == ("hybrid",)
    moe = dict(_cfg(models["qwen3"]), num_experts=8)
    assert model_structure(moe).kinds == ("full", "experts")
    rec = dict(_cfg(models["qwen3"]), layer_types=["linear_attention", "full_attention"])
    assert model_structure(rec).kinds == ("hybrid", "recurrent")


def test_int8_kv_on_transformers_is_refused_where_every_layer_slides_and_counted_on_hybrids(models):
    from types import SimpleNamespace
    kv8 = SimpleNamespace(name="kv8", method="bf16", kv_cache="int8", engine=None)
    v, why = get_method("bf16").capability(kv8, model_structure(_cfg(models["mistral"])))
    assert v == "refused" and "quantizes full-attention layers only" in why and "2 layers" in why
    v, why = get_method("bf16").capability(kv8, model_structure(_cfg(models["gemma3"])))
    assert v == "runs" and "int8 KV on 1 of 4 layers (3 sliding kept in the model's dtype, window 32)" in why
    # llama.cpp's q8_0 KV quantizes every layer, SWA ones too: not refused
    q8 = SimpleNamespace(name="q8", method="gguf", kv_cache="int8", engine=None)
    assert get_method("gguf").capability(q8, model_structure(_cfg(models["mistral"])))[0] != "refused"


def test_a_gguf_tier_of_an_architecture_the_converter_lacks_is_refused(models, monkeypatch):
    from types import SimpleNamespace

    from qeval.engines import gguf_convert
    monkeypatch.setattr(gguf_convert, "converter_architectures", lambda folder=None: frozenset({"LlamaForCausalLM"}))
    spec = SimpleNamespace(name="q4", method="gguf", kv_cache="model", engine=None)
    v, why = get_method("gguf").capability(spec, model_structure(_cfg(models["qwen3"])))
    assert v == "refused" and "registers no Qwen3ForCausalLM" in why
    monkeypatch.setattr(gguf_convert, "converter_architectures", lambda folder=None: frozenset())
    assert get_method("gguf").capability(spec, model_structure(_cfg(models["qwen3"])))[0] == "runs"  # not fetched


def test_the_converter_registry_is_read_from_its_source(tmp_path):
    from qeval.engines import gguf_convert
    f = tmp_path / "conv"
    (f / "conversion").mkdir(parents=True)
    (f / "gguf-py" / "gguf").mkdir(parents=True)
    for rel in ("convert_hf_to_gguf.py", "conversion/__init__.py", "gguf-py/gguf/__init__.py", ".qeval-complete"):
        (f / rel).write_text("")
    (f / "conversion" / "g.py").write_text('@ModelBase.register(\n    "Gemma3ForCausalLM",\n    "Gemma3Model")\nclass X: ...\n'
                                           "@ModelBase.register('LlamaForCausalLM')\n")
    assert gguf_convert.converter_present(f)
    assert gguf_convert.converter_architectures(f) == {"Gemma3ForCausalLM", "Gemma3Model", "LlamaForCausalLM"}


def test_validate_prints_per_tier_and_refuses_a_tier_that_cannot_run(models, tmp_path):
    tiers = ("  - {name: bf16, method: bf16}\n  - {name: int8, method: int8}\n"
             "  - {name: bf16-kv8, method: bf16, kv_cache: int8}\n")
    ok = write_recipe(tmp_path / "g3.yaml", models["gemma3"], tiers=tiers, load=False)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(ok)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("runs ")]
    assert lines[0] == "runs     bf16: runs (hybrid: 1 full, 3 sliding (window 32) of 4 layers)"
    assert lines[1].startswith("runs     int8: untested (hybrid") and "not yet run by qeval's tests" in lines[1]
    assert "int8 KV on 1 of 4 layers" in lines[2]
    bad = write_recipe(tmp_path / "mi.yaml", models["mistral"], tiers=tiers, load=False)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(bad)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and re.search(r"mi\.yaml:\d+: tiers\[2\]\.method: tier 'bf16-kv8' cannot run on this model "
                                       r"\(sliding: 0 full, 2 sliding \(window 32\) of 2 layers\)", err[0]), err
    assert err[0].endswith("tiers that would run: bf16, int8"), err[0]


def test_readme_table_is_the_declarations():
    """README "Your own model" holds exactly the table the declarations make."""
    table = capability_table({m: get_method(m) for m in method_names()})
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert table in readme, table
    for m in method_names():
        assert set(get_method(m).structures) == set(STRUCTURES), m
        assert all(v in ("runs", "untested") or len(v) > 10 for v in get_method(m).structures.values())


def test_plan_sizes_a_sliding_window_models_sequences_by_layer_type(models):
    """``qeval plan`` on a hybrid model: a sequence at context c holds full x c + sliding x
    min(c, window) (the tiny gemma3: 1 full and 3 sliding layers of 64 B per token each in
    BF16, window 32), not every layer x c."""
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "plan", "--model", str(models["gemma3"] / "config.json"),
                        "--gpu", "rtx4090", "--context", "4096", "--users", "4", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    row = next(r for r in json.loads(p.stdout)["rows"] if r["tier"] == "bf16")
    free = row["kv_budget_bytes"]["value"]
    per_layer = 2 * 1 * 16 * 2  # K and V x 1 KV head x head_dim 16 x 2 bytes
    assert row["sequences"]["value"] == free // (per_layer * 4096 + 3 * per_layer * 32)
    assert any("KV at context c = 64 B x c + 192 B x min(c, 32)" in n for n in row["notes"]), row["notes"]
