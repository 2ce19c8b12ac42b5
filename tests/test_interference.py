"""Interference of a long prompt on running streams: the window and the stall figures on
synthetic timelines (no clocks), and llama.cpp's loop on the tiny GGUF counting engine
steps (an unchunked long prompt is one step) with the tokens a fresh run gives."""
from __future__ import annotations

import numpy as np
import pytest

from qeval.measure.interference import interference_stats, window_gaps


def test_window_and_stall_from_synthetic_timelines():
    # (times are binary fractions: exact in floating point) two streams decode every 0.125 s;
    # the long prompt arrives at 0.4375 and its prefill stalls both until 1.0, its first token
    a = [0.0, 0.125, 0.25, 0.375, 1.0, 1.125]
    b = [0.0625, 0.1875, 0.3125, 0.4375, 1.0, 1.125]
    s = interference_stats([a, b], arrival_s=0.4375, first_token_s=1.0)
    assert s.window_s == 0.5625 and s.long_ttft_s == 0.5625
    # gaps overlapping [0.4375, 1.0]: a's 0.375 -> 1.0 and b's 0.4375 -> 1.0; b's 0.3125 -> 0.4375
    # ends at the arrival and a's 1.0 -> 1.125 starts at the window's end: neither overlaps
    assert window_gaps([a, b], 0.4375, 1.0) == [[0.625], [0.5625]]
    assert s.n_gaps == 2 and s.streams == 2 and s.max_gap_s == 0.625
    assert s.itl_p99_s == pytest.approx(np.percentile([0.625, 0.5625], 99))
    # baseline from 0.0625 (both streams running) to the arrival: 6 tokens in 0.375 s
    assert s.baseline_tokens_per_s == pytest.approx(16.0)
    # in the window (0.4375, 1.0]: the two tokens at 1.0
    assert s.window_tokens_per_s == pytest.approx(2 / 0.5625)
    assert s.lost_tokens_per_s == pytest.approx(16 - 2 / 0.5625)
    assert s.lost_tokens == pytest.approx(16 * 0.5625 - 2)


def test_no_stall_when_chunked_prefill_keeps_the_pace():
    a = [k * 0.125 for k in range(17)]  # a token every 0.125 s, 0 .. 2.0
    s = interference_stats([a], arrival_s=0.5, first_token_s=1.0)
    assert s.max_gap_s == 0.125 and s.itl_p99_s == pytest.approx(0.125)
    assert s.n_gaps == 4  # 0.5-0.625 .. 0.875-1.0; 0.375-0.5 ends at the arrival, 1.0-1.125 starts at the end
    assert s.baseline_tokens_per_s == pytest.approx(8.0) and s.window_tokens_per_s == pytest.approx(8.0)
    assert s.lost_tokens_per_s == pytest.approx(0.0, abs=1e-9)


def test_bad_timelines_are_refused():
    with pytest.raises(ValueError, match="before the arrival"):
        interference_stats([[0.0, 0.1]], arrival_s=1.0, first_token_s=0.5)
    with pytest.raises(ValueError, match="ascending"):
        interference_stats([[0.0, 0.2, 0.1]], arrival_s=0.05, first_token_s=0.3)
    s = interference_stats([[]], arrival_s=0.0, first_token_s=0.2)  # no running token at all
    assert s.max_gap_s is None and s.baseline_tokens_per_s is None and s.lost_tokens is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random llama with SmolLM2's tokenizer and its F16 GGUF (conftest.tiny_gguf_module)."""
    from conftest import tiny_gguf_module
    yield from tiny_gguf_module(tmp_path_factory, "interference")


def test_llamacpp_long_prompt_steps_per_chunk_size(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.interference import long_prompt_run as serve_with_long_prompt
    ids = tiny["ids"]
    streams = [ids[0:12], ids[20:29]]
    long = (ids * 2)[:100]
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        want_first = eng.generate(long, 1, ignore_stop=True).token_ids[0]
        alone = [eng.generate(p, 16, ignore_stop=True).token_ids for p in streams]
        for chunk, long_steps in ((None, 1), (100, 1), (16, 7), (40, 3)):
            run = serve_with_long_prompt(eng, streams, long, chunk_size=chunk, before_tokens=3, after_tokens=2)
            assert run.long_steps == long_steps, chunk
            # every step decodes the streams; the long prompt's steps sit between the before and after ones
            # 3 steps before the arrival, the long prompt's steps, 2 after its first token
            assert run.steps == 3 + long_steps + 2
            assert run.long_first_token == want_first
            assert run.arrival_s <= run.first_token_s
            for s, (got, ref) in enumerate(zip(run.stream_tokens, alone)):
                assert len(got) == run.steps and got == ref[1:1 + len(got)], (chunk, s)  # the long prefill changes no token
            st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s)
            assert st.streams == 2 and st.n_gaps == 2 * long_steps
        with pytest.raises(ValueError, match="chunk_size"):
            serve_with_long_prompt(eng, streams, long, chunk_size=0)
    finally:
        eng.close()


# ---- the load stage: interference per chunk size, the context x concurrency grid -------------

def test_prefix_sweep_and_interference_and_grid_make_a_typed_load_section(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.load import Slo, distinct_prompts
    from qeval.serving.grid import grid_sweep
    from qeval.serving.interference import interference_sweep
    from qeval.serving.prefix import prefix_sweep
    from qeval.results_load import LoadSection
    ids = tiny["ids"]
    llama = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        common = dict(concurrency=[1, 2], output_tokens=4, requests_per_stream=1, prefill_chunk=16, slo=Slo(60.0, 60.0),
                      max_context=llama.n_ctx_train)
        pre = prefix_sweep(llama, ids, depth=48, prefix_tokens=32, modes=[False, True], how="seq copy", **common)
        it = interference_sweep(llama, [ids[0:12], ids[20:29]], (ids * 2)[:100], chunk_sizes=[40, 16],
                                before_tokens=3, after_tokens=2)
        # depth 2048 + 4 new tokens is beyond the tiny model's context of 2048: not admitted, never run
        grid = grid_sweep(llama, lambda d: distinct_prompts(ids, d), depths=[2048, 24], **common)
    finally:
        llama.close()
    sec = LoadSection.model_validate({"depth": 48, "prefix": pre, "interference": it, "grid": grid})
    on, off = sec.prefix.run(True), sec.prefix.run(False)
    assert on.hit_rate == pytest.approx(32 / 48) and off.hit_rate == 0.0 and on.cached_prompt_tokens == 3 * 32
    assert [p.prefix_hit_rate for p in on.points] == [pytest.approx(32 / 48)] * 2 and on.how == "seq copy"
    rows = sec.interference.rows
    assert [r.chunk_size for r in rows] == [None, 16, 40] and sec.interference.not_measured is None
    assert [r.long_steps for r in rows] == [1, 7, 3]  # unchunked: the whole 100-token prompt in one step
    assert all(r.n_gaps == 2 * r.long_steps and r.max_gap_s is not None for r in rows)
    assert [g.depth for g in sec.grid.depths] == [24, 2048]
    assert all(p.admitted for p in sec.grid.depths[0].points)
    deep = sec.grid.cell(2048, 2)
    assert not deep.admitted and "beyond the model's context of 2048" in deep.reason and deep.requests_not_admitted == 2
    assert sec.grid.depths[1].users_at_slo == 0


def test_a_cell_beyond_the_engines_kv_pool_is_not_admitted(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.load import Slo, admission, distinct_prompts
    from qeval.serving.grid import grid_sweep
    # llama-server's pool: --ctx-size cells all slots share
    why = admission(concurrency=2, depth=24, output_tokens=4, kv_bytes_per_token=None, max_context=2048,
                    kv_budget_bytes=None, pool_tokens=50)
    assert why and "2 x (depth 24 + output_tokens 4) = 56 tokens is beyond the engine's KV pool of 50" in why
    llama = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        grid = grid_sweep(llama, lambda d: distinct_prompts(tiny["ids"], d), depths=[24],
                          concurrency=[1, 2],
                          output_tokens=4, requests_per_stream=1, prefill_chunk=16, slo=Slo(60.0, 60.0),
                          pool_tokens=50)
    finally:
        llama.close()
    pts = grid["depths"][0]["points"]
    assert [p["admitted"] for p in pts] == [True, False] and "KV pool of 50" in pts[1]["reason"]


def test_hf_long_prompt_steps_per_chunk_size(tiny_llama):
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.results_load import InterferenceSection
    from qeval.serving.interference import interference_sweep, long_prompt_run
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("Quantization trades memory for accuracy. The quick brown fox jumps over the lazy dog. " * 12,
              add_special_tokens=False)["input_ids"]
    eng = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    streams = [ids[0:12], ids[20:29]]  # two lengths: the streams' batch is left-padded
    alone = [eng.generate(p, 16, ignore_stop=True).token_ids for p in streams]
    out = interference_sweep(eng, streams, ids[:100], chunk_sizes=[16], before_tokens=3, after_tokens=2)
    sec = InterferenceSection.model_validate(out)
    # each step: the streams' decode forward, then (from its arrival) one forward of the long prompt's
    # next chunk; 3 steps before the arrival, the long prompt's steps, 2 after its first token
    assert [(r.chunk_size, r.long_steps, r.steps) for r in sec.rows] == [(None, 1, 6), (16, 7, 12)]
    assert all(r.n_gaps == 2 * r.long_steps for r in sec.rows)
    want_first = eng.generate(ids[:100], 1, ignore_stop=True).token_ids[0]
    for chunk in (None, 16):
        run = long_prompt_run(eng, streams, ids[:100], chunk_size=chunk, before_tokens=3, after_tokens=2)
        assert run.long_first_token == want_first and run.arrival_s < run.first_token_s
        assert run.details["engine"] == "qeval static batches (transformers cache)"  # qeval steps the batches
        # the streams' prefill (1 forward) + 2 forwards in each of the long prompt's steps + 1 in the others
        assert run.details["engine_steps"] == 1 + run.steps + run.long_steps
        assert [t for t in run.stream_tokens] == [a[1:1 + run.steps] for a in alone]  # the long prefill changes none


def test_interference_not_measured_where_the_engine_has_no_core():
    from types import SimpleNamespace
    from qeval.serving.interference import interference_sweep
    eng = SimpleNamespace(name="scorer")  # an engine that scores and generates but does not serve batches
    out = interference_sweep(eng, [[1, 2, 3]], [4] * 50, chunk_sizes=[16])
    assert out["rows"] == [] and "scorer engine has no serving core" in out["not_measured"]


# ---- the recipe fields -------------------------------------------------------------------

_RECIPE = "name: x\nmodel: {source: /tmp}\ntiers: [{name: bf16, method: bf16}]\nspeed: {depths: [64, 128]}\n"


def test_recipe_interference_fields():
    from qeval.errors import QevalInputError
    from qeval.recipe import check_context, parse_recipe
    r = parse_recipe(_RECIPE + "load:\n  interference: {prompt_tokens: 512, chunk_sizes: [128, 32]}\n")
    assert r.load.interference.prompt_tokens == 512 and r.load.interference.chunk_sizes == [32, 128]
    assert parse_recipe(_RECIPE).load.interference is None
    bad = {"chunk_sizes: [64, 0]": r"r\.yaml:8: load\.interference\.chunk_sizes\[1\]: Input should be greater than 0",
           "chunk_sizes: []": r"r\.yaml:8: load\.interference\.chunk_sizes: ",
           "chunk_sizes: [8, 8]": r"r\.yaml:8: load\.interference\.chunk_sizes: chunk_sizes must be distinct",
           "prompt_tokens2: 5": r"r\.yaml:7: load\.interference\.prompt_tokens2: unknown field"}
    for line, want in bad.items():
        extra = "" if line.startswith("prompt_tokens") else "    prompt_tokens: 512\n"
        with pytest.raises(QevalInputError, match=want):
            parse_recipe(_RECIPE + "load:\n  interference:\n" + extra + "    " + line + "\n", "r.yaml")
    with pytest.raises(QevalInputError, match=r"load\.interference\.prompt_tokens: 512 \+ output_tokens 32 exceeds"):
        check_context(r, 520)
