"""The load stage's workloads on the tiny models (none timed): a shared prefix served from a
reused KV cache gives the tokens a fresh prefill gives (llama.cpp and transformers closed
loops, and llama-server with ``cache_prompt``), counted as cache hits; a long prompt beside
decoding streams per chunk size (unchunked = one engine step); the context x concurrency
grid, where a cell beyond the context or the engine's KV pool is not admitted; the typed
load section, the report's tables and the plan's grid check on what they produce."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from qeval.measure.load import Slo, admission, distinct_prompts
from qeval.measure.serving import grid_sweep, interference_sweep, prefix_sweep, prefixed_prompts

SLO = Slo(60.0, 60.0)  # generous: the figures are not under test, the records are


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random llama with SmolLM2's tokenizer and its F16 GGUF (conftest.build_tiny_gguf),
    with the default cache (llama-server as built for this machine)."""
    from conftest import build_tiny_gguf
    mp = pytest.MonkeyPatch()
    mp.setenv("QEVAL_LLAMA_CONVERTER_DIR", os.environ.get(
        "QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))
    try:
        yield build_tiny_gguf(tmp_path_factory.mktemp("workloads"))
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def llama(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    yield eng
    eng.close()


def _by_request(run) -> dict[tuple[int, int], list[int]]:
    """``(stream, k) -> token ids`` of a closed loop's records (a stream's records in order)."""
    seen: dict[int, int] = {}
    out = {}
    for r in sorted(run.requests, key=lambda r: (r.stream, r.start_s)):
        k = seen.get(r.stream, 0)
        seen[r.stream] = k + 1
        out[(r.stream, k)] = list(r.token_ids)
    return out


def test_prefixed_prompts_share_the_prefix_and_differ_after_it():
    pf = prefixed_prompts(list(range(1, 300)), 50, 40)
    a, b, c = pf(0, 0), pf(0, 1), pf(1, 0)
    assert len(a) == 50 and a[:40] == b[:40] == c[:40] and len({tuple(a), tuple(b), tuple(c)}) == 3
    with pytest.raises(ValueError, match="shared prefix"):
        prefixed_prompts([1, 2, 3], 40, 40)


def test_llamacpp_closed_loop_reused_prefix_gives_fresh_prefill_tokens(tiny, llama):
    from qeval.engines.llamacpp_load import serve_closed_loop
    pf = prefixed_prompts(tiny["ids"], 56, 40)
    kw = dict(concurrency=2, output_tokens=6, requests_per_stream=2, prefill_chunk=16, shared_prefix=40)
    off = serve_closed_loop(llama, pf, reuse_prefix=False, **kw)
    on = serve_closed_loop(llama, pf, reuse_prefix=True, **kw)
    fresh = {(s, k): llama.generate(pf(s, k), 6, ignore_stop=True).token_ids for s in range(2) for k in range(2)}
    assert _by_request(off) == fresh and _by_request(on) == fresh
    assert off.cached_prompt_tokens == 0 and on.cached_prompt_tokens == 4 * 40
    assert on.details["kv_unified"] is True and off.details["kv_unified"] is False
    assert on.steps < off.steps  # only the own parts (16 tokens, one chunk each) were prefilled


def test_hf_closed_loop_reused_prefix_gives_fresh_prefill_tokens(tiny_llama):
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.engines.hf_load import serve_closed_loop
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("Quantization trades memory for accuracy. The quick brown fox jumps over the lazy dog. " * 12,
              add_special_tokens=False)["input_ids"]
    eng = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    pf = prefixed_prompts(ids, 48, 32)
    kw = dict(concurrency=2, output_tokens=5, requests_per_stream=2, prefill_chunk=16, shared_prefix=32)
    off = serve_closed_loop(eng, pf, reuse_prefix=False, **kw)
    on = serve_closed_loop(eng, pf, reuse_prefix=True, **kw)
    fresh = {(s, k): eng.generate(pf(s, k), 5, ignore_stop=True).token_ids for s in range(2) for k in range(2)}
    assert _by_request(off) == fresh and _by_request(on) == fresh
    assert off.scheduling == on.scheduling == "static"
    assert off.cached_prompt_tokens == 0 and on.cached_prompt_tokens == 4 * 32


def test_llama_server_cache_prompt_reuses_the_prefix_with_the_same_tokens(tiny, llama, tmp_path):
    from qeval.engines.llama_tools import tool_path
    from qeval.engines.openai import OpenAIEngine
    from qeval.engines.base import EngineOptions
    from qeval.engines.openai_load import serve_closed_loop
    try:
        tool_path("llama-server", build=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"llama-server not built here: {e}")
    pf = prefixed_prompts(tiny["ids"], 56, 40)
    fresh = {(0, k): llama.generate(pf(0, k), 6, ignore_stop=True).token_ids for k in range(3)}
    eng = OpenAIEngine.open("gguf", tiny["f16"], EngineOptions(device="cpu", server={
        "serve": {"kind": "llama-server", "parallel": 1, "ctx_size": 512}, "log": str(tmp_path / "server.log"),
        "tier": "t", "tokenizer": str(tiny["src"])}))
    try:
        assert eng.kv_pool_tokens() == 512
        kw = dict(concurrency=1, output_tokens=6, requests_per_stream=3, shared_prefix=40)
        off = serve_closed_loop(eng, pf, reuse_prefix=False, **kw)
        eng.clear_kv_pool("test")
        on = serve_closed_loop(eng, pf, reuse_prefix=True, **kw)
    finally:
        eng.close()
    assert _by_request(off) == fresh and _by_request(on) == fresh
    assert off.cached_prompt_tokens == 0
    # the first request found an empty slot; the next two found the prefix there (the server's own count)
    assert on.cached_prompt_tokens is not None and on.cached_prompt_tokens >= 2 * 40


def test_prefix_sweep_and_interference_and_grid_make_a_typed_load_section(tiny, llama):
    from qeval.results_load import LoadSection
    ids = tiny["ids"]
    common = dict(concurrency=[1, 2], output_tokens=4, requests_per_stream=1, prefill_chunk=16, slo=SLO,
                  max_context=llama.n_ctx_train)
    pre = prefix_sweep(llama, ids, depth=48, prefix_tokens=32, modes=[False, True], how="seq copy", **common)
    it = interference_sweep(llama, [ids[0:12], ids[20:29]], (ids * 2)[:100], chunk_sizes=[40, 16],
                            before_tokens=3, after_tokens=2)
    # depth 2048 + 4 new tokens is beyond the tiny model's context of 2048: not admitted, never run
    grid = grid_sweep(llama, lambda d: distinct_prompts(ids, d), depths=[2048, 24], **common)
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


def test_a_cell_beyond_the_engines_kv_pool_is_not_admitted(tiny, llama):
    # llama-server's pool: --ctx-size cells all slots share
    why = admission(concurrency=2, depth=24, output_tokens=4, kv_bytes_per_token=None, max_context=2048,
                    kv_budget_bytes=None, pool_tokens=50)
    assert why and "2 x (depth 24 + output_tokens 4) = 56 tokens is beyond the engine's KV pool of 50" in why
    grid = grid_sweep(llama, lambda d: distinct_prompts(tiny["ids"], d), depths=[24], concurrency=[1, 2],
                      output_tokens=4, requests_per_stream=1, prefill_chunk=16, slo=SLO, pool_tokens=50)
    pts = grid["depths"][0]["points"]
    assert [p["admitted"] for p in pts] == [True, False] and "KV pool of 50" in pts[1]["reason"]


def test_hf_long_prompt_steps_per_chunk_size(tiny_llama):
    from transformers import AutoTokenizer
    from qeval.engines.hf import HFEngine, load_hf_model
    from qeval.results_load import InterferenceSection
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("Quantization trades memory for accuracy. The quick brown fox jumps over the lazy dog. " * 12,
              add_special_tokens=False)["input_ids"]
    eng = HFEngine(load_hf_model(str(tiny_llama), "cpu", "float32"), "cpu")
    streams = [ids[0:12], ids[20:32]]
    alone = [eng.generate(p, 12, ignore_stop=True).token_ids for p in streams]
    out = interference_sweep(eng, streams, ids[:100], chunk_sizes=[16], before_tokens=3, after_tokens=2)
    sec = InterferenceSection.model_validate(out)
    assert [(r.chunk_size, r.long_steps, r.steps) for r in sec.rows] == [(None, 1, 6), (16, 7, 12)]
    assert all(r.n_gaps == 2 * r.long_steps for r in sec.rows)
    from qeval.engines.hf_interference import serve_with_long_prompt
    run = serve_with_long_prompt(eng, streams, ids[:100], chunk_size=None, before_tokens=3, after_tokens=2)
    assert run.long_first_token == eng.generate(ids[:100], 1, ignore_stop=True).token_ids[0]
    assert [t for t in run.stream_tokens] == [a[1:1 + run.steps] for a in alone]  # the long prefill changes none


def test_interference_not_measured_where_the_engine_has_no_step_loop():
    eng = SimpleNamespace(name="openai", capabilities=SimpleNamespace(serve="qeval.engines.openai_load:serve_closed_loop"))
    out = interference_sweep(eng, [[1, 2, 3]], [4] * 50, chunk_sizes=[16])
    assert out["rows"] == [] and "openai engine has no loop" in out["not_measured"]


def test_report_tables_and_plan_grid_check_on_a_synthetic_section():
    from qeval.analysis.capacity import grid_vs_formula
    from qeval.report.table import grid_table, interference_table, prefix_table, workload_markdown
    from qeval.results import TierResult
    pt = {"concurrency": 1, "requests": 1, "ttft_s": {"p50": 0.1, "p95": 0.2}, "itl_s": {"p95": 0.01},
          "decode_tokens_per_s": 50.0, "meets_slo": True, "peak_bytes": 2 * 2**30, "prompt_tokens": 256,
          "cached_prompt_tokens": 128, "prefix_hit_rate": 0.5}
    no = {"concurrency": 2, "admitted": False, "reason": "beyond the model's context", "requests_not_admitted": 2}
    load = {"depth": 256, "output_tokens": 16, "kv_budget_bytes": 1.0 * 2**30, "held_bytes": 2**30,
            "prefix": {"shared_prefix_tokens": 128, "depth": 256, "runs": [
                {"reuse": True, "users_at_slo": 1, "hit_rate": 0.5, "points": [pt]}]},
            "interference": {"prompt_tokens": 512, "streams": 2, "rows": [
                {"chunk_size": None, "window_s": 1.0, "long_ttft_s": 1.0, "streams": 2, "n_gaps": 2, "max_gap_s": 0.9,
                 "lost_tokens_per_s": 10.0, "long_steps": 1}]},
            "grid": {"depths": [{"depth": 256, "users_at_slo": 1, "points": [pt, no]}]}}
    t = TierResult.model_validate({"tier": "q4", "method": "gguf", "status": "ok", "load": load,
                                   "memory": {"weight_bytes": 100 * 2**20, "kv_bytes_per_token": 4096.0}})
    tiers = {"q4": t}
    assert prefix_table(tiers)[0][:3] == ["q4", "reused", "1"] and prefix_table(tiers)[0][6] == "50%"
    assert interference_table(tiers)[0][3] == "unchunked"
    assert [r[3] for r in grid_table(tiers)] == ["yes", "no"]
    md = "\n".join(workload_markdown(tiers))
    assert "## Load: shared prefix" in md and "## Load: context x concurrency" in md
    from qeval.report import plots
    for fn in (plots.prefix_ttft_png, plots.interference_png, plots.grid_heatmap_png):
        assert fn(tiers)[:8] == b"\x89PNG\r\n\x1a\n", fn.__name__
    assert plots.grid_heatmap_png({}) is None
    checks = grid_vs_formula(tiers, overhead_bytes=2**28, max_context=256)
    # 256 + 16 = 272 tokens is beyond a 256-token model: the formula admits neither cell, the run admitted c=1
    assert [c.predicted_admitted for c in checks] == [False, False] and [c.admitted for c in checks] == [True, False]
    assert checks[0].wrong.startswith("predicted not admitted, the run admitted it") and checks[1].wrong is None
    checks = grid_vs_formula(tiers, overhead_bytes=2**28)  # ~0.36 GiB predicted against 2 GiB measured
    assert checks[0].predicted_admitted is True and "memory formula -8" in checks[0].wrong
    assert checks[1].wrong.startswith("predicted admitted, the run did not: beyond the model's context")
