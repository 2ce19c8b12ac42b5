"""The load stage's memory does not grow with the work a recipe asks (issue: a point offered
1,000,000 req/s built every arrival, a prompt and a record each, before its clock started):
arrivals are drawn as the clock reaches them, the waiting queue counts what it refuses and
keeps records of a bounded few, and prompts are made when a request gets a place."""
from __future__ import annotations

import tracemalloc

import pytest

from qeval.measure.arrivals import KEEP_RECORDS, StepClock, WaitingQueue, iter_arrival_times
from qeval.measure.load import LazyPrompts
from qeval.measure.openloop import OpenLoopRun, rate_point_stats

MIB = 2 ** 20


def test_a_million_requests_per_second_holds_a_few_mib():
    """1,000,000 arrivals in a second through a queue of 8 with 2 slots on a scripted clock
    (each batch 10 ms): every arrival is counted, the records kept stay under KEEP_RECORDS
    plus those served, and the traced peak stays a few MiB (the old schedule alone was 8 MB
    of float64, with a record and a prompt of about 1.35 KB per arrival beside it)."""
    tracemalloc.start()
    q = WaitingQueue(iter_arrival_times(1e6, process="constant", duration_s=1.0), max_waiting=8, timeout_s=0.05)
    clock = StepClock(0.01)
    served = 0
    now = 0.0
    while True:
        take = q.admit(now, 2)
        if not take:
            nxt = q.next_arrival()
            if nxt is None:
                break
            now = clock.idle_until(nxt)
            continue
        now = clock.step()
        for r in take:
            r.outcome, r.ended_s = "completed", now
            served += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t = q.tally
    # 1e6 x 1 s by a running sum of 1e-6 gaps: the float sum may fit one more below 1.0
    assert t.arrived in (1_000_000, 1_000_001) and t.first_arrival_s == 0.0 and t.last_arrival_s < 1.0
    assert t.refused + t.timed_out + served == t.arrived
    # 2 served per 10 ms step while arrivals last, then the queue of 8 (and a batch) drains
    assert 2 * 100 <= served <= 2 * 100 + 8 + 2
    assert len(q.requests) <= KEEP_RECORDS + served
    assert peak < 8 * MIB, peak
    # the statistics read the counts: the error rate of the whole schedule, not of the records
    p = rate_point_stats(OpenLoopRun(requests=[r for r in q.requests if r.outcome != "completed"], completed=[],
                                     scheduling="static", tally=t),
                         rate_rps=1e6, slo=None, max_error_rate=None, saturation_share=0.25)
    assert p["requests"] == t.arrived and p["refused"] == t.refused and p["timed_out"] == t.timed_out
    assert p["offered_rps"] == pytest.approx(1e6, rel=1e-5) and p["error_rate"] > 0.99


def test_lazy_prompts_are_made_on_access_and_checked():
    made = []

    def pf(s, k):
        made.append((s, k))
        return [7, 7, s, k + 1] if (s, k) != (9, 9) else [7, 7, 1, 2, 3]
    prompts = LazyPrompts(pf, 4, prefix=[7, 7])
    assert made == [] and prompts[(3, 4)] == [7, 7, 3, 5] and made == [(3, 4)]
    with pytest.raises(ValueError, match="from 1 to 4"):
        prompts[(9, 9)]  # longer than the first prompt that sized the cache
    bad = LazyPrompts(lambda s, k: [1, 2, 3], 4, prefix=[7, 7])
    with pytest.raises(ValueError, match="same 2 tokens"):
        bad[(0, 0)]


def test_a_load_stage_killed_after_its_points_keeps_them_in_the_row_the_gate_and_the_report(tiny_llama, tmp_path):
    """The load stage of one tier is killed (SIGKILL at its named point ``points``: after the
    closed loop's two points, before the open loop) as the out-of-memory killer or a
    timeout would: the tier still finishes ok with both points in its row, marked partial
    with where and why it stopped, an error file in the run folder, the stop in gate.json,
    the printed verdict and the report, and its users at SLO from the points it measured."""
    import json
    import os
    import subprocess
    import sys

    from conftest import GATE, write_recipe
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers="  - {name: bf16, method: bf16}\n"
                                                                    "  - {name: b2, method: bf16}\n",
                          suites=False, extra="gate: {reference: bf16, rules: {min_decode_rel: 0.001}}")
    text = recipe.read_text().replace("load: {enabled: true,", "load: {enabled: true, arrivals: {rates: [1.0], "
                                      "requests: 2}, queue: {max_waiting: 1, timeout_s: 1.0},")
    recipe.write_text(text)
    env = dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache"), QEVAL_TEST_CRASH="b2:load:points:SIGKILL")
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    # a first run in a new QEVAL_CACHE: the fork server's import noise (torchao's missing CUDA
    # kernels, torch's deprecation warnings) goes to the cache's stage_preload.log, not the console
    assert "Failed to load" not in p.stderr and "_pytree.py" not in p.stderr, p.stderr[:2000]
    assert (tmp_path / "cache" / "stage_preload.log").is_file()
    run_dir = next((tmp_path / "res" / "tiny").iterdir())
    row = json.loads((run_dir / "tiers" / "b2.json").read_text())
    assert row["status"] == "ok"
    load = row["load"]
    assert [pt["concurrency"] for pt in load["points"]] == [1, 2] and all(pt["admitted"] for pt in load["points"])
    assert load["partial"] is True and load["arrivals"] is None
    assert load["stopped"].startswith("load stopped after the closed loop at 2 streams: load process killed by SIGKILL")
    assert isinstance(load["users_at_slo"], int)
    assert json.loads((run_dir / "stages" / "b2.load.error.json").read_text())["error"].startswith("load process killed")
    gate = json.loads((run_dir / "gate.json").read_text())
    assert gate["load_stopped"] == {"b2": load["stopped"]}
    assert f"partial load: b2: {load['stopped']}" in p.stdout
    html = (run_dir / "report.html").read_text()
    assert "partial: load stopped after the closed loop at 2 streams: load process killed by SIGKILL" in html
    full = json.loads((run_dir / "tiers" / "bf16.json").read_text())["load"]
    assert full["partial"] is False and full["arrivals"]["points"]  # the other tier's stage ran to its end


def test_interference_is_admitted_against_the_kv_budget_and_the_context_before_anything_runs():
    """4096 streams x 8184-token prompts on the default model (23,040 KV bytes per token) is
    about 770 GB of KV: not admitted, said in one line, and no engine call is made (the
    engine here has no serving core: reaching it would say so instead)."""
    from qeval.serving.interference import interference_sweep
    streams = [[1] * 8184] * 4096
    out = interference_sweep(object(), streams, [2] * 8184, chunk_sizes=[64], kv_bytes_per_token=23040,
                             kv_budget_bytes=8 * 2 ** 30, max_context=8192)
    assert out["rows"] == [] and out["not_measured"].startswith("not admitted: KV cache of ")
    assert "exceeds the KV budget of 8.00 GiB" in out["not_measured"]
    long = interference_sweep(object(), [[1] * 16], [2] * 8190, chunk_sizes=[64], max_context=8192)
    assert long["not_measured"].startswith("not admitted: the 8190-token prompt")
    from types import SimpleNamespace
    stub = SimpleNamespace(name="stub")
    fits = interference_sweep(stub, [[1] * 16], [2] * 64, chunk_sizes=[64], kv_bytes_per_token=23040,
                              kv_budget_bytes=8 * 2 ** 30, max_context=8192)
    assert "has no serving core" in fits["not_measured"]  # admitted: it went on to the engine


def test_run_estimate_prints_the_plan_and_runs_nothing(tmp_path):
    """``qeval run --estimate``: the plan with the load stage's least time from its settings
    (the default recipe: 2 rates x 3 s of arrivals = 6 s per tier, 7 tiers) and the gate
    rules' power, exit 0, and no run folder."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(repo / "recipes" / "smollm2-135m.yaml"),
                        "--estimate", "--out", str(tmp_path / "res")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, QEVAL_CACHE=str(tmp_path / "cache")))
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("time     load stage: at least 6 s per tier (open loop at 0.5 req/s: 3 s; open loop at 4 req/s: 3 s), "
            "42 s over 7 tiers") in p.stdout
    assert "power    min_pass_rate_rel 0.5: 21 paired checks see a drop of 0.299" in p.stdout
    assert not (tmp_path / "res").exists()
