"""The load sweep against an OpenAI-compatible server: N concurrent streams, each a closed
loop of streamed ``/v1/completions`` requests, batched by the server's own scheduler
(llama-server's slots with continuous batching, vLLM's scheduler), as vLLM ``bench serve``
and GuideLLM drive a server.

Each stream is a thread with its own requests in turn (a fresh prompt of ``depth`` token
ids, ``output_tokens`` new tokens, ``ignore_eos``; sent in the tier's prompt mode,
:meth:`qeval.engines.openai.OpenAIEngine.wire_request`: in text and chat modes a token is a
chunk that carries text); every token's time is the arrival time
of its chunk, in seconds since the run started. httpx's connection pool holds one
connection per stream. asyncio was checked: it gives the same arrival times, and threads
keep the engine's synchronous client.

Open loop (:func:`serve_open_loop`): a scheduler thread sends each request at its arrival
time (:func:`qeval.measure.arrivals.arrival_times`), each on its own thread, whatever is in
flight; the server queues what its slots cannot take. The client applies the queue's
timeout: a request with no first token ``timeout_s`` after it was sent is dropped (its
connection closed) and counted timed out. HTTP errors are counted by status: 429 and 503
are refusals (the server's queue full or overloaded), any other status a failure.
``max_waiting`` is the server's own setting and is not applied by the client.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Iterable, Sequence

from ..measure.arrivals import KEEP_RECORDS, Request, Tally
from ..measure.load import LoadRun, NotAdmitted, PromptFor, RequestRecord, admitted_prompt
from ..measure.openloop import OpenLoopRun
from .openai import chunk_token_ids

#: HTTP statuses counted as refusals (the server's queue is full or it sheds load).
REFUSED_STATUS = (429, 503)


def serve_closed_loop(engine: Any, prompt_for: PromptFor, *, concurrency: int, output_tokens: int,
                      requests_per_stream: int, prefill_chunk: int = 256,
                      kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                      max_context: int | None = None, shared_prefix: int = 0, reuse_prefix: bool = False) -> LoadRun:
    """Serve ``concurrency`` closed-loop streams against ``engine``'s server.

    Args:
        engine: an open :class:`qeval.engines.openai.OpenAIEngine`.
        prompt_for: ``(stream, k) -> prompt token ids``.
        concurrency: N streams at once (more than the server's slots queue there).
        output_tokens: new tokens per request.
        requests_per_stream: requests each stream sends in turn.
        prefill_chunk, kv_budget_bytes, kv_bytes_per_token, max_context: the common serve
            signature (:func:`qeval.measure.serving.load_sweep`); the server schedules its
            own prefill and owns its KV cache, so they are not used here.

    Returns:
        :class:`~qeval.measure.load.LoadRun` (scheduling ``server``); ``details`` holds the
        server's dialect and the streams' HTTP errors (none when it ran clean).

    Raises:
        NotAdmitted: the server refused a request (an HTTP error status: e.g. more tokens
            than its context).
        ServerFailed: a managed server died during the run.
        ValueError: concurrency, output_tokens or requests_per_stream < 1.
    """
    if concurrency < 1 or output_tokens < 1 or requests_per_stream < 1:
        raise ValueError("concurrency, output_tokens and requests_per_stream must be >= 1")
    client = engine.client
    records: list[RequestRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(concurrency + 1)
    t0 = [0.0]
    cached: list[int | None] = []

    wire_request = getattr(engine, "wire_request", None)  # the tier's prompt mode (tokens, text, chat)
    wire_tokens = getattr(engine, "wire_tokens", chunk_token_ids)

    def body(ids: list[int], s: int, k: int) -> tuple[str, dict]:
        if wire_request is not None:
            path, b = wire_request(ids, output_tokens, ignore_eos=True, cache_prompt=bool(shared_prefix and reuse_prefix))
        else:
            path, b = "/v1/completions", client.body(ids, output_tokens, stream=True, ignore_eos=True,
                                                     cache_prompt=bool(shared_prefix and reuse_prefix))
        if shared_prefix and not reuse_prefix and client.dialect == "vllm":
            b["cache_salt"] = f"qeval-{s}-{k}-{time.perf_counter_ns()}"  # no block shared with another request
        return path, b

    def stream(s: int) -> None:
        go.wait()
        for k in range(requests_per_stream):
            ids = [int(t) for t in prompt_for(s, k)]
            start = time.perf_counter() - t0[0]
            toks: list[int] = []
            times: list[float] = []
            hit: int | None = None
            try:
                path, b = body(ids, s, k)
                for t, chunk in client.stream(b, path):
                    got = wire_tokens(chunk)
                    toks += got
                    times += [t - t0[0]] * len(got)
                    hit = cached_tokens(chunk, hit)
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                with lock:
                    errors.append(e)
                return
            if not toks:
                with lock:
                    errors.append(RuntimeError("a request streamed no token ids"))
                return
            with lock:
                records.append(RequestRecord(s, len(ids), start, times, toks))
                cached.append(hit)

    threads = [threading.Thread(target=stream, args=(s,), daemon=True, name=f"qeval-stream-{s}")
               for s in range(concurrency)]
    for th in threads:
        th.start()
    t0[0] = time.perf_counter()
    go.wait()
    for th in threads:
        th.join()
    if errors:
        engine._alive()  # a dead server is the reason (ServerFailed, its log tail printed)
        e = errors[0]
        if isinstance(e, RuntimeError) and "answered HTTP" in str(e):
            raise NotAdmitted(f"the server refused a request at concurrency {concurrency}: {str(e)[:200]}")
        raise e
    duration = max((r.token_times_s[-1] for r in records), default=0.0)
    n_cached = sum(c for c in cached if c is not None) if shared_prefix and all(c is not None for c in cached) \
        else None
    return LoadRun(concurrency=concurrency, scheduling="server", requests=records, duration_s=duration,
                   cached_prompt_tokens=n_cached, details={"dialect": client.dialect, "server": engine.backend})


def cached_tokens(chunk: dict, previous: int | None = None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion chunk (the OpenAI
    field; llama-server fills it from its slot's reused cells, vLLM with
    ``--enable-prompt-tokens-details``), else ``previous``."""
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    got = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(got) if isinstance(got, (int, float)) and not isinstance(got, bool) else previous


class _TimedOut(Exception):
    """No first token within the queue's timeout."""


def serve_open_loop(engine: Any, prompt_for: PromptFor, *, arrivals: Iterable[float], slots: int | None,
                    max_waiting: int, timeout_s: float, output_tokens: int, prefill_chunk: int = 256,
                    kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                    max_context: int | None = None, clock: Any = None, stream: int = 0,
                    max_in_flight: int | None = None) -> OpenLoopRun:
    """Send a request at each of ``arrivals`` (s) to ``engine``'s server (rules in the
    module docstring) and record each one's fate.

    Args:
        engine: an open :class:`qeval.engines.openai.OpenAIEngine`.
        prompt_for: ``(stream, i) -> prompt token ids`` of the i-th arrival.
        arrivals: arrival times, s since the point started (ascending).
        slots: the server's slots (recorded; the server schedules).
        max_waiting: recorded only (the server's queue).
        timeout_s: longest wait for the first token, s.
        max_in_flight: at most this many requests open at once, the rest waiting in the
            client (a sweep's synchronous end: 1); None: no limit (open loop).
        prefill_chunk, kv_budget_bytes, kv_bytes_per_token, max_context, clock: the common
            serve signature; not used (the server owns its KV cache; the wall clock runs).

    Returns:
        :class:`~qeval.measure.openloop.OpenLoopRun` (scheduling "server"), with
        ``failed_by_status``.

    Raises:
        ServerFailed: a managed server died during the point.
        ValueError: no arrival, output_tokens < 1 or timeout_s <= 0.
    """
    import httpx  # start-up time: only served tiers talk HTTP
    if output_tokens < 1 or not timeout_s > 0:
        raise ValueError("an open-loop point needs arrivals, output_tokens >= 1 and timeout_s > 0")
    it = iter(arrivals)
    nxt = next(it, None)
    if nxt is None:
        raise ValueError("an open-loop point needs arrivals, output_tokens >= 1 and timeout_s > 0")
    client = engine.client
    wire_request = getattr(engine, "wire_request", None)  # the tier's prompt mode
    wire_tokens = getattr(engine, "wire_tokens", chunk_token_ids)
    limit = float(timeout_s) if math.isfinite(timeout_s) else None  # a sweep's ends wait without limit
    cap = client_cap(slots, max_waiting, max_in_flight)
    tally = Tally()
    reqs: list[Request] = []  # the first KEEP_RECORDS arrivals and every one sent
    records: list[RequestRecord] = []
    by_status: dict[str, int] = {}
    lock = threading.Lock()
    gate = threading.Semaphore(max_in_flight) if max_in_flight else None
    open_now = [0]
    t0 = time.perf_counter()

    def one(r: Request) -> None:
        i = r.index
        if gate is not None:
            gate.acquire()
        sent = time.perf_counter() - t0
        r.admitted_s = sent
        toks: list[int] = []
        times: list[float] = []
        status: str | None = None
        prompt: list[int] = []
        try:
            prompt = [int(t) for t in prompt_for(stream, i)]  # made when sent, dropped when it ends
            if wire_request is not None:  # the tier's prompt mode (tokens, text, chat)
                path, body = wire_request(prompt, output_tokens, ignore_eos=True)
            else:
                path, body = "/v1/completions", client.body(prompt, output_tokens, stream=True, ignore_eos=True)
            wait = httpx.Timeout(limit, connect=10.0 if limit is None else min(limit, 10.0))
            with client.http.stream("POST", path, json=body, timeout=wait) as resp:
                if resp.status_code != 200:
                    resp.read()
                    status = str(resp.status_code)
                else:
                    for line in resp.iter_lines():
                        t = time.perf_counter() - t0
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        got = wire_tokens(json.loads(data))
                        if got and not toks and limit is not None and t - sent > limit:
                            raise _TimedOut()
                        toks += got
                        times += [t] * len(got)
        except (_TimedOut, httpx.TimeoutException):
            status = "timeout"
        except httpx.HTTPError as e:
            status = f"connection ({e.__class__.__name__})"
        except Exception as e:  # noqa: BLE001 - a bad chunk is this request's failure, counted
            status = f"error ({e.__class__.__name__})"
        finally:
            if gate is not None:
                gate.release()
        end = time.perf_counter() - t0
        with lock:
            open_now[0] -= 1
            if status is None and len(toks) >= 1:
                r.outcome, r.ended_s = "completed", times[-1]
                records.append(RequestRecord(i, len(prompt), r.arrival_s, times, toks))
                return
            r.ended_s = end
            if status == "timeout":
                r.outcome = "timed_out"
            elif status is not None and status.isdigit() and int(status) in REFUSED_STATUS:
                r.outcome = "refused"
            else:
                r.outcome = "failed"
            key = status or "no tokens"
            by_status[key] = by_status.get(key, 0) + 1

    threads: list[threading.Thread] = []
    while nxt is not None:
        r = Request(tally.arrived, float(nxt))
        tally.arrived += 1
        tally.first_arrival_s = r.arrival_s if tally.first_arrival_s is None else tally.first_arrival_s
        tally.last_arrival_s = r.arrival_s
        nxt = next(it, None)
        d = r.arrival_s - (time.perf_counter() - t0)
        if d > 0:
            time.sleep(d)
        with lock:
            full = open_now[0] >= cap
            if not full:
                open_now[0] += 1
        if full:  # the client holds no more open requests than its cap: this one is not sent
            r.outcome, r.ended_s = "refused", r.arrival_s
            tally.refused += 1
            tally.end(r.arrival_s)
            key = f"client at its cap of {cap} open requests"
            by_status[key] = by_status.get(key, 0) + 1
            if r.index < KEEP_RECORDS:
                reqs.append(r)
            continue
        reqs.append(r)
        th = threading.Thread(target=one, args=(r,), daemon=True, name=f"qeval-arrival-{r.index}")
        th.start()
        threads.append(th)
        if len(threads) > 2 * cap:
            threads = [t for t in threads if t.is_alive()]  # ended ones let go: memory follows the open requests
    for th in threads:
        th.join()
    # every request sent is in reqs with its outcome; the client's own refusals are counted in
    # tally (refused) and in reqs only among the first KEEP_RECORDS: take the server's from reqs
    sent = [r for r in reqs if r.admitted_s is not None]
    tally.refused += sum(r.outcome == "refused" for r in sent)
    tally.timed_out += sum(r.outcome == "timed_out" for r in sent)
    for r in sent:
        if r.outcome in ("refused", "timed_out") and r.ended_s is not None:
            tally.end(r.ended_s)
    reqs = [r for r in reqs if r.admitted_s is not None or r.index < KEEP_RECORDS]
    if any(r.outcome == "failed" for r in reqs):
        engine._alive()  # a dead server is the reason (ServerFailed, its log tail printed)
    return OpenLoopRun(requests=reqs, completed=sorted(records, key=lambda x: x.stream), scheduling="server",
                       failed_by_status=by_status, tally=tally,
                       details={"dialect": client.dialect, "server": engine.backend, "slots": slots,
                                "client_timeout_s": limit, "max_in_flight": max_in_flight, "client_cap": cap})


#: The most requests the served client holds open at once beyond the server's own slots and
#: queue: an arrival that finds the client at its cap is counted refused (by the client,
#: ``failed_by_status``), so a schedule of 1,000,000 req/s neither starts a million threads
#: nor holds a million prompts. A server with a queue limit refuses before that (vLLM, SGLang:
#: HTTP 429/503); llama-server queues without limit, so against it the cap is what refuses.
CLIENT_HEADROOM = 64


def client_cap(slots: int | None, max_waiting: int, max_in_flight: int | None) -> int:
    """Requests the served open loop holds open at once: ``max_in_flight`` where set (a
    sweep's ends: its own limit, the rest wait in the client, never refused), else the
    server's slots and queue plus :data:`CLIENT_HEADROOM`."""
    if max_in_flight:
        return 1 << 30  # the semaphore bounds what is in flight; waiting in the client is the point
    return int((slots or 1) + max(max_waiting, 0) + CLIENT_HEADROOM)
