"""The serving layer (:mod:`qeval.serving`): every workload runs on any engine that implements
the core, shown with the scripted engine (tests/scripted_engine.py: a core and nothing else),
whose step clock makes every time exact."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from qeval.measure.arrivals import StepClock
from qeval.measure.interference import interference_stats
from qeval.measure.load import NotAdmitted, Slo, distinct_prompts
from qeval.serving.closed_loop import closed_loop, load_sweep
from qeval.serving.grid import grid_sweep
from qeval.serving.interference import interference_sweep, long_prompt_run
from qeval.serving.open_loop import open_loop, rate_sweep
from qeval.serving.prefix import prefix_sweep, prefixed_prompts

from scripted_engine import ScriptedEngine, expected_tokens

BASE = list(range(1, 200))


def test_closed_loop_on_a_new_engine_answers_as_alone_with_exact_times():
    eng = ScriptedEngine()
    pf = distinct_prompts(BASE, 8)
    run = closed_loop(eng, pf, concurrency=2, output_tokens=3, requests_per_stream=2, prefill_chunk=8,
                      clock=StepClock(0.5))
    assert run.scheduling == "continuous" and len(run.requests) == 4
    for r in run.requests:
        k = sum(1 for o in run.requests if o.stream == r.stream and o.start_s < r.start_s)
        assert r.token_ids == expected_tokens(pf(r.stream, k), 3)
    # step 1 prefills stream 0's 8 tokens (the chunk), step 2 stream 1's beside 0's decode
    first = sorted(run.requests, key=lambda r: (r.start_s, r.stream))[:2]
    assert [r.token_times_s[0] for r in first] == [0.5, 1.0]
    assert all(r.itl_s == [0.5, 0.5] for r in first)
    assert eng.cores[0].closed


def test_a_static_core_takes_the_next_batch_only_when_the_last_one_ended():
    eng = ScriptedEngine(scheduling="static")
    run = closed_loop(eng, distinct_prompts(BASE, 4), concurrency=2, output_tokens=2, requests_per_stream=2,
                      prefill_chunk=64, clock=StepClock(1.0))
    starts = sorted({r.start_s for r in run.requests})
    assert len(starts) == 2 and all(sum(r.start_s == s for r in run.requests) == 2 for s in starts)
    assert starts[1] == max(r.token_times_s[-1] for r in run.requests if r.start_s == starts[0])


def test_admission_is_the_workloads_and_a_point_beyond_it_is_recorded_not_raised():
    eng = ScriptedEngine()
    with pytest.raises(NotAdmitted, match="context"):
        closed_loop(eng, distinct_prompts(BASE, 30), concurrency=1, output_tokens=4, requests_per_stream=1,
                    max_context=32)
    assert eng.cores == []  # refused before a core was opened
    out = load_sweep(eng, distinct_prompts(BASE, 8), concurrency=[1, 4], depth=8, output_tokens=2,
                     requests_per_stream=1, prefill_chunk=8, slo=Slo(10.0, 10.0), kv_bytes_per_token=100.0,
                     kv_budget_bytes=100.0 * 10 * 2)
    assert [p["admitted"] for p in out["points"]] == [True, False]
    assert "2 streams fit" in out["points"][1]["reason"]


def test_open_loop_refuses_and_drops_exactly_on_a_step_clock():
    eng = ScriptedEngine()
    # one slot, one queue place; a 4-token prompt is prefilled in one step, 3 new tokens: 3 steps of 1 s
    run = open_loop(eng, distinct_prompts(BASE, 4), arrivals=[0.0, 0.0, 0.0, 3.5], slots=1, max_waiting=1,
                    timeout_s=2.5, output_tokens=3, prefill_chunk=64, clock=StepClock(1.0))
    by_index = sorted(run.requests, key=lambda r: r.index)
    # 0 runs at once and ends at 3; 1 waits; 2 finds the queue full: refused; at 3 request 1 has
    # waited 3 s > 2.5: dropped; 3 arrives at 3.5 on an idle engine: its first token one step later
    assert [r.outcome for r in by_index] == ["completed", "timed_out", "refused", "completed"]
    assert run.tally.arrived == 4 and run.tally.refused == 1 and run.tally.timed_out == 1
    done = {r.stream: r for r in run.completed}
    assert done[0].token_times_s == [1.0, 2.0, 3.0] and done[3].ttft_s == pytest.approx(1.0)


def test_rate_sweep_runs_unchanged_on_the_scripted_engine():
    out = rate_sweep(ScriptedEngine(), distinct_prompts(BASE, 4), rates=None, sweep_points=2, process="constant",
                     seed=0, requests=6, duration_s=None, slots=2, max_waiting=4, timeout_s=60.0, output_tokens=2,
                     prefill_chunk=64, slo=Slo(100.0, 100.0), max_error_rate=0.5, saturation_share=0.5)
    assert [p["kind"] for p in out["points"][:2]] == ["synchronous", "throughput"]
    assert all(p["completed"] == 6 for p in out["points"][:2])


def test_shared_prefix_reused_counts_the_cache_and_answers_as_prefilled():
    eng = ScriptedEngine()
    common = dict(concurrency=[2], output_tokens=2, requests_per_stream=2, prefill_chunk=64, slo=Slo(10.0, 10.0))
    out = prefix_sweep(eng, BASE, depth=12, prefix_tokens=8, modes=[False, True], **common)
    off, on = out["runs"]
    assert off["cached_prompt_tokens"] == 0 and on["cached_prompt_tokens"] == 4 * 8
    assert on["hit_rate"] == pytest.approx(32 / 48) and on["how"] == "scripted prefix"
    pf = prefixed_prompts(BASE, 12, 8)
    run = closed_loop(eng, pf, concurrency=2, output_tokens=3, requests_per_stream=1, shared_prefix=8,
                      reuse_prefix=True)
    assert sorted(r.token_ids for r in run.requests) == sorted(expected_tokens(pf(s, 0), 3) for s in range(2))
    assert eng.cores[-1].log[0][1] == 2 * 4  # only the own parts were prefilled


def test_interference_lands_the_long_prompt_in_chunks_beside_the_streams():
    streams = [BASE[:6], BASE[10:16]]
    long = BASE[:40]
    run = long_prompt_run(ScriptedEngine(), streams, long, chunk_size=16, before_tokens=3, after_tokens=2,
                          clock=StepClock(1.0))
    assert run.long_steps == 3 and run.long_first_token == expected_tokens(long, 1)[0]
    assert all(len(t) == len(k) for t, k in zip(run.stream_times, run.stream_tokens))
    st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s)
    assert st.long_ttft_s == 3.0 and st.max_gap_s == 1.0  # the scripted step takes 1 s whatever it holds
    out = interference_sweep(ScriptedEngine(), streams, long, chunk_sizes=[16], before_tokens=3, after_tokens=2)
    assert [r["chunk_size"] for r in out["rows"]] == [None, 16] and out["not_measured"] is None
    assert [r["long_steps"] for r in out["rows"]] == [1, 3]


def test_grid_cells_beyond_the_pool_are_not_admitted():
    out = grid_sweep(ScriptedEngine(), lambda d: distinct_prompts(BASE, d), depths=[8, 60], concurrency=[1, 2],
                     output_tokens=4, requests_per_stream=1, prefill_chunk=64, slo=Slo(10.0, 10.0), pool_tokens=100)
    cells = {(row["depth"], p["concurrency"]): p["admitted"] for row in out["depths"] for p in row["points"]}
    assert cells == {(8, 1): True, (8, 2): True, (60, 1): True, (60, 2): False}


SERVING = Path(__file__).resolve().parents[1] / "qeval" / "serving"


def test_no_workload_looks_at_which_engine_it_drives():
    """The workloads reach an engine only through its core: no engine name compared, no
    engine module imported, no function found by a string or by its signature."""
    for path in sorted(SERVING.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert "engines" not in (node.module or ""), f"{path.name} imports {node.module}"
                assert node.module not in ("importlib", "inspect"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name in ("importlib", "inspect") for a in node.names), path.name
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                assert not re.search(r"engine\S*\.name|dialect|backend", text), f"{path.name}: {text}"


def test_a_burst_drains_in_known_steps_and_refuses_past_the_queue():
    from qeval.serving.burst import burst
    # 5 at once, 2 slots, 2 waiting places: one refused; 2 steps a request (prefill gives the first token)
    out = burst(ScriptedEngine(), distinct_prompts(BASE, 4), requests=5, slots=2, max_waiting=2, timeout_s=100.0,
                output_tokens=2, prefill_chunk=64, clock=StepClock(1.0))
    assert (out["completed"], out["refused"], out["timed_out"], out["failed"]) == (4, 1, 0, 0)
    assert out["ttft_max_s"] == 3.0 and out["ttft_s"]["p50"] == 2.0 and out["drain_s"] == 4.0
    assert out["decode_tokens_per_s"] == 2.0 and out["scheduling"] == "continuous"
    from types import SimpleNamespace
    assert "no serving core" in burst(SimpleNamespace(name="x"), None, requests=2, slots=1, max_waiting=0,
                                      timeout_s=1.0, output_tokens=2)["not_measured"]


def test_every_workload_runs_from_the_typed_load_section_on_a_new_engine():
    """The load stage's one call (run_workloads) on the scripted engine: each registered workload
    reads its own recipe field, and the result is a valid typed load section."""
    import json
    from qeval.recipe import LoadSpec
    from qeval.results_load import LoadSection
    from qeval.serving.workload import ServingContext, run_workloads, workloads
    assert [w.name for w in workloads()] == ["load", "grid", "prefix", "interference", "burst", "arrivals"]
    ld = LoadSpec(concurrency=[1, 2], output_tokens=2, requests_per_stream=1, prefill_chunk=64, depths=[8, 16],
                  shared_prefix_tokens=4, interference={"prompt_tokens": 24, "chunk_sizes": [8]},
                  burst={"requests": 3}, arrivals={"rates": [1.0], "requests": 3, "process": "constant"})
    kept, seen = [], []
    ctx = ServingContext(engine=ScriptedEngine(), load=ld, base_ids=BASE, depth=8,
                         keep=lambda at, key, sec: kept.append(key), checkpoint=seen.append)
    out = run_workloads(ctx)
    sec = LoadSection.model_validate(json.loads(json.dumps(out)))
    assert [p.concurrency for p in sec.points] == [1, 2] and sec.users_at_slo == 2
    assert [g.depth for g in sec.grid.depths] == [8, 16] and sec.prefix.run(True).hit_rate == pytest.approx(0.5)
    assert [r.long_steps for r in sec.interference.rows] == [1, 3]
    assert sec.burst.completed == 3 and sec.arrivals.points[0].completed == 3
    assert seen == ["load", "grid", "prefix", "interference", "burst", "arrivals"]
    assert None in kept and {"grid", "prefix", "interference", "burst", "arrivals"} <= set(kept)
