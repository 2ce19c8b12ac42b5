"""Open-loop load: seeded arrival schedules, the bounded waiting queue, rate-point
statistics, saturation, the knee, the sweep driver, the typed load section and the rate
ladder; and the llama.cpp open loop on the tiny model under a scripted clock (every step
takes a set time), so its refusals and drops are counted exactly. No wall-clock assertion."""
from __future__ import annotations

import numpy as np
import pytest

from qeval.analysis.ladder import rate_ladder
from qeval.errors import QevalInputError
from qeval.measure.arrivals import Request, StepClock, WaitingQueue, arrival_times
from qeval.measure.load import RequestRecord, Slo
from qeval.measure.openloop import (OpenLoopRun, is_saturated, knee, rate_meets_slo, rate_point_stats, stop_reason,
                                    sweep_rates)
from qeval.serving.open_loop import rate_sweep
from qeval.results import LoadSection, TierResult, parse_model

# ---- the schedule ---------------------------------------------------------------------------


def test_seeded_arrivals_reproduce_the_same_schedule():
    a = arrival_times(2.0, process="poisson", seed=7, requests=50)
    b = arrival_times(2.0, process="poisson", seed=7, requests=50)
    c = arrival_times(2.0, process="poisson", seed=8, requests=50)
    assert a.shape == (50,) and a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # the gaps are numpy's exponential draws of mean 1/rate from default_rng(seed)
    want = np.concatenate([[0.0], np.cumsum(np.random.default_rng(7).exponential(0.5, size=49))])
    assert np.array_equal(a, want)
    long = arrival_times(4.0, process="poisson", seed=1, requests=20001)
    assert np.mean(np.diff(long)) == pytest.approx(0.25, rel=0.02)
    const = arrival_times(4.0, process="constant", requests=5)
    assert const.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    by_time = arrival_times(3.0, process="poisson", seed=3, duration_s=10.0)
    assert np.all(by_time < 10.0) and len(by_time) > 10
    assert np.array_equal(by_time, arrival_times(3.0, process="poisson", seed=3, duration_s=10.0))


@pytest.mark.parametrize("kw", [dict(rate_rps=0, requests=3), dict(rate_rps=-1, requests=3),
                                dict(rate_rps=1, requests=0), dict(rate_rps=1),
                                dict(rate_rps=1, requests=2, duration_s=1.0), dict(rate_rps=1, duration_s=0.0)])
def test_bad_schedules_are_refused(kw):
    rate = kw.pop("rate_rps")
    with pytest.raises(ValueError):
        arrival_times(rate, **kw)


# ---- the waiting queue ------------------------------------------------------------------------

def test_queue_refuses_when_full_and_drops_after_the_timeout():
    q = WaitingQueue([0.0, 0.0, 0.0, 0.5, 3.2], max_waiting=1, timeout_s=2.5)
    first = q.admit(0.0, free=1)            # room for 1 running + 1 waiting: the third is refused
    assert [r.index for r in first] == [0] and q.waiting == 1
    assert q.requests[2].outcome == "refused" and q.requests[2].ended_s == 0.0
    assert q.admit(1.0, free=0) == []       # 0.5 finds the queue full
    assert q.requests[3].outcome == "refused"
    assert q.admit(3.0, free=1) == []       # request 1 waited 3.0 > 2.5 s: dropped
    assert q.requests[1].outcome == "timed_out" and q.requests[1].ended_s == pytest.approx(2.5)
    assert q.next_arrival() == 3.2
    got = q.admit(3.2, free=1)
    assert [r.index for r in got] == [4] and got[0].admitted_s == 3.2 and q.done()
    with pytest.raises(ValueError):
        WaitingQueue([0.0], max_waiting=-1, timeout_s=1.0)
    with pytest.raises(ValueError):
        WaitingQueue([1.0, 0.0], max_waiting=1, timeout_s=1.0)


# ---- statistics on synthetic timelines ---------------------------------------------------------

def _rec(i: int, arrival: float, ttft: float, gaps: list[float]) -> RequestRecord:
    times = [arrival + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(i, 8, arrival, times, list(range(len(times))))


def _done(i: int, arrival: float, admitted: float, rec: RequestRecord) -> Request:
    return Request(i, arrival, "completed", admitted, rec.token_times_s[-1])


def test_rate_point_stats_counts_percentiles_and_goodput():
    recs = [_rec(0, 0.0, 0.2, [0.1, 0.1]), _rec(1, 1.0, 0.5, [0.1, 0.1]), _rec(3, 3.0, 1.5, [0.3, 0.3])]
    reqs = [_done(0, 0.0, 0.0, recs[0]), _done(1, 1.0, 1.2, recs[1]),
            Request(2, 2.0, "refused", None, 2.0), _done(3, 3.0, 4.0, recs[2]),
            Request(4, 4.0, "timed_out", None, 6.0)]
    run = OpenLoopRun(reqs, recs, "continuous", kv_bytes_peak=100)
    p = rate_point_stats(run, rate_rps=1.0, slo=Slo(1.0, 0.2), max_error_rate=0.5, saturation_share=0.25)
    assert (p["requests"], p["completed"], p["refused"], p["timed_out"], p["failed"]) == (5, 3, 1, 1, 0)
    assert p["error_rate"] == pytest.approx(0.4)
    assert p["offered_rps"] == pytest.approx(4 / 4.0)
    assert p["duration_s"] == pytest.approx(6.0)            # the drop at 6.0 ends the point
    assert p["achieved_rps"] == pytest.approx(3 / 6.0)
    ttfts = [0.2, 0.5, 1.5]
    for q in (50, 95, 99):
        assert p["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q))
    assert p["itl_s"]["p95"] == pytest.approx(np.percentile([0.1] * 4 + [0.3] * 2, 95))
    assert p["e2e_s"]["p50"] == pytest.approx(0.7)
    assert p["queue_wait_s"]["p50"] == pytest.approx(0.2) and p["queue_wait_s"]["p95"] == pytest.approx(
        np.percentile([0.0, 0.2, 1.0], 95))
    # goodput: requests 0 and 1 meet TTFT <= 1 and TPOT <= 0.2; request 3 does not
    assert p["goodput_tokens_per_s"] == pytest.approx(6 / 6.0) and p["goodput_rps"] == pytest.approx(2 / 6.0)
    assert p["slo_attainment"] == pytest.approx(2 / 5)
    assert p["saturated"] is True                             # 0.5 < 1.0 x 0.75
    assert p["meets_slo"] is False                            # TTFT p95 1.4 s > 1.0
    assert rate_meets_slo(p, Slo(2.0, 0.5), 0.5) is True
    assert rate_meets_slo(p, Slo(2.0, 0.5), 0.3) is False     # 40 % errors over a 30 % limit
    LoadSection.model_validate({"arrivals": {"mode": "rates", "process": "poisson", "seed": 0, "slots": 1,
                                             "max_waiting": 1, "timeout_s": 2.0, "saturation_share": 0.25,
                                             "points": [p]}})
    with pytest.raises(ValueError, match="ended"):
        rate_point_stats(OpenLoopRun([Request(0, 0.0)], [], "continuous"), rate_rps=1.0, slo=None,
                         max_error_rate=None, saturation_share=0.25)


def test_saturation_stop_reasons_and_sweep_rates():
    assert is_saturated(10.0, 7.0, 0.25) and not is_saturated(10.0, 8.0, 0.25)
    assert is_saturated(10.0, None, 0.25) and not is_saturated(None, 1.0, 0.25)
    sat = {"rate_rps": 4.0, "saturated": True, "offered_rps": 4.0, "achieved_rps": 2.0, "error_rate": 0.0}
    assert stop_reason(sat, max_error_rate=0.05, saturation_share=0.25).startswith(
        "saturated at 4 req/s: achieved 2 req/s is 50% below")
    err = {"rate_rps": 8.0, "saturated": False, "error_rate": 0.5, "refused": 3, "timed_out": 1, "failed": 0}
    assert "error rate 50% at 8 req/s is above the limit of 5%" in stop_reason(err, max_error_rate=0.05,
                                                                             saturation_share=0.25)
    assert stop_reason({"rate_rps": 1.0, "saturated": False, "error_rate": 0.0}, max_error_rate=0.05,
                       saturation_share=0.25) is None
    assert sweep_rates(1.0, 5.0, 3) == [2.0, 3.0, 4.0]
    assert sweep_rates(2.0, 2.0, 3) == [2.0]
    with pytest.raises(ValueError):
        sweep_rates(1.0, 5.0, 0)


def test_knee_is_the_highest_measured_rate_meeting_the_slo_never_extrapolated():
    def pts(flags):
        return [{"kind": "rate", "rate_rps": r, "meets_slo": m} for r, m in flags]
    k = knee(pts([(1.0, True), (2.0, True), (4.0, False), (8.0, False)]))
    assert (k["rate_rps"], k["below_rps"], k["above_rps"]) == (2.0, 1.0, 4.0)
    k = knee(pts([(1.0, True), (2.0, True)]))
    assert (k["rate_rps"], k["above_rps"]) == (2.0, None) and "not extrapolated" in k["note"]
    k = knee(pts([(1.0, False), (2.0, False)]))
    assert k["rate_rps"] is None and k["above_rps"] == 1.0
    k = knee(pts([(1.0, True), (2.0, False), (4.0, True)]) + [{"kind": "throughput", "meets_slo": True}])
    assert (k["rate_rps"], k["below_rps"], k["above_rps"]) == (4.0, 2.0, None)


# ---- the sweep driver on a scripted engine ----------------------------------------------------

def _fifo_serve(service_s: float):
    """A scripted engine: ``slots`` servers, each request takes ``service_s`` (first token
    at half of it), first come first served, nothing refused."""
    def serve(engine, prompt_for, *, arrivals, slots, max_waiting, timeout_s, output_tokens, stream, **_):
        free = [0.0] * slots
        reqs, recs = [], []
        for i, a in enumerate(arrivals):
            j = int(np.argmin(free))
            start = max(a, free[j])
            free[j] = start + service_s
            rec = RequestRecord(i, 4, a, [start + service_s / 2, start + service_s], [1, 2])
            reqs.append(Request(i, a, "completed", start, free[j]))
            recs.append(rec)
        return OpenLoopRun(reqs, recs, "continuous")
    return serve


def test_rate_sweep_stops_on_saturation_and_brackets_the_knee():
    kw = dict(process="constant", seed=0, requests=8, duration_s=None, slots=1, max_waiting=4, timeout_s=30.0,
              output_tokens=2, prefill_chunk=16, slo=Slo(1.0, 1.0), max_error_rate=0.05, saturation_share=0.25,
              serve=_fifo_serve(0.5))
    out = rate_sweep(None, lambda s, k: [1], rates=[8.0, 1.0, 4.0, 0.5], sweep_points=None, **kw)
    got = [(p["rate_rps"], p["meets_slo"], p["saturated"]) for p in out["points"]]
    # one server of 2 req/s: 0.5 and 1 req/s flow; 4 req/s queues (achieved 2) and the sweep stops there
    assert got == [(0.5, True, False), (1.0, True, False), (4.0, False, True)]
    assert out["stopped"].startswith("saturated at 4 req/s") and out["not_run_rps"] == [8.0]
    assert (out["knee"]["rate_rps"], out["knee"]["below_rps"], out["knee"]["above_rps"]) == (1.0, 0.5, 4.0)
    sweep = rate_sweep(None, lambda s, k: [1], rates=None, sweep_points=3, **{**kw, "slots": 2})
    kinds = [p["kind"] for p in sweep["points"]]
    assert kinds[:2] == ["synchronous", "throughput"]
    sync, thr = sweep["points"][0]["achieved_rps"], sweep["points"][1]["achieved_rps"]
    assert sync == pytest.approx(2.0) and thr == pytest.approx(4.0)   # 1 slot / 2 slots of 2 req/s
    assert [p["rate_rps"] for p in sweep["points"][2:]] == [2.5, 3.0, 3.5]
    sec = LoadSection.model_validate({"arrivals": sweep})
    assert [p.rate_rps for p in sec.arrivals.rate_points] == [2.5, 3.0, 3.5]


# ---- the typed section -------------------------------------------------------------------------

def test_load_section_reads_older_runs_and_names_a_bad_field():
    old = {"depth": 256, "output_tokens": 16, "requests_per_stream": 2, "prefill_chunk": 64,
           "slo": {"ttft_p95_s": 1.0, "itl_p95_s": 0.1}, "scheduling": ["continuous"], "users_at_slo": 2,
           "batching_gain": {"1": 1.0, "2": 1.8}, "points": [
               {"concurrency": 1, "admitted": True, "ttft_s": {"p50": 0.1, "p95": 0.2, "p99": 0.3},
                "e2e_s": {"p50": 1.0, "p95": 1.1}, "meets_slo": True, "details": {"n_ctx": 512}},
               {"concurrency": 8, "admitted": False, "reason": "KV", "requests": 0,
                "requests_not_admitted": 16, "meets_slo": False}]}
    t = TierResult.model_validate({"tier": "x", "method": "bf16", "status": "ok", "load": old})
    assert t.load.arrivals is None and t.load.point(1).ttft_s.p95 == 0.2 and not t.load.point(8).admitted
    assert t.load.slo.max_error_rate is None
    failed = TierResult.model_validate({"tier": "x", "method": "bf16", "status": "ok",
                                        "load": {"error": "boom", "points": []}})
    assert failed.load.error == "boom" and failed.load.points == []
    with pytest.raises(QevalInputError) as e:
        parse_model({"tier": "x", "method": "bf16", "status": "ok",
                     "load": {"points": [], "arrivals": {"mode": "rates", "process": "poisson", "seed": 0,
                                                         "slots": 0, "max_waiting": 1, "timeout_s": 1.0,
                                                         "saturation_share": 0.25}}},
                    TierResult, "run/tiers/x.json")
    assert "run/tiers/x.json" in str(e.value) and "load.arrivals.slots" in str(e.value)
    assert "\n" not in str(e.value)


# ---- the rate ladder -------------------------------------------------------------------------

def _tier(name: str, kld: float | None, pass_rate: float, flips: int, knee_rps: float | None) -> TierResult:
    arrivals = {"mode": "rates", "process": "poisson", "seed": 0, "slots": 4, "max_waiting": 2, "timeout_s": 5.0,
                "saturation_share": 0.25, "knee": {"rate_rps": knee_rps, "note": ""}}
    return TierResult.model_validate({
        "tier": name, "method": "bf16", "status": "ok",
        "quality": {"fidelity": {"kld_mean": kld}, "behaviour": {"pass_rate": pass_rate, "flips_pass_to_fail": flips}},
        "load": {"arrivals": arrivals}})


def test_rate_ladder_steps_down_to_tiers_that_hold_higher_rates():
    tiers = {"bf16": _tier("bf16", None, 0.90, 0, 1.0), "int8": _tier("int8", 0.01, 0.90, 0, 2.0),
             "q4": _tier("q4", 0.05, 0.85, 1, 1.5), "q3": _tier("q3", 0.20, 0.70, 3, 4.0),
             "q2": _tier("q2", 0.50, 0.50, 5, None)}
    lad = rate_ladder(tiers, list(tiers), "bf16")
    assert [(s.tier, s.from_rps, s.knee_rps) for s in lad.steps] == [("bf16", None, 1.0), ("int8", 1.0, 2.0),
                                                                      ("q3", 2.0, 4.0)]
    assert lad.refuse_above_rps == 4.0
    assert "holds no higher rate (1.5 req/s) than int8" in lad.unplaced["q4"]
    assert lad.unplaced["q2"].startswith("no measured rate meets the SLO")
    q3 = lad.steps[2]
    assert q3.kld_given_up == pytest.approx(0.20) and q3.pass_rate_given_up == pytest.approx(0.20)
    assert q3.flips_given_up == 3
    text = lad.text()
    assert text.startswith("serve bf16 up to 1 req/s; above 1 req/s step down to int8")
    assert "above 2 req/s step down to q3 (gives up vs bf16: KLD +0.2 nats, pass rate -20.0 pts, +3 pass->fail " \
           "flips), which holds to 4 req/s" in text
    assert text.endswith("above 4 req/s refuse (rate-limit here)")
    assert rate_ladder({"bf16": TierResult(tier="bf16", method="bf16", status="ok")}, ["bf16"], "bf16") is None


# ---- the llama.cpp open loop on the tiny model, on a scripted clock ----------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random llama's F16 GGUF (conftest.tiny_gguf_module)."""
    from conftest import tiny_gguf_module
    yield from tiny_gguf_module(tmp_path_factory, "openloop")


def test_llamacpp_queue_of_one_refuses_and_drops_exactly(tiny):
    from qeval.engines.llamacpp import LlamaCppEngine
    from qeval.serving.open_loop import open_loop as serve_open_loop
    from qeval.measure.load import distinct_prompts
    pf = distinct_prompts(tiny["ids"], 8)
    eng = LlamaCppEngine(tiny["f16"], threads=1)
    try:
        # one slot, one waiting place, 2.5 s timeout; every step takes 1 s on the scripted clock and a
        # request (8-token prompt, chunk 16, 3 new tokens) takes 3 steps:
        #   t=0: 0 runs, 1 waits, 2 refused; t=1: 3 (0.5) refused; t=3: 0 done, 1 waited 3 s > 2.5: dropped;
        #   t=3.2: 4 runs (done 6.2); t=5.2: 5 (5.0) waits; t=6.2: 5 runs after 1.2 s (done 9.2)
        run = serve_open_loop(eng, pf, arrivals=[0.0, 0.0, 0.0, 0.5, 3.2, 5.0], slots=1, max_waiting=1,
                              timeout_s=2.5, output_tokens=3, prefill_chunk=16, clock=StepClock(1.0))
    finally:
        eng.close()
    outcome = [r.outcome for r in run.requests]
    assert outcome == ["completed", "timed_out", "refused", "refused", "completed", "completed"]
    assert [r.ended_s for r in run.requests] == pytest.approx([3.0, 2.5, 0.0, 0.5, 6.2, 9.2])
    assert [r.admitted_s for r in run.requests if r.outcome == "completed"] == pytest.approx([0.0, 3.2, 6.2])
    assert [x.ttft_s for x in run.completed] == pytest.approx([1.0, 1.0, 2.2])
    assert all(len(x.token_ids) == 3 for x in run.completed) and run.kv_pool_bytes > 0
    p = rate_point_stats(run, rate_rps=1.0, slo=Slo(2.0, 2.0), max_error_rate=0.05, saturation_share=0.25)
    assert (p["completed"], p["refused"], p["timed_out"], p["failed"], p["error_rate"]) == (3, 2, 1, 0, 0.5)
    assert p["queue_wait_s"]["p50"] == pytest.approx(0.0) and p["duration_s"] == pytest.approx(9.2)
    assert p["meets_slo"] is False  # half the requests were not served


def test_hf_open_loop_refuses_past_slots_plus_queue_and_answers_as_alone(tiny):
    import torch
    from qeval.engines.hf import HFEngine
    from qeval.measure.load import distinct_prompts
    from qeval.serving.open_loop import open_loop
    pf = distinct_prompts(tiny["ids"], 12)
    eng = HFEngine(tiny["model"], "cpu", backend="torch-float32")
    # all four arrive at 0: two slots take two, no waiting place: the other two are refused at once
    run = open_loop(eng, pf, arrivals=[0.0, 0.0, 0.0, 0.0], slots=2, max_waiting=0, timeout_s=60.0,
                    output_tokens=3, prefill_chunk=8)
    assert [r.outcome for r in run.requests] == ["completed", "completed", "refused", "refused"]
    assert run.scheduling == "static" and [x.stream for x in run.completed] == [0, 1]
    # one batch of two rows: 12 columns in 2 chunks of 8, then 2 decode steps; both end together
    assert run.details["batches"] == 1 and run.details["steps"] == 4
    assert run.completed[0].token_times_s == run.completed[1].token_times_s
    # a scripted clock (each step 1 s): the batch's first token at the end of its second step
    timed = open_loop(eng, pf, arrivals=[0.0, 0.5], slots=2, max_waiting=1, timeout_s=60.0, output_tokens=3,
                      prefill_chunk=8, clock=StepClock(1.0))
    # the second arrival waits for the first batch's end (static batching), then runs alone
    assert [x.token_times_s for x in timed.completed] == [[2.0, 3.0, 4.0], [6.0, 7.0, 8.0]]
    assert [r.admitted_s for r in timed.requests] == [0.0, 4.0] and timed.details["batches"] == 2
    for x in run.completed:  # the batch answers what each prompt answers alone (greedy)
        ids = torch.tensor([pf(0, x.stream)])
        with torch.inference_mode():
            alone = tiny["model"].generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0, 12:].tolist()
        assert x.token_ids == alone


class _Status:
    """A fake llama-server: a prompt starting 429 or 500 gets that status, 999 sends nothing
    until the test sets :attr:`go` (after the client gave up on it; :attr:`held` is set once
    that request reached the server), anything else streams 2 token ids."""

    #: Longest the 999 request is held if the test never sets ``go`` (a hang guard only).
    HANG_S = 60.0

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.held = threading.Event()
        self.go = threading.Event()
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                b = json.dumps({"data": [{"id": "m", "owned_by": "llamacpp"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                first = body["prompt"][0]
                if first in (429, 500):
                    self.send_response(first)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if first == 999:
                    srv.held.set()
                    srv.go.wait(srv.HANG_S)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for i in (7, 8):
                        ch = {"choices": [{"text": "x", "logprobs": {"content": [{"id": i, "logprob": -0.1}]}}]}
                        self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):  # the client dropped it (timed out)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_served_open_loop_counts_http_errors_by_status_and_drops_after_the_timeout():
    """Against a server that answers 429, 500, nothing, or tokens: refused, failed,
    timed_out and completed, counted by status. The silent request is held by the server
    until the client has returned, so it times out whatever the machine's speed; the
    client's limit only has to exceed what a local answer of two tokens takes."""
    from qeval.engines.openai import Client
    from qeval.engines.openai_core import OpenAICore
    from qeval.serving.open_loop import open_loop
    srv = _Status()

    class Eng:
        client = Client(srv.url)
        backend = "fake"

        def _alive(self):
            return None

        def open_core(self, spec, clock):
            return OpenAICore(self, spec, clock)
    Eng.client.connect()
    prompts = {0: [1, 2], 1: [429, 1], 2: [500, 1], 3: [999, 1], 4: [3, 4]}
    try:
        run = open_loop(Eng(), lambda s, i: prompts[i], arrivals=[0.0] * 5, slots=1, max_waiting=0,
                        timeout_s=2.0, output_tokens=2)
        reached = srv.held.is_set()  # read before go is set: 999 was still held when the client returned
    finally:
        srv.go.set()  # the client has given up on 999 (or failed): let its handler end
        Eng.client.close()
        srv.httpd.shutdown()
        srv.httpd.server_close()
    assert reached  # 999's timeout is the server's silence, not a refused connection
    assert [r.outcome for r in run.requests] == ["completed", "refused", "failed", "timed_out", "completed"]
    assert run.failed_by_status == {"429": 1, "500": 1, "timeout": 1}
    assert [x.token_ids for x in run.completed] == [[7, 8], [7, 8]]
    p = rate_point_stats(run, rate_rps=None, kind="throughput", slo=None, max_error_rate=None, saturation_share=0.25)
    assert (p["completed"], p["refused"], p["timed_out"], p["failed"]) == (2, 1, 1, 1)
    assert p["queue_wait_s"] is None  # the server's queue: not seen by the client


def test_report_and_analysis_read_the_load_section_by_attribute_not_by_key():
    """No ``get_path(x, "load", ...)``, ``x["points"]`` or ``x.get("users_at_slo")`` style read of
    the load section's keys in the report and analysis modules (they read the typed models)."""
    import ast
    from pathlib import Path
    from qeval.results_load import LoadPoint, LoadSection, RatePoint
    keys = (set(LoadSection.model_fields) | set(LoadPoint.model_fields) | set(RatePoint.model_fields)) - {
        "error", "engine", "backend", "device", "threads", "kind", "details", "reason", "requests", "steps", "depth",
        "slo", "scheduling", "output_tokens", "peak_bytes"}  # names other run files share (gate.json, speed)
    root = Path(__file__).resolve().parent.parent / "qeval"
    found = []
    for path in sorted((root / "report").rglob("*.py")) + sorted((root / "analysis").rglob("*.py")):
        if path.name == "outputs.py":  # reads gate.json's ladder (its own file, not the load section)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            args = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "get_path":
                args = node.args[1:2]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get":
                args = node.args[:1]
            elif isinstance(node, ast.Subscript):
                args = [node.slice]
            for a in args:
                if isinstance(a, ast.Constant) and (a.value == "load" or a.value in keys):
                    found.append(f"{path.name}:{node.lineno}: {a.value}")
    assert not found, found
