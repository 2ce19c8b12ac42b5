"""The transformers engine on a tiny random llama: scoring windows, greedy decoding,
KV-cache bytes, stored weight bytes."""
from __future__ import annotations

from types import SimpleNamespace

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


# ---- static decode: what torch.compile did, in the row (issue 48) ------------------------------
# inductor compiles on this CPU machine (g++ present): by hand, the forced break below gave the
# same record under inductor (fullgraph False, 3 graphs, the same break reason) in 29 s with a
# cold inductor cache on 2 shared cores. Dynamo decides graph breaks and recompiles before any
# backend runs, so these tests count them with backend="eager" (dynamo, no code generation).

def _static_engine(tiny_llama, monkeypatch=None, *, break_graph=False):
    torch.set_num_threads(1)
    torch._dynamo.reset()  # dynamo's code cache is per process: earlier tests' compiles would count here
    model = load_hf_model(str(tiny_llama), "cpu", "float32")
    if break_graph:  # a model that breaks the graph: dynamo cannot trace through the final norm
        norm = model.model.norm
        orig = norm.forward

        def forward(*a, **kw):
            torch._dynamo.graph_break()
            return orig(*a, **kw)
        monkeypatch.setattr(norm, "forward", forward)
    return HFEngine(model, "cpu", decode="static", compile_backend="eager")


def test_static_decode_without_a_break_is_one_graph(tiny_llama):
    eng = _static_engine(tiny_llama)
    eager = HFEngine(eng.model, "cpu", decode="eager")
    p = [5, 17, 42, 99, 3, 8] * 4
    g = eng.generate(p, 8, ignore_stop=True)
    assert g.token_ids == eager.generate(p, 8, ignore_stop=True).token_ids
    chk = eng.decode_check
    assert chk["fullgraph"] is True and chk["fullgraph_error"] is None
    assert chk["graph_breaks"] == 0 and chk["break_reasons"] == {} and chk["graphs"] >= 1
    assert chk["compiles_in_timed_decode"] == 0 and chk["timed_steps"] == 7  # compiled in the warm-up
    assert chk["recompile_limit_hit"] is False and chk["cudagraph_replays"] is None  # no CUDA here
    assert eng.decode_mode == "static" and eng.decode_note is None


def test_a_forced_graph_break_shows_in_the_check_and_the_note(tiny_llama, monkeypatch):
    eng = _static_engine(tiny_llama, monkeypatch, break_graph=True)
    eager = HFEngine(eng.model, "cpu", decode="eager")
    eng.decode_note = "set by the tier"  # a note from outside is kept in front of the check's line
    p = [5, 17, 42, 99, 3, 8] * 4
    assert eng.generate(p, 6, ignore_stop=True).token_ids == eager.generate(p, 6, ignore_stop=True).token_ids
    chk = eng.decode_check
    assert chk["fullgraph"] is False and chk["fullgraph_error"].startswith("Unsupported: ")
    assert chk["graph_breaks"] >= 1 and chk["graphs"] >= 2  # the step in parts: before and after the break
    assert list(chk["break_reasons"]) == ["Call to `torch._dynamo.graph_break()`"]
    assert eng.decode_note.startswith("set by the tier; static decode not one compiled graph per step: ")
    assert "graph breaks (Call to `torch._dynamo.graph_break()`)" in eng.decode_note
    assert eng.decode_note.endswith("parts of each step ran eagerly")
    eng.generate(p[:10], 4, ignore_stop=True)  # same cache length: nothing new, the note said once
    assert eng.decode_note.count("static decode not one compiled graph") == 1


def test_decode_check_arithmetic_and_cudagraph_replay_counter():
    from qeval.engines.hf import CudagraphReplays, decode_check_summary, dynamo_delta, merge_dynamo
    before = {"breaks": {"a": 1}, "graphs": 2, "cudagraph_skips": 0, "metrics": []}
    m1, m2 = SimpleNamespace(recompile_reason=None, fail_reason=None), \
        SimpleNamespace(recompile_reason="tensor 'x' size mismatch", fail_reason=None)
    after = {"breaks": {"a": 3, "b": 1}, "graphs": 5, "cudagraph_skips": 1, "metrics": [m1, m2]}
    d = dynamo_delta(before, after)
    assert d["graph_breaks"] == 3 and d["break_reasons"] == {"a": 2, "b": 1} and d["graphs"] == 3
    assert d["recompiles"] == 1 and d["recompile_reasons"] == ["tensor 'x' size mismatch"]
    total = merge_dynamo({"graph_breaks": 1, "graphs": 1, "cudagraph_skips": 0, "recompiles": 0}, d)
    assert (total["graph_breaks"], total["graphs"], total["recompiles"], total["cudagraph_skips"]) == (4, 4, 1, 1)
    assert decode_check_summary({"graph_breaks": 0, "fullgraph": True, "cudagraph_replays_per_step": 1.0}) is None
    line = decode_check_summary({"graph_breaks": 0, "fullgraph": True, "cudagraph_replays_per_step": 0.5})
    assert "0.50 CUDA-graph replays per step" in line and "eagerly" not in line
    assert "recompile limit" in decode_check_summary({"recompile_limit_hit": True})

    class Manager:  # a stand-in for inductor's CUDAGraphTreeManager
        def execute_node(self, node, inputs):
            return node

    with CudagraphReplays(Manager) as c:
        for i in range(3):
            assert Manager().execute_node(i, []) == i
    assert c.count == 3 and Manager.execute_node.__name__ == "execute_node" and Manager().execute_node(7, []) == 7
    assert "counter" not in Manager.execute_node.__code__.co_freevars  # restored
    with CudagraphReplays(SimpleNamespace()) as none:
        pass
    assert none.count is None


def test_the_recompile_limit_hit_shows_in_the_check(tiny_llama):
    """A deeper cache recompiles the step (static shapes); past dynamo's recompile limit the
    frame would run eagerly, as on the H200 run of issue 48: the check says so."""
    eng = _static_engine(tiny_llama)
    with torch._dynamo.config.patch(recompile_limit=1):  # config.patch: monkeypatch's undo would delete the key
        eng.generate([5, 6, 7, 8] * 3, 3, ignore_stop=True)  # a 256-token cache: one graph
        assert eng.decode_check["fullgraph"] is True and eng.decode_note is None
        eng.generate([5, 6, 7, 8] * 80, 3, ignore_stop=True)  # a 512-token cache: a recompile, past the limit
    torch._dynamo.reset()  # the frame marked to run eagerly from here on: not for the next tests
    chk = eng.decode_check
    assert chk["recompile_limit_hit"] is True and chk["fullgraph"] is False
    assert "recompile limit hit" in eng.decode_note and eng.decode_note.endswith("parts of each step ran eagerly")
