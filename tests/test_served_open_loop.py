"""The served open loop (:func:`qeval.serving.open_loop.open_loop` on the served engine core,
:class:`qeval.engines.openai_core.OpenAICore`) overloaded, each request's fate as the open
loop's module docstring states it: HTTP 429 and 503 are refusals, no first token within
``timeout_s`` a timeout (the connection dropped), any other status or a cut connection a
failure, and beyond ``client_cap(slots, max_waiting, max_in_flight)`` open requests the
client refuses by itself; every arrival is counted once
(completed + refused + timed_out + failed == arrived). Then the core itself: one ``done``
event per request, a released request aborted on the server and silent, the closed loop on
it, and a managed server that dies in a load point failing it with ``ServerFailed``.

Two servers:

* a fake one in this process (http.server in a thread) that answers by the prompt's first
  token: 503 (as llama-server's ``unavailable_error``), 429, 500, a closed connection, a
  request held with no answer at all or with a 200 and no token, or two tokens. The real
  llama-server cannot be made to answer 503 on ``/v1/completions`` at will: in the
  vendored llama.cpp (``tools/server``) it answers 503 only while its model is still
  loading (a window a test cannot hold open) and for ``GET /slots?fail_on_no_slot=1``; a
  completion past its slots is deferred to its queue, which has no bound. Held requests
  are held by the server until the client drops them (the server reads end-of-file on
  their connection), so they time out whatever the machine's speed: no timer decides.
* the real llama-server on the tiny GGUF (2 slots), overloaded past the client's cap: the
  requests the client holds open are queued by the server and all served, the rest
  refused by the client and never sent. The client's requests are held open (in
  ``prompt_for``, which each request calls before it is sent) until every arrival has
  been seen, so which ones the cap refuses does not depend on how fast the server is.
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

#: First prompt token -> what the fake server does with the request.
REFUSE_503, REFUSE_429, FAIL_500, CUT, HOLD_HEAD, HOLD_BODY = 9503, 9429, 9500, 9001, 9002, 9003

#: Longest a held handler waits for the client to drop its request: a hang guard, never reached.
HANG_GUARD_S = 120.0


class _Fake:
    """A /v1 server answering by the prompt's first token (:data:`REFUSE_503` ...); any
    other prompt streams tokens 7 and 8, then a usage chunk (1 cached prompt token).
    ``dropped[i]`` is set when the client closed the connection of held request ``i`` (its
    second prompt token), ``reached`` counts the requests that got here by first token,
    ``bodies`` holds every request body; ``owner``: its models' ``owned_by`` (the dialect)."""

    def __init__(self, owner: str = "llamacpp") -> None:
        self.dropped: dict[int, threading.Event] = {}
        self.reached: dict[int, int] = {}
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj: dict) -> None:
                b = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

            def _wait_for_drop(self, i: int) -> None:
                """Hold the request: no byte more until the client closes the connection."""
                self.connection.settimeout(HANG_GUARD_S)
                try:
                    got = self.connection.recv(1)
                except OSError:
                    got = b"?"
                if got == b"":
                    fake.dropped.setdefault(i, threading.Event()).set()
                self.close_connection = True

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "fake", "owned_by": owner}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                first, second = body["prompt"][0], body["prompt"][1]
                with fake.lock:
                    fake.reached[first] = fake.reached.get(first, 0) + 1
                    fake.bodies.append(body)
                if first == REFUSE_503:  # what llama-server sends while it cannot take a request
                    return self._send(503, {"error": {"code": 503, "message": "Loading model",
                                                      "type": "unavailable_error"}})
                if first == REFUSE_429:
                    return self._send(429, {"error": {"code": 429, "message": "too many requests"}})
                if first == FAIL_500:
                    return self._send(500, {"error": {"code": 500, "message": "internal"}})
                if first == CUT:  # the connection closed with no answer
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return None
                if first == HOLD_HEAD:  # not even a status line
                    return self._wait_for_drop(second)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                if first == HOLD_BODY:  # a 200, then no token
                    return self._wait_for_drop(second)
                for t in (7, 8):
                    ch = {"choices": [{"text": "x", "logprobs": {"content": [{"id": t, "logprob": -0.1}]}}]}
                    self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2,
                                                  "prompt_tokens_details": {"cached_tokens": 1}}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Endpoint:
    """What the served core needs of an engine: ``client``, ``backend``, ``_alive``; its
    ``open_core`` is the real one's (:class:`~qeval.engines.openai_core.OpenAICore`)."""
    backend = "fake"

    def __init__(self, url: str) -> None:
        from qeval.engines.openai import Client
        self.client = Client(url)
        self.client.connect()

    def _alive(self) -> None:
        return None

    def open_core(self, spec, clock):
        from qeval.engines.openai_core import OpenAICore
        return OpenAICore(self, spec, clock)


def test_each_kind_of_server_answer_gets_its_outcome_and_every_arrival_is_counted_once():
    """Twelve requests at once to a 2-slot server: 503 and 429 are refused; a request held
    with no status line and one held after its 200 both time out, and the client drops
    their connections (the server reads end-of-file on each, after the client returned);
    500 and a cut connection fail, counted by status; the rest complete with their tokens.
    completed + refused + timed_out + failed == arrived, in the tally and in the point's
    statistics; the server saw every request (none was refused by the client's cap)."""
    from qeval.measure.openloop import rate_point_stats
    from qeval.serving.open_loop import client_cap, open_loop
    kinds = [None, REFUSE_503, HOLD_HEAD, None, REFUSE_429, FAIL_500, HOLD_BODY, REFUSE_503, CUT, None, HOLD_HEAD,
             None]
    want = {None: "completed", REFUSE_503: "refused", REFUSE_429: "refused", HOLD_HEAD: "timed_out",
            HOLD_BODY: "timed_out", FAIL_500: "failed", CUT: "failed"}
    prompts = [[k if k is not None else 11 + i, i, 5, 6] for i, k in enumerate(kinds)]
    held = [i for i, k in enumerate(kinds) if k in (HOLD_HEAD, HOLD_BODY)]
    srv = _Fake()
    eng = _Endpoint(srv.url)
    try:
        assert client_cap(2, 0, None) > len(kinds)  # the client's cap plays no part here
        run = open_loop(eng, lambda s, i: prompts[i], arrivals=[0.0] * len(kinds), slots=2, max_waiting=0,
                        timeout_s=5.0, output_tokens=2)
        # the held requests were still held when the client returned: dropped by it, not answered
        for i in held:
            assert srv.dropped.setdefault(i, threading.Event()).wait(HANG_GUARD_S), f"request {i} never dropped"
    finally:
        eng.client.http.close()
        srv.close()
    assert [r.outcome for r in run.requests] == [want[k] for k in kinds]
    assert run.failed_by_status == {"503": 2, "429": 1, "timeout": 3, "500": 1, "connection (RemoteProtocolError)": 1}
    assert sorted(x.stream for x in run.completed) == [0, 3, 9, 11]
    assert all(x.token_ids == [7, 8] for x in run.completed)
    t = run.tally
    failed = sum(r.outcome == "failed" for r in run.requests)
    assert (t.arrived, t.refused, t.timed_out, len(run.completed), failed) == (12, 3, 3, 4, 2)
    assert len(run.completed) + t.refused + t.timed_out + failed == t.arrived
    p = rate_point_stats(run, rate_rps=None, kind="throughput", slo=None, max_error_rate=None, saturation_share=0.25)
    assert (p["requests"], p["completed"], p["refused"], p["timed_out"], p["failed"]) == (12, 4, 3, 3, 2)
    assert p["error_rate"] == pytest.approx(8 / 12)
    # every request reached the server once (nothing refused by the client itself)
    assert sum(srv.reached.values()) == 12 and srv.reached[REFUSE_503] == 2 and srv.reached[HOLD_HEAD] == 2


def test_the_served_core_ends_each_request_once_and_aborts_what_it_releases():
    """The core's own contract: the event that brings a request's last token is its one
    ``done`` event (with the server's cached-token count from the usage chunk that follows);
    a released request that still runs is aborted (the server reads end-of-file on its
    connection) and brings no event; leaving the core aborts what is still open; a request
    from a prefix that was never cached is refused."""
    from qeval.measure.arrivals import WallClock
    from qeval.serving.core import CoreSpec
    srv = _Fake()
    eng = _Endpoint(srv.url)
    try:
        clock = WallClock()
        clock.start()
        with eng.open_core(CoreSpec(slots=2, max_seq_tokens=8, label="core"), clock) as core:
            assert (core.controls_steps, core.scheduling, core.slots, core.kv_pool_tokens) == (False, "server", 2, None)
            core.submit(0, [11, 0, 5], 1)  # the fake streams 2 tokens: the first is the last asked for
            core.submit(1, [HOLD_BODY, 1, 5], 4)
            assert core.free() == 0
            events = []
            while not any(e.done for e in events):
                events += core.step(HANG_GUARD_S)
            assert [(e.rid, e.tokens, e.done, e.error, e.cached_tokens) for e in events] == [(0, [7, 8], True, None, 1)]
            assert len(events[0].times) == 2 and core.free() == 1
            core.release(0)  # ended already: nothing to do
            core.release(1)  # held after its 200: aborted
            assert srv.dropped.setdefault(1, threading.Event()).wait(HANG_GUARD_S), "request 1 never dropped"
            assert core.step(0.2) == [] and core.free() == 2
            core.release(1)  # idempotent
            with pytest.raises(ValueError, match="cache_prefix"):
                core.submit(3, [11, 3], 2, prefix=True)
            core.submit(2, [HOLD_BODY, 2, 5], 4)
        assert srv.dropped.setdefault(2, threading.Event()).wait(HANG_GUARD_S), "leaving the core left request 2 open"
        st = core.stats()
        assert st.steps == 0 and st.details == {"dialect": "llama.cpp", "server": "fake"}
    finally:
        eng.client.http.close()
        srv.close()


def test_the_closed_loop_on_the_served_core_streams_salts_and_reuses_a_shared_prefix():
    """The closed loop through the served core: every request's tokens and cached-token
    count; a shared prefix not reused goes to a vLLM server with a distinct ``cache_salt``
    per request; reused, the whole prompt goes without one (the server's cache serves the
    prefix); an HTTP error ends the point as not admitted, naming the status."""
    from qeval.measure.load import NotAdmitted
    from qeval.serving.closed_loop import closed_loop
    srv = _Fake(owner="vllm")
    eng = _Endpoint(srv.url)
    prompt = lambda s, k: [11, 12, 40 + s, k]  # noqa: E731 - a 2-token shared prefix, then the own part
    try:
        assert eng.client.dialect == "vllm"
        kw = dict(concurrency=2, output_tokens=2, requests_per_stream=2, shared_prefix=2)
        off = closed_loop(eng, prompt, reuse_prefix=False, **kw)
        sent_off, srv.bodies[:] = list(srv.bodies), []
        on = closed_loop(eng, prompt, reuse_prefix=True, **kw)
        sent_on = list(srv.bodies)
        with pytest.raises(NotAdmitted, match="500"):
            closed_loop(eng, lambda s, k: [FAIL_500, s, k], concurrency=1, output_tokens=2, requests_per_stream=1)
    finally:
        eng.client.http.close()
        srv.close()
    for run in (off, on):
        assert run.scheduling == "server" and len(run.requests) == 4
        assert all(r.token_ids == [7, 8] and r.prompt_tokens == 4 for r in run.requests)
        assert run.cached_prompt_tokens == 4 and run.details["dialect"] == "vllm" and run.details["server"] == "fake"
    assert sorted(tuple(b["prompt"]) for b in sent_off) == sorted(tuple(b["prompt"]) for b in sent_on) == \
        sorted((11, 12, 40 + s, k) for s in range(2) for k in range(2))
    salts = [b.get("cache_salt") for b in sent_off]
    assert all(salts) and len(set(salts)) == 4
    assert not any("cache_salt" in b for b in sent_on)


# ---- the real llama-server (slow) ----------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GGUF (conftest.served_gguf_module) to start llama-server on."""
    from conftest import served_gguf_module
    yield from served_gguf_module(tmp_path_factory, "served-open-loop")


@pytest.mark.slow
def test_llama_server_queues_past_its_slots_and_the_client_refuses_past_its_cap(served, tmp_path, monkeypatch):
    """llama-server with 2 slots, sent its client cap (2 slots + 0 waiting + 64 headroom =
    66 requests) at once plus 5 more: the 5 arrivals that find 66 requests open are refused
    by the client (counted under "client at its cap of 66 open requests", never sent); the
    66 are all queued by the server (64 past its slots, none refused, none timed out) and
    completed with their 2 tokens each; the counts add up to the 71 arrivals.

    The 66 are held in ``prompt_for`` (made as each is sent; the open loop's first call,
    which sizes the sequences, is let through) until the client has counted the 5th refusal
    (the queue's :class:`~qeval.measure.arrivals.Tally` is watched for it), so the cap, not
    the server's speed, decides which arrivals are refused."""
    from qeval.engines.base import EngineOptions
    from qeval.engines.openai import OpenAIEngine
    from qeval.measure import arrivals
    from qeval.measure.arrivals import Tally
    from qeval.measure.load import distinct_prompts
    from qeval.measure.openloop import rate_point_stats
    from qeval.serving.open_loop import CLIENT_HEADROOM, client_cap, open_loop
    slots, extra, out_tokens = 2, 5, 2
    cap = client_cap(slots, 0, None)
    assert cap == slots + 0 + CLIENT_HEADROOM == 66
    release = threading.Event()
    asked: list[int] = []
    lock = threading.Lock()

    class Watched(Tally):
        def end(self, t: float) -> None:
            super().end(t)
            if self.refused >= extra:  # every arrival has met the cap: let the held ones go
                release.set()
    monkeypatch.setattr(arrivals, "Tally", Watched)  # the open loop's WaitingQueue counts in it
    base = distinct_prompts(served["ids"], 8)

    sized: list[int] = []

    def prompt_for(stream: int, i: int) -> list[int]:
        if not sized:  # the open loop's first call sizes its sequences, before any arrival: not held
            sized.append(i)
            return base(stream, i)
        with lock:
            asked.append(i)
        if not release.wait(HANG_GUARD_S):
            raise RuntimeError("hang guard: the client never reached its cap")
        return base(stream, i)

    eng = OpenAIEngine.open("gguf", served["f16"], EngineOptions(device="cpu", server={
        "serve": {"server": "llama-server", "parallel": slots, "ctx_size": 1024}, "log": str(tmp_path / "server.log"),
        "tier": "t", "tokenizer": str(served["src"])}))
    try:
        run = open_loop(eng, prompt_for, arrivals=[0.0] * (cap + extra), slots=slots, max_waiting=0,
                        timeout_s=300.0, output_tokens=out_tokens)
    finally:
        eng.close()
    assert sized == [0] and release.is_set() and sorted(asked) == list(range(cap))  # only the admitted ones were made
    assert [r.outcome for r in run.requests] == ["completed"] * cap + ["refused"] * extra
    assert all(r.admitted_s is None for r in run.requests[cap:])  # refused by the client: never sent
    assert run.failed_by_status == {f"client at its cap of {cap} open requests": extra}
    assert run.details["client_cap"] == cap and run.details["server"] == eng.backend
    assert sorted(x.stream for x in run.completed) == list(range(cap))
    assert all(len(x.token_ids) == out_tokens and x.prompt_tokens == 8 for x in run.completed)
    t = run.tally
    assert (t.arrived, t.refused, t.timed_out) == (cap + extra, extra, 0)
    failed = sum(r.outcome == "failed" for r in run.requests)
    assert len(run.completed) + t.refused + t.timed_out + failed == t.arrived and failed == 0
    p = rate_point_stats(run, rate_rps=None, kind="throughput", slo=None, max_error_rate=None, saturation_share=0.25)
    assert (p["requests"], p["completed"], p["refused"], p["timed_out"], p["failed"]) == (cap + extra, cap, extra, 0, 0)


@pytest.mark.slow
def test_a_managed_server_that_dies_in_a_load_point_fails_it_with_server_failed(served, tmp_path, monkeypatch):
    """The managed llama-server is killed as a load point's KV-pool phase starts (the test
    fault ``QEVAL_TEST_KILL_SERVER``): the point's first requests meet a dead server, and the
    sweep fails with :class:`~qeval.engines.servers.ServerFailed` naming the signal, not a
    point recorded as not admitted."""
    from qeval.engines.base import EngineOptions
    from qeval.engines.openai import OpenAIEngine
    from qeval.engines.servers import ServerFailed
    from qeval.measure.load import distinct_prompts
    from qeval.serving.closed_loop import load_sweep
    eng = OpenAIEngine.open("gguf", served["f16"], EngineOptions(device="cpu", server={
        "serve": {"server": "llama-server", "parallel": 2, "ctx_size": 512}, "log": str(tmp_path / "server.log"),
        "tier": "dies", "tokenizer": str(served["src"])}))
    try:
        assert eng.prefix_how() == "llama-server cache_prompt: true (a slot keeps its cached prompt)"
        monkeypatch.setenv("QEVAL_TEST_KILL_SERVER", "dies")
        with pytest.raises(ServerFailed, match=r"llama-server \(pid \d+\) killed by SIGKILL mid-stage"):
            load_sweep(eng, distinct_prompts(served["ids"], 8), concurrency=[2], depth=8, output_tokens=2,
                       requests_per_stream=1, prefill_chunk=16, slo=None)
    finally:
        eng.close()
