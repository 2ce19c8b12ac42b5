"""Load sweep (issue 13): statistics on synthetic request timings, SLO derivation,
admission, and batched-vs-alone greedy token identity on both engines (tiny models)."""
from __future__ import annotations

import numpy as np
import pytest

from qeval.measure.load import (LoadRun, NotAdmitted, RequestRecord, Slo, admission, batching_gain,
                                distinct_prompts, not_admitted_point, point_meets_slo, point_stats,
                                summarize, users_at_slo)


def _req(stream: int, start: float, ttft: float, gaps: list[float], first_id: int = 0) -> RequestRecord:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(stream, 8, start, times, list(range(first_id, first_id + len(times))))


def _run(concurrency: int, ttft: float, itl: float, n_req: int = 4, tokens: int = 5) -> LoadRun:
    reqs = [_req(i % concurrency, 0.0, ttft, [itl] * (tokens - 1)) for i in range(n_req)]
    dur = max(r.token_times_s[-1] for r in reqs)
    return LoadRun(concurrency, "continuous", reqs, dur)


# ---- statistics on synthetic latencies -------------------------------------------------

def test_point_stats_percentiles_throughput_and_goodput():
    # 2 streams, 2 requests each, closed loop; request 3 is slow (TTFT 2.0 s, gaps 0.3 s)
    r = [_req(0, 0.0, 0.5, [0.1, 0.1, 0.1]), _req(1, 0.0, 0.6, [0.1, 0.1, 0.1]),
         _req(0, 0.8, 0.4, [0.1, 0.1, 0.1]), _req(1, 0.9, 2.0, [0.3, 0.3, 0.3])]
    run = LoadRun(2, "continuous", r, duration_s=max(x.token_times_s[-1] for x in r),
                  decode_step_tokens=10, decode_step_s=0.5)
    s = point_stats(run, Slo(ttft_p95_s=1.0, itl_p95_s=0.2))
    assert s["duration_s"] == pytest.approx(0.9 + 2.0 + 0.9)
    assert s["output_tokens"] == 16 and s["requests"] == 4
    assert s["decode_tokens_per_s"] == pytest.approx(16 / 3.8)
    assert s["requests_per_s"] == pytest.approx(4 / 3.8)
    ttfts = [0.5, 0.6, 0.4, 2.0]
    assert s["ttft_s"]["p50"] == pytest.approx(np.percentile(ttfts, 50))
    assert s["ttft_s"]["p95"] == pytest.approx(np.percentile(ttfts, 95))
    assert s["ttft_s"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    gaps = [0.1] * 9 + [0.3] * 3
    assert s["itl_s"]["p95"] == pytest.approx(np.percentile(gaps, 95))
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["e2e_s"]["p50"] == pytest.approx(np.percentile([0.8, 0.9, 0.7, 2.9], 50))
    assert s["tpot_mean_s"] == pytest.approx((0.1 * 3 + 0.3) / 4)
    assert s["decode_step_tokens_per_s"] == pytest.approx(20.0)
    # goodput: 3 requests met TTFT <= 1 and TPOT <= 0.2; the slow one did not
    assert s["slo_attainment"] == pytest.approx(0.75)
    assert s["goodput_tokens_per_s"] == pytest.approx(12 / 3.8)
    # p95 TTFT (interpolated towards 2.0) breaks the 1 s SLO: the point does not meet it
    assert s["meets_slo"] is False
    assert point_stats(run, Slo(ttft_p95_s=2.5, itl_p95_s=0.31))["meets_slo"] is True


def test_users_at_slo_is_the_largest_concurrency_meeting_both_percentiles_with_nothing_refused():
    slo = Slo(ttft_p95_s=1.0, itl_p95_s=0.1)
    pts = [point_stats(_run(1, 0.2, 0.05), slo), point_stats(_run(2, 0.4, 0.06), slo),
           point_stats(_run(4, 0.9, 0.09), slo),
           point_stats(_run(8, 0.9, 0.15), slo),      # ITL p95 over the SLO
           point_stats(_run(16, 3.0, 0.05), slo),     # TTFT p95 over the SLO
           not_admitted_point(32, 2, "KV cache too large")]
    assert [p["meets_slo"] for p in pts] == [True, True, True, False, False, False]
    assert users_at_slo(pts, slo) == 4
    assert users_at_slo(pts, Slo(ttft_p95_s=5.0, itl_p95_s=1.0)) == 16  # 32 refused: never counts
    assert users_at_slo(pts, Slo(ttft_p95_s=0.1, itl_p95_s=0.01)) == 0
    # a point with a refused request does not meet the SLO whatever its latencies
    refused = dict(pts[0], requests_not_admitted=1)
    assert point_meets_slo(refused, slo) is False
    s = summarize(pts, slo)
    assert s["users_at_slo"] == 4 and s["requests_not_admitted"] == 64
    assert summarize(pts, None)["users_at_slo"] is None


def test_batching_gain_against_one_stream():
    pts = [{"concurrency": 1, "admitted": True, "decode_tokens_per_s": 10.0},
           {"concurrency": 4, "admitted": True, "decode_tokens_per_s": 32.0},
           not_admitted_point(8, 1, "no")]
    assert batching_gain(pts) == {"1": 1.0, "4": 3.2}
    assert batching_gain(pts[1:]) == {}  # no single-stream point: no gain
    s = summarize(pts, None)
    assert s["max_decode_tokens_per_s"] == 32.0 and s["max_decode_at_concurrency"] == 4


def test_not_admitted_point_and_admission_reasons():
    p = not_admitted_point(8, 3, "too big")
    assert p["admitted"] is False and p["requests_not_admitted"] == 24 and p["reason"] == "too big"
    assert admission(concurrency=4, depth=100, output_tokens=28, kv_bytes_per_token=1024.0,
                     max_context=2048, kv_budget_bytes=4 * 128 * 1024) is None
    why = admission(concurrency=5, depth=100, output_tokens=28, kv_bytes_per_token=1024.0,
                    max_context=2048, kv_budget_bytes=4 * 128 * 1024)
    assert why and "KV" in why and "4 streams fit" in why
    why = admission(concurrency=1, depth=2040, output_tokens=16, kv_bytes_per_token=1.0,
                    max_context=2048, kv_budget_bytes=None)
    assert why and "context of 2048" in why
    with pytest.raises(ValueError):
        point_stats(LoadRun(1, "static", [], 0.0))


def test_distinct_prompts_differ_per_stream_and_request():
    pf = distinct_prompts(list(range(1000)), 64)
    got = {tuple(pf(s, k)) for s in range(4) for k in range(3)}
    assert len(got) == 12 and all(len(p) == 64 for p in got)
    assert len(distinct_prompts([1, 2, 3], 10)(0, 0)) == 10


# ---- engines: batched greedy tokens equal the tokens of the same prompt alone --------------

def _alone(engine, prompt, n):
    return engine.generate(prompt, n, ignore_stop=True).token_ids


def _check_identity(run: LoadRun, engine, pf, n_out: int, concurrency: int, per_stream: int):
    assert len(run.requests) == concurrency * per_stream
    seen = {(r.stream, k) for k in range(per_stream) for r in run.requests}
    assert len(seen) >= concurrency
    by_stream: dict[int, list[RequestRecord]] = {}
    for r in run.requests:
        by_stream.setdefault(r.stream, []).append(r)
    for s, reqs in by_stream.items():
        reqs.sort(key=lambda r: r.start_s)
        assert len(reqs) == per_stream
        for k, r in enumerate(reqs):
            assert len(r.token_ids) == n_out and len(r.token_times_s) == n_out
            assert all(b >= a for a, b in zip(r.token_times_s, r.token_times_s[1:]))
            assert r.token_ids == _alone(engine, pf(s, k), n_out), (s, k)
        # closed loop: the next request is sent once the last one ended (llama.cpp and static
        # batches: at that very step; transformers' manager: after handing the result over)
        for a, b in zip(reqs, reqs[1:]):
            assert a.token_times_s[-1] <= b.start_s + 1e-9 and b.start_s < b.token_times_s[0]
            if run.scheduling == "static" or run.steps:
                assert b.start_s == pytest.approx(a.token_times_s[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random llama with SmolLM2's tokenizer and its F16 GGUF (conftest.tiny_gguf_module)."""
    from conftest import tiny_gguf_module
    yield from tiny_gguf_module(tmp_path_factory, "load")


def _prompts(tiny, depth):
    return distinct_prompts(tiny["ids"], depth)


def test_llamacpp_batched_tokens_equal_alone_with_chunked_prefill(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.closed_loop import closed_loop as serve_closed_loop
    pf_base = _prompts(tiny, 40)
    # different prompt lengths per stream, so prefills of new requests land between decodes
    pf = lambda s, k: pf_base(s, k)[:40 - 7 * s]  # noqa: E731
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        run = serve_closed_loop(eng, pf, concurrency=3, output_tokens=6, requests_per_stream=2, prefill_chunk=16)
        assert run.scheduling == "continuous" and run.details["n_ctx_seq"] >= 46
        # chunked: 33..40-token prompts at 16 per step need several steps, shared with decode
        assert run.steps > 6 * 2 and run.decode_step_tokens > 0
        assert 0 < run.kv_bytes_peak <= run.kv_pool_bytes
        _check_identity(run, eng, pf, 6, 3, 2)
        stats = point_stats(run, Slo(10.0, 10.0))
        assert stats["requests"] == 6 and stats["output_tokens"] == 36 and stats["meets_slo"]
    finally:
        eng.close()


def test_llamacpp_point_beyond_the_context_or_budget_is_not_admitted(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.closed_loop import closed_loop as serve_closed_loop
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        long = lambda s, k: [5] * (eng.n_ctx_train + 1)  # noqa: E731
        with pytest.raises(NotAdmitted, match="context"):
            serve_closed_loop(eng, long, concurrency=1, output_tokens=2, requests_per_stream=1)
        short = _prompts(tiny, 16)
        with pytest.raises(NotAdmitted, match="KV budget"):
            serve_closed_loop(eng, short, concurrency=4, output_tokens=2, requests_per_stream=1,
                              kv_budget_bytes=1000)
        # the engine still serves afterwards
        assert len(serve_closed_loop(eng, short, concurrency=2, output_tokens=2, requests_per_stream=1).requests) == 2
    finally:
        eng.close()


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_hf_batched_tokens_equal_alone(tiny, scheduling):
    from qeval.engines.hf import HFEngine
    from qeval.serving.closed_loop import closed_loop
    pf_base = _prompts(tiny, 40)
    pf = lambda s, k: pf_base(s, k)[:40 - 15 * s]  # noqa: E731  (left padding in static batches)
    eng = HFEngine(tiny["model"], "cpu", backend="torch-float32")
    run = closed_loop(eng, pf, concurrency=3, output_tokens=6, requests_per_stream=2, prefill_chunk=16,
                      scheduling=scheduling)
    assert run.scheduling == scheduling and "continuous_error" not in run.details
    if scheduling == "static":  # 2 batches: 40 columns in 3 chunks of 16, then 5 decode steps each
        assert run.steps == 2 * (3 + 5) and run.details["batches"] == 2
        assert run.decode_step_tokens == 2 * 3 * 5 and run.decode_step_s > 0
    else:
        assert run.steps == 0 and run.kv_pool_bytes and run.details["max_batch_tokens"] == 3 + 16
    assert run.kv_bytes_peak and run.kv_bytes_peak > 0
    # the tiny model's answers vary from prompt to prompt (the identity is not trivially constant)
    assert len({tuple(r.token_ids) for r in run.requests}) > 1
    _check_identity(run, eng, pf, 6, 3, 2)
    if scheduling == "static":  # the three streams of a batch start and end together
        firsts = sorted(r.token_times_s[-1] for r in run.requests)
        assert firsts[0] == firsts[2] and firsts[3] == firsts[5]


def test_hf_int8_kv_cache_runs_static_batches_and_budget_refuses(tiny):
    from qeval.engines.hf import HFEngine
    from qeval.serving.closed_loop import closed_loop
    pytest.importorskip("hqq")
    pf = _prompts(tiny, 24)
    eng = HFEngine(tiny["model"], "cpu", kv_cache="int8", backend="torch-float32")
    run = closed_loop(eng, pf, concurrency=2, output_tokens=3, requests_per_stream=1, prefill_chunk=8)
    assert run.scheduling == "static" and len(run.requests) == 2
    assert all(len(r.token_ids) == 3 for r in run.requests)
    assert run.kv_bytes_peak and run.details["kv_cache"] == "int8"
    # admission is the workload's, on the tier's KV bytes per token
    with pytest.raises(NotAdmitted, match="KV budget"):
        closed_loop(eng, pf, concurrency=8, output_tokens=3, requests_per_stream=1, kv_budget_bytes=1024,
                    kv_bytes_per_token=eng.kv_bytes_per_token(64))
    with pytest.raises(NotAdmitted, match="context"):
        closed_loop(eng, pf, concurrency=1, output_tokens=3, requests_per_stream=1, max_context=20)


def test_sweep_records_points_that_do_not_fit_as_not_admitted(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.measure.memory import PeakMemory, rss_bytes
    from qeval.serving.closed_loop import load_sweep
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        kvpt = eng.kv_bytes_per_token_analytic()
        assert kvpt == 1024  # 2 layers x 2 KV heads x (64 + 64) x 2 bytes (F16)
        # llama.cpp pads each sequence to 256 cells: 1 and 2 streams fit 600000 bytes, 4 do not
        # (the engine refuses its pool); 64 streams fail admission before the engine is asked
        out = load_sweep(eng, _prompts(tiny, 16), concurrency=[4, 1, 64, 2], depth=16, output_tokens=4,
                         requests_per_stream=2, prefill_chunk=8, slo=Slo(60.0, 60.0),
                         peak=PeakMemory("cpu", rss_bytes()), kv_bytes_per_token=kvpt,
                         kv_budget_bytes=600_000, max_context=eng.n_ctx_train)
    finally:
        eng.close()
    pts = {p["concurrency"]: p for p in out["points"]}
    assert [p["concurrency"] for p in out["points"]] == [1, 2, 4, 64]
    assert pts[1]["admitted"] and pts[2]["admitted"] and pts[2]["requests"] == 4
    assert pts[2]["kv_pool_bytes"] == 2 * 256 * 1024 and pts[2]["peak_bytes"] is not None
    assert not pts[4]["admitted"] and "KV pool" in pts[4]["reason"] and pts[4]["requests_not_admitted"] == 8
    assert not pts[64]["admitted"] and "KV budget" in pts[64]["reason"] and pts[64]["requests_not_admitted"] == 128
    assert out["users_at_slo"] == 2 and out["requests_not_admitted"] == 136
    assert out["scheduling"] == ["continuous"] and set(out["batching_gain"]) == {"1", "2"}


@pytest.mark.parametrize("kv", ["model", "int8"])
def test_llamacpp_answers_in_a_batch_equal_alone(tiny, kv):
    """Issue 18: the GGUF tiers answer the suites a batch at once (generate_batch), with the
    same greedy tokens as one prompt at a time, stop tokens ending each sequence alone."""
    from qeval.engines.llamacpp import LlamaCppEngine
    pf = _prompts(tiny, 40)
    prompts = [pf(s, 0)[:40 - 9 * s] for s in range(4)]
    eng = LlamaCppEngine(tiny["f16"], threads=1, kv_cache=kv)
    try:
        assert eng.capabilities.batch
        alone = [eng.generate(p, 12, ignore_stop=True).token_ids for p in prompts]
        assert len({tuple(a) for a in alone}) > 1  # distinct answers: a mix-up would show
        got = eng.generate_batch(prompts, 12)
        assert [g[0] for g in got] == alone and not any(g[1] for g in got)
        stop = [alone[1][4]]  # a token stream 1 produces at its 5th step
        want = [eng.generate(p, 12, stop_ids=stop) for p in prompts]
        got = eng.generate_batch(prompts, 12, stop_ids=stop)
        assert [(g.token_ids, g.finished) for g in want] == [(list(i), f) for i, f in got]
        assert got[1][1] and len(got[1][0]) <= 5
        assert eng.generate_batch([], 4) == []
    finally:
        eng.close()


def test_llamacpp_decode_again_equals_a_full_prefill(tiny):
    """Issue 18 item 4 on llama.cpp: the cache cut back to the depth (llama_memory_seq_rm)
    decodes the same greedy tokens as a full prefill; another prompt is not in the cache."""
    from qeval.engines.llamacpp import LlamaCppEngine
    ids = _prompts(tiny, 40)(0, 0)
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        full = eng.generate(ids, 10, ignore_stop=True)
        for _ in range(2):  # twice: the second cut starts from the first repeat's cache
            again = eng.decode_again(ids, 10)
            assert again is not None and again.token_ids == full.token_ids
        assert eng.decode_again(ids[:-3], 10) is None
        list(eng.iter_logprobs(ids[:20]))  # another use of the context clears what it held
        assert eng.decode_again(ids, 10) is None
    finally:
        eng.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_untimed_warm_up_runs_each_batch_shape_once_on_cuda(monkeypatch, device):
    """Every device: one 16-token row. CUDA: each row count asked for, at full length and
    output, once per engine and shape (per-shape first-use costs out of the timed run)."""
    from types import SimpleNamespace

    from qeval.engines import hf_core
    calls = []
    monkeypatch.setattr(hf_core, "_static_batch",
                        lambda eng, batch, out, chunk, pad, *a, **k: calls.append(([len(p) for p in batch], out, chunk)))
    eng = SimpleNamespace(device=device)
    batch = [[5] * 100, [6] * 100, [7] * 100]
    hf_core._warm_up(eng, batch, 32, 64, 0)                    # a closed-loop point of 3 streams
    hf_core._warm_up(eng, batch, 32, 64, 0, rows=range(1, 4))  # an open loop of 3 slots: 1 and 2 rows are new
    short = ([16], 2, 16)
    if device == "cpu":
        assert calls == [short, short]
    else:
        assert calls == [short, ([100] * 3, 32, 64), short, ([100], 32, 64), ([100] * 2, 32, 64)]
