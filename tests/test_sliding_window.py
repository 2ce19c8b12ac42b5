"""Sliding-window and hybrid attention on transformers (issue 64, item 4): a tiny random
Gemma 3 (4 layers: 3 sliding with window 32, 1 full; depths past the window) and a tiny
mistral (every layer sliding), from :mod:`tests.tiny_models`.

* the depth cut-back of ``decode_again`` is exact: the same greedy tokens as after a fresh
  prefill, and the cache cut back equals a fresh prefill's (transformers' own ``crop``
  raises there: checked, so the test does reach a sliding layer past its window);
* the speed sweep's TTFT and decode figures come from that path without failing;
* the int8 KV cache quantizes the full-attention layer and keeps the sliding ones (label),
  and refuses a model whose layers all slide;
* KV bytes at a depth: ``full x depth + sliding x min(depth, window)`` per layer's bytes,
  from the config file and from the engine, against the bytes of a filled cache.
"""
from __future__ import annotations

import json
import random

import pytest

from tiny_models import build_tiny_gemma3, build_tiny_mistral, build_tiny_qwen2, gemma3_layer_types

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("g3") / "tiny-gemma3")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build_tiny_mistral(tmp_path_factory.mktemp("mi") / "tiny-mistral")


@pytest.fixture(scope="module")
def g3_engine(gemma3):
    from qeval.engines.hf import HFEngine, load_hf_model
    return HFEngine(load_hf_model(str(gemma3), "cpu"), "cpu")


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def test_tiny_checkpoints_are_hybrid_and_small(gemma3, mistral):
    cfg = json.loads((gemma3 / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] and cfg["sliding_window"] == 32
    assert json.loads((mistral / "config.json").read_text())["sliding_window"] == 32
    assert (gemma3 / "tokenizer.json").is_file() and "chat_template" in (gemma3 / "tokenizer_config.json").read_text() \
        or (gemma3 / "chat_template.jinja").is_file()
    assert gemma3_layer_types(18, 6).count("sliding_attention") == 15  # Gemma 3 270M's pattern


@pytest.mark.parametrize("depth", [30, 64, 128])
def test_decode_again_past_the_window_matches_a_fresh_prefill(g3_engine, depth):
    """30: the prompt inside the window, the decode past it (the cut-back crosses it);
    64 and 128: the prompt past it. Tokens equal a fresh prefill's, and so does the cache."""
    from transformers import DynamicCache

    e = g3_engine
    ids = _ids(depth, e.vocab_size, depth)
    fresh = e.generate(ids, 12, ignore_stop=True)
    cache = e._cached[1]
    sliding = [lay for lay in cache.layers if getattr(lay, "is_sliding", False)]
    assert sliding and sliding[0].get_seq_length() >= sliding[0].sliding_window
    again = e.decode_again(ids, 12)
    assert again is not None, "decode_again fell back to a prefill"
    assert again.token_ids == fresh.token_ids
    assert e.decode_again(ids, 12).token_ids == fresh.token_ids  # a second cut-back from the same copy
    # the cut-back cache against a fresh prefill of depth - 1 tokens, layer by layer
    assert e._cached is not None and e._cached[1].get_seq_length() == depth + 11
    from qeval.engines.hf import cut_back
    assert cut_back(cache, depth - 1, e._cached[2])
    ref = DynamicCache(config=e.model.config)
    with torch.inference_mode():
        e.model(input_ids=torch.tensor([ids[:-1]]), cache=ref, use_cache=True)
    for a, b in zip(cache.layers, ref.layers):
        assert a.get_seq_length() == b.get_seq_length() == depth - 1
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys.float(), b.keys.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(a.values.float(), b.values.float(), atol=2e-2, rtol=2e-2)
    # transformers' own crop cannot do it: what failed the user's bf16/int8/gptq tiers
    plain = DynamicCache(config=e.model.config)
    with torch.inference_mode():
        e.model(input_ids=torch.tensor([ids]), cache=plain, use_cache=True)
        for _ in range(3):
            e.model(input_ids=torch.tensor([[5]]), cache=plain, use_cache=True)
    if depth + 3 >= 32:
        with pytest.raises(RuntimeError, match="does not track past states"):
            plain.crop(-4)


def test_sliding_layers_decode_in_their_window(g3_engine):
    """The window copy leaves the decode as the model's own: after generate, each sliding
    layer holds window - 1 rows and does not record."""
    e = g3_engine
    e.generate(_ids(100, e.vocab_size), 6, ignore_stop=True)
    for lay in e._cached[1].layers:
        if getattr(lay, "is_sliding", False):
            assert lay.keys.shape[-2] == lay.sliding_window - 1 and not lay.record_past


def test_speed_sweep_on_hybrid_decodes_from_the_cut_back_cache(g3_engine):
    from qeval.measure.memory import PeakMemory
    from qeval.measure.speed import speed_sweep

    e = g3_engine
    prompts = {64: _ids(64, e.vocab_size, 1), 128: _ids(128, e.vocab_size, 2)}
    speed, _peaks, kv, _extra = speed_sweep(e, prompts, decode_tokens=6, repeats=3, warmup=0,
                                            peak=PeakMemory("cpu"), prefill_repeats=1)
    for d in ("64", "128"):
        row = speed[d]
        assert row["decode_from_cache"] == 2 and len(row["ttft_s_all"]) == 1 and row["ttft_s"] > 0
        assert len(row["decode_tokens_per_s_all"]) == 3 and row["decode_tokens_per_s"] > 0
    lay = e.kv_layout()
    for d, held in kv.items():  # the cache after depth + 5 tokens, as the formula has it
        assert abs(held - e.kv_bytes_at_depth(int(d) + 5)) <= 0.05 * held, (d, held)
    # the slope between two depths past the window counts the full layer only
    from qeval.measure.speed import kv_bytes_per_token_from_sweep
    assert kv_bytes_per_token_from_sweep(kv, 6) == pytest.approx(lay["full"] * lay["bytes_per_layer_token"], rel=0.01)


def test_kv_bytes_at_depth_formula_against_the_filled_cache(gemma3, g3_engine):
    from qeval.model_config import kv_bytes_at_depth, model_shape

    cfg = json.loads((gemma3 / "config.json").read_text())
    shape = model_shape(cfg)
    assert (shape.full_layers, shape.sliding_layers, shape.sliding_window) == (1, 3, 32)
    per_layer = 2 * shape.kv_heads * shape.head_dim * 2
    for depth in (16, 64, 200):
        formula = kv_bytes_at_depth(cfg, depth)
        assert formula == per_layer * (1 * depth + 3 * min(depth, 32))
        assert g3_engine.kv_bytes_at_depth(depth) == formula
        filled = g3_engine.filled_cache_bytes(depth)
        assert abs(filled - formula) <= 0.05 * formula, (depth, filled, formula)
    # the all-layers figure would count the sliding layers at the whole depth
    assert shape.kv_elements_per_token * 2 * 200 > 2 * kv_bytes_at_depth(cfg, 200)
    assert "3 sliding (window 32)" in shape.kv_layout()
    att = g3_engine.attention_info(_ids(40, g3_engine.vocab_size))
    assert att["kv_layout"]["kv_bytes_at_depth"] == f"{per_layer} x (1 x depth + 3 x min(depth, 32))"
    assert "3 of 4 layers sliding, window 32" in att["kv_cache_dtype"]


def test_int8_kv_on_hybrid_quantizes_the_full_layers(gemma3):
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.model_config import int8_kv_layers

    cfg = json.loads((gemma3 / "config.json").read_text())
    assert int8_kv_layers(cfg) == ((3,), (0, 1, 2))
    e = HFEngine(load_hf_model(str(gemma3), "cpu"), "cpu", kv_cache="int8", kv_residual=16)
    assert e.backend.endswith(" + KV int8 (HQQ) on 1 of 4 layers (3 sliding, BF16, window 32)"), e.backend
    assert e.kv_quantized_layers == [3]
    cache = e.new_cache()
    assert [type(lay).__name__ for lay in cache.layers] == ["DynamicSlidingWindowLayer"] * 3 + ["HQQQuantizedLayer"]
    ids = _ids(80, e.vocab_size)
    g = e.generate(ids, 20, ignore_stop=True)  # past the residual: the full layer re-quantizes
    assert len(g.token_ids) == 20
    assert e.decode_again(ids, 4) is None  # a quantized cache is not cut back: the sweep prefills
    out = e.generate_batch([ids[:40], ids[:50]], 4)
    assert [len(t) for t, _ in out] == [4, 4]
    assert "on 1 of 4 layers" in e.kv_cache_dtype()
    # the int8 full layer holds less than BF16 would at a depth past the residual
    assert e.filled_cache_bytes(200) < HFEngine(e.model, "cpu").filled_cache_bytes(200)


def test_int8_kv_refused_where_every_layer_slides(mistral):
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.model_config import int8_kv_layers

    cfg = json.loads((mistral / "config.json").read_text())
    assert int8_kv_layers(cfg) == ((), (0, 1))
    model = load_hf_model(str(mistral), "cpu")
    with pytest.raises(ValueError, match="full-attention layers only.*sliding_attention, window 32"):
        HFEngine(model, "cpu", kv_cache="int8")
    e = HFEngine(model, "cpu")  # the model's own cache runs, and cuts back exactly
    ids = _ids(90, e.vocab_size)
    g = e.generate(ids, 8, ignore_stop=True)
    assert e.decode_again(ids, 8).token_ids == g.token_ids
    assert abs(e.filled_cache_bytes(90) - e.kv_bytes_at_depth(90)) <= 0.05 * e.kv_bytes_at_depth(90)


def test_full_attention_models_unchanged(tmp_path, tiny_llama):
    """No sliding layer: the int8 label, the cache class and the per-token figure as before."""
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.model_config import int8_kv_layers, model_shape

    q2 = build_tiny_qwen2(tmp_path / "q2")
    cfg = json.loads((q2 / "config.json").read_text())
    assert int8_kv_layers(cfg) == ((0, 1), ())
    shape = model_shape(cfg)
    assert shape.sliding_layers == 0 and shape.kv_bytes_at(100) == shape.kv_elements_per_token * 2 * 100
    e = HFEngine(load_hf_model(str(tiny_llama), "cpu"), "cpu", kv_cache="int8")
    assert e.backend.endswith(" + KV int8 (HQQ)") and type(e.new_cache()).__name__ == "QuantizedCache"


@pytest.mark.parametrize("cfg, types, window", [
    ({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": False},
     ["full_attention"] * 4, 4096),
    ({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True,
      "max_window_layers": 2}, ["full_attention"] * 2 + ["sliding_attention"] * 2, 64),
    ({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512, "sliding_window_pattern": 3},
     ["sliding_attention", "sliding_attention", "full_attention"] * 2, 512),
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096},
     ["sliding_attention", "full_attention"] * 2, 4096),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}, ["full_attention"] * 2, None),
    ({"model_type": "llama", "num_hidden_layers": 2}, ["full_attention"] * 2, None),
])
def test_attention_layer_types_from_config(cfg, types, window):
    from qeval.model_config import attention_layer_types
    assert attention_layer_types(cfg) == (types, window)


def test_gemma3_270m_figures():
    """The user's Gemma 3 270M (18 layers, 15 sliding at window 512, 1 KV head of 256):
    1 KiB per layer and token in BF16; at depth 1024, 3 x 1024 + 15 x 512 layer-tokens."""
    from qeval.analysis.capacity import kv_split_from_config, max_context, max_sequences
    from qeval.model_config import kv_bytes_at_depth

    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144,
           "sliding_window": 512, "layer_types": gemma3_layer_types(18, 6)}
    assert kv_bytes_at_depth(cfg, 1024) == 1024 * (3 * 1024 + 15 * 512)
    full, sliding, window = kv_split_from_config(cfg)
    assert (full, sliding, window) == (3 * 1024, 15 * 1024, 512)
    gib = 2 ** 30
    # 1 GiB of KV at context 1024: 1 GiB / 10.5 MiB per sequence
    assert max_sequences(2 * gib, 0.5 * gib, 0.5 * gib, full, 1024, sliding=(sliding, window)) == \
        gib // (1024 * (3 * 1024 + 15 * 512))
    c = max_context(2 * gib, 0.5 * gib, 0.5 * gib, full, 4, sliding=(sliding, window))
    assert 4 * (full * c + sliding * min(c, window)) <= gib < 4 * (full * (c + 1) + sliding * min(c + 1, window))


def test_serving_cores_run_the_hybrid_caches(gemma3):
    """The load stage's cores on the hybrid model: transformers' continuous batching with the
    model's cache, qeval's static batches with the hybrid int8 cache; admission at the load
    depth counts the sliding layers (``ServingContext``)."""
    from types import SimpleNamespace

    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.measure.load import Slo, distinct_prompts
    from qeval.serving.closed_loop import load_sweep
    from qeval.serving.workload import ServingContext

    model = load_hf_model(str(gemma3), "cpu")
    base = _ids(400, 500, 3)
    for kv, sched in (("model", "continuous"), ("int8", "static")):
        e = HFEngine(model, "cpu", kv_cache=kv)
        out = load_sweep(e, distinct_prompts(base, 48), concurrency=[2], depth=48, output_tokens=4,
                         requests_per_stream=1, prefill_chunk=16, slo=Slo(60.0, 60.0),
                         kv_bytes_per_token=e.kv_bytes_per_token(64))
        assert out["scheduling"] == [sched] and out["points"][0]["admitted"], out
        assert out["points"][0]["requests"] == 2
    e = HFEngine(model, "cpu")
    slope = e.kv_layout()["bytes_per_layer_token"]  # the full layer's: what a sweep past the window measures
    ctx = ServingContext(engine=e, load=SimpleNamespace(output_tokens=16), base_ids=base, depth=48,
                         kv_bytes_per_token=slope)
    assert ctx.kv_bytes_per_token_measured == slope
    assert ctx.kv_bytes_per_token == pytest.approx(e.kv_bytes_at_depth(64) / 64) and ctx.kv_bytes_per_token > slope


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2", "qwen3", "phi3"])
def test_model_shape_counts_every_family_as_transformers(family, tmp_path):
    """``qeval plan``'s tensor list from config.json alone against the built model's
    parameters (gemma3: q/k norms and the norms around the MLP)."""
    from transformers import AutoModelForCausalLM

    from qeval.model_config import model_shape
    from tiny_models import BUILDERS

    p = BUILDERS[family](tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(p)
    assert model_shape(json.loads((p / "config.json").read_text())).params == sum(x.numel() for x in model.parameters())
