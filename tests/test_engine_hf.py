"""The transformers engine on a tiny random llama: scoring windows, greedy decoding,
KV-cache bytes, stored weight bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qeval.engines.base import score
from qeval.engines.hf import HFEngine, cache_nbytes, load_hf_model, model_weight_bytes, tensor_storage_bytes


@pytest.fixture(scope="module")
def engine(tiny_llama):
    torch.set_num_threads(1)
    return HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")


def _full_logprobs(model, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).numpy()


def test_windowed_scoring_matches_one_forward(engine):
    ids = list(np.random.default_rng(0).integers(0, engine.vocab_size, 50))
    full = _full_logprobs(engine.model, ids)
    rows = np.concatenate([lp for _, lp in engine.iter_logprobs(ids, window=7)])
    assert rows.shape == full.shape == (49, engine.vocab_size)
    np.testing.assert_allclose(rows, full, atol=2e-4)
    # 'first' skips the prefix but gives the same rows after it
    tail = np.concatenate([lp for _, lp in engine.iter_logprobs(ids, window=7, first=20)])
    np.testing.assert_allclose(tail, full[20:], atol=2e-4)
    s = score(engine, ids, window=16)
    np.testing.assert_allclose(s, full[np.arange(49), ids[1:]], atol=2e-4)


def test_greedy_generate_matches_transformers_generate(engine):
    prompt = [5, 17, 42, 99, 3, 8]
    g = engine.generate(prompt, 12, ignore_stop=True)
    with torch.inference_mode():
        ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, min_new_tokens=12)
    assert g.token_ids == ref[0, len(prompt):].tolist()
    assert len(g.token_times_s) == 12 and g.prefill_s == g.token_times_s[0]
    assert all(b >= a for a, b in zip(g.token_times_s, g.token_times_s[1:]))
    assert g.decode_tokens_per_s and g.decode_tokens_per_s > 0
    assert not g.finished


def test_generate_stops_on_stop_token(engine):
    prompt = [5, 17, 42]
    free = engine.generate(prompt, 10, ignore_stop=True)
    stop = free.token_ids[3]
    g = engine.generate(prompt, 10, stop_ids=[stop])
    assert g.finished and g.token_ids[-1] == stop
    assert g.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_batched_answers_match_single_greedy(engine):
    prompts = [[5, 17, 42, 99], [7, 8]]
    outs = engine.generate_batch(prompts, 6, stop_ids=[], pad_id=0)
    for p, (ids, fin) in zip(prompts, outs):
        assert ids == engine.generate(p, 6, ignore_stop=True).token_ids
        assert not fin


def test_kv_bytes_per_token_matches_the_formula(engine):
    cfg = engine.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # 2 (K and V) x layers x kv heads x head dim x bytes per element (float32 here)
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    assert engine.kv_bytes_per_token(32) == pytest.approx(expected)


def test_int8_kv_cache_is_smaller_past_the_residual_window(tiny_llama):
    pytest.importorskip("hqq")
    model = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    dense = HFEngine(model, "cpu")
    q8 = HFEngine(model, "cpu", kv_cache="int8")
    depth = 600  # beyond the 128-token full-precision residual buffer
    assert q8.kv_bytes_per_token(depth) < 0.8 * dense.kv_bytes_per_token(depth)


def test_the_int8_cache_residual_is_the_tiers_setting(tiny_llama):
    """``kv_residual_tokens`` reaches the cache (fewer full-precision tokens: fewer bytes at
    the same depth), the re-quantization period the timed decode spans, and the label."""
    pytest.importorskip("hqq")
    from qeval.tiers.bf16 import Bf16Tier
    from qeval.worker import decode_tokens_for
    model = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    default, short = HFEngine(model, "cpu", kv_cache="int8"), HFEngine(model, "cpu", kv_cache="int8", kv_residual=32)
    assert (default.kv_requant_period, short.kv_requant_period) == (128, 32)
    assert decode_tokens_for(None, short, 16) == 33
    import torch
    held = {}
    for name, eng in (("default", default), ("short", short)):
        cache = eng.new_cache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5 + i for i in range(64)]]), past_key_values=cache, use_cache=True)
            for t in range(40):  # 40 decode steps: 32 re-quantizes once, 128 never
                model(input_ids=torch.tensor([[7 + t]]), past_key_values=cache, use_cache=True)
        held[name] = cache.layers[0].keys.shape[-2]  # tokens still in full precision
    assert held == {"default": 40, "short": 8}
    assert short.kv_cache_dtype().endswith("residual of 32 tokens")
    assert Bf16Tier(name="q", method="bf16", kv_cache="int8", kv_residual_tokens=32).kv_residual_tokens == 32
    with pytest.raises(ValueError, match="needs kv_cache: int8"):
        Bf16Tier(name="q", method="bf16", kv_residual_tokens=32)


def test_int8_kv_cache_takes_any_prompt_length(tiny_llama):
    """HQQ groups the whole K/V tensor: with 2 KV heads x 16 dims (32 elements a token) groups
    of 64 failed at odd lengths (long-context prompts are a few tokens short of their depth)."""
    pytest.importorskip("hqq")
    model = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    q8 = HFEngine(model, "cpu", kv_cache="int8")
    assert q8.kv_group_size() == 32
    def ids(n: int) -> list[int]:
        return [5 + i % 400 for i in range(n)]
    for n in (637, 301):
        g = q8.generate(ids(n), 3, ignore_stop=True)
        assert len(g.token_ids) == 3
    assert len(q8.generate_batch([ids(301), ids(95)], 2)) == 2


def test_stored_bytes_count_tied_weights_once(tiny_llama):
    model = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n = sum(p.numel() for p in model.parameters())  # parameters() already dedupes tied
    assert model_weight_bytes(model) >= n * 2
    naive = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert model_weight_bytes(model) < naive  # the tied lm_head is not counted twice
    a = torch.zeros(10, dtype=torch.float32)
    assert tensor_storage_bytes([a, a[2:5], a.view(2, 5)]) == 40


def test_cache_nbytes_counts_keys_and_values(engine):
    from transformers import DynamicCache
    cache = DynamicCache(config=engine.model.config)
    with torch.inference_mode():
        engine.model(input_ids=torch.tensor([[1, 2, 3, 4]]), **{engine._cache_kw: cache}, use_cache=True)
    assert cache_nbytes(cache) == 4 * engine.kv_bytes_per_token(4)


@pytest.mark.parametrize("kv", ["model", "int8"])
def test_generate_scored_gives_iter_logprobs_rows_and_a_greedy_answer(tiny_llama, kv):
    """Long-context scoring in the generation prefill: exactly iter_logprobs' rows for the
    scored span (same chunks, same cache), then greedy decoding on that cache."""
    if kv == "int8":
        pytest.importorskip("hqq")
    model = load_hf_model(str(tiny_llama), "cpu", "bfloat16")
    eng = HFEngine(model, "cpu", kv_cache=kv)
    ids = [5 + (7 * i) % 400 for i in range(301)]
    g, rows = eng.generate_scored(ids, 200, 261, 5, window=16)
    want = list(eng.iter_logprobs(ids[:261], 16, 199))
    assert [j for j, _ in rows] == [s - 199 for s, _ in want] and sum(len(x) for _, x in rows) == 61
    for (_, a), (_, b) in zip(rows, want):
        assert np.array_equal(a, b)
    assert len(g.token_ids) == 5
    if kv == "model":  # in float32 chunking does not move the argmax: the answer is generate()'s
        e32 = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
        assert e32.generate_scored(ids, 200, 261, 5, window=16)[0].token_ids == e32.generate(ids, 5).token_ids
        # a scored span of whole windows (here 64 = 4 x 16: score_end - score_start + 1): the
        # token at score_end - 1 is still fed (it once was skipped, shifting every later position)
        assert e32.generate_scored(ids, 200, 264, 5, window=16)[0].token_ids == e32.generate(ids, 5).token_ids
        assert e32.generate_scored(ids, 237, 301, 5, window=16)[0].token_ids == e32.generate(ids, 5).token_ids
    with pytest.raises(ValueError):
        eng.generate_scored(ids, 0, 10, 2)
