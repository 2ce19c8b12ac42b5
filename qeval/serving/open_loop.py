"""The open loop: requests arriving on a schedule, whatever is in flight, on any engine core;
and the rate sweep over it (:func:`rate_sweep`), with the statistics, saturation and knee of
:mod:`qeval.measure.openloop` and the schedules and queue of :mod:`qeval.measure.arrivals`.

One loop for every engine (:mod:`qeval.serving.core`). Arrivals wait in the bounded
:class:`~qeval.measure.arrivals.WaitingQueue`; at every step boundary the queue admits as many
as the core has room for (:meth:`~qeval.serving.core.EngineCore.free`), refuses what finds it
full and drops what waited past ``timeout_s``; when nothing runs and nothing waits the loop
idles until the next arrival.

* **In process** (``controls_steps``): the core's slots are the room; a continuous core takes a
  request into the running batch at the next step, a static one only between batches. TTFT
  counts from the arrival (the queue wait in it).
* **Served** (a server schedules): the server holds its own slots and queue, so the client
  sends each arrival at once, up to a cap on open requests (:func:`client_cap`: the server's
  slots and queue plus :data:`CLIENT_HEADROOM`; an arrival that finds the client at its cap is
  refused by the client, counted in ``failed_by_status``). The queue's timeout applies to the
  first token: a request without one ``timeout_s`` after it was sent is aborted and counted
  timed out. HTTP 429 and 503 are refusals (the server's queue full or shedding load), any
  other status or error a failure. A sweep's synchronous end sends one request at a time, the
  rest waiting in the client.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

from ..measure.arrivals import WaitingQueue, WallClock, iter_arrival_times
from ..measure.load import NotAdmitted, PromptFor, RequestRecord, Slo, admission, admitted_prompt
from ..measure.openloop import OpenLoopRun, knee, not_run_point, rate_point_stats, stop_reason, sweep_rates
from .closed_loop import oom_types
from .core import CoreSpec, open_core
from .workload import ServingContext, Workload

#: HTTP statuses counted as refusals (the server's queue is full or it sheds load).
REFUSED_STATUS = (429, 503)

#: The most requests the served client holds open at once beyond the server's own slots and
#: queue: an arrival that finds the client at its cap is counted refused (by the client,
#: ``failed_by_status``), so a schedule of 1,000,000 req/s neither starts a million threads
#: nor holds a million prompts. A server with a queue limit refuses before that (vLLM, SGLang:
#: HTTP 429/503); llama-server queues without limit, so against it the cap is what refuses.
CLIENT_HEADROOM = 64


def client_cap(slots: int | None, max_waiting: int, max_in_flight: int | None) -> int:
    """Requests the served open loop holds open at once: ``max_in_flight`` where set (a
    sweep's synchronous end: the rest wait in the client, never refused), else the server's
    slots and queue plus :data:`CLIENT_HEADROOM`."""
    if max_in_flight:
        return int(max_in_flight)
    return int((slots or 1) + max(max_waiting, 0) + CLIENT_HEADROOM)


def outcome_of(error: str) -> str:
    """The outcome of a request that ended with ``error`` (module docstring): ``timed_out``,
    ``refused`` (HTTP 429/503) or ``failed``."""
    if error == "timeout":
        return "timed_out"
    if error.isdigit() and int(error) in REFUSED_STATUS:
        return "refused"
    return "failed"


def open_loop(engine: Any, prompt_for: PromptFor, *, arrivals: Iterable[float], slots: int, max_waiting: int,
              timeout_s: float, output_tokens: int, prefill_chunk: int = 256,
              kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
              max_context: int | None = None, clock: Any = None, stream: int = 0,
              max_in_flight: int | None = None, label: str = "") -> OpenLoopRun:
    """Serve requests arriving at ``arrivals`` (s) on ``engine``'s core (module docstring).

    Args:
        prompt_for: ``(stream, i) -> prompt token ids`` of the i-th arrival (made when it gets
            a place, dropped when it ends: memory follows the slots, not the schedule); the
            first sizes the sequences.
        arrivals: arrival times, s since the point started (ascending; an iterator is drawn
            as the clock reaches it).
        slots: requests served at once (in process: the core's sequences; served: the
            server's slots, which set the client's cap).
        max_waiting, timeout_s: the queue's length limit and longest wait (s; ``inf``: none).
        output_tokens: new tokens per request (>= 1).
        clock: :class:`~qeval.measure.arrivals.WallClock` (default) or a scripted
            :class:`~qeval.measure.arrivals.StepClock` (tests: each step takes a set time).
        stream: the ``stream`` argument of ``prompt_for`` (distinct per point: fresh prompts).
        max_in_flight: at most this many requests open at once, the rest waiting in the
            queue without refusal or timeout (a sweep's synchronous end: 1); None: ``slots``
            in process, :func:`client_cap` served.
        kv_budget_bytes, kv_bytes_per_token, max_context: admission of ``slots`` sequences.
        label: the point's name (a served engine names its KV-pool phase with it).

    Returns:
        :class:`~qeval.measure.openloop.OpenLoopRun`.

    Raises:
        NotAdmitted: ``slots`` sequences do not fit (admission) or the engine refused them.
        ValueError: no arrival, slots / output_tokens / prefill_chunk < 1, timeout_s <= 0.
    """
    if slots < 1 or output_tokens < 1 or prefill_chunk < 1 or not timeout_s > 0:
        raise ValueError("an open-loop point needs slots, output_tokens, prefill_chunk >= 1 and timeout_s > 0")
    clock = clock or WallClock()
    it = iter(arrivals)
    head = next(it, None)
    if head is None:
        raise ValueError("an open-loop point needs at least one arrival")
    first = [int(t) for t in prompt_for(stream, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    in_flight = int(max_in_flight or slots)
    why = admission(concurrency=in_flight if max_in_flight else slots, depth=len(first), output_tokens=output_tokens,
                    kv_bytes_per_token=kv_bytes_per_token, max_context=max_context, kv_budget_bytes=kv_budget_bytes)
    if why:
        raise NotAdmitted(why)
    spec = CoreSpec(slots=in_flight, max_seq_tokens=len(first) + output_tokens, prefill_chunk=prefill_chunk,
                    kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token, warm_prompt=tuple(first),
                    qeval_admits=True, label=label)
    records: list[RequestRecord] = []
    by_status: dict[str, int] = {}

    def chain() -> Iterable[float]:
        yield head
        yield from it

    with open_core(engine, spec, clock) as core:
        served = not core.controls_steps
        finite = math.isfinite(timeout_s)
        if served:  # the server queues; the client sends at once, up to its cap (module docstring)
            cap = client_cap(slots, max_waiting, max_in_flight)
            queue = WaitingQueue(chain(), max_waiting if max_in_flight else 0, float("inf"))
            first_token_timeout = timeout_s if finite and not max_in_flight else None
        else:
            cap = None
            queue = WaitingQueue(chain(), max_waiting, timeout_s)
            first_token_timeout = None
        live: dict[int, tuple[Any, int, list[int], list[float]]] = {}
        clock.start()
        now = 0.0
        while True:
            room = (cap - len(live)) if served else core.free()
            # a static core looks at its queue only when a batch ended (as a static-batching server
            # takes its queue then): arrivals during a batch wait to be refused or admitted until then
            if core.scheduling == "static" and room <= 0 and live:
                admitted = []
            else:
                admitted = queue.admit(now, room)
            for r in admitted:
                p = admitted_prompt(prompt_for, stream, r.index, len(first))
                core.submit(r.index, p, output_tokens, timeout_s=first_token_timeout)
                live[r.index] = (r, len(p), [], [])
            if not live:
                nxt = queue.next_arrival()
                if nxt is None:
                    break
                now = clock.idle_until(nxt)
                continue
            nxt = queue.next_arrival()
            events = core.step(None if nxt is None else max(0.0, nxt - clock.now()))
            now = clock.now()
            for ev in events:
                r, n_prompt, toks, times = live[ev.rid]
                toks += ev.tokens
                times += ev.times
                if not ev.done:
                    continue
                del live[ev.rid]
                core.release(ev.rid)
                if ev.error is None and toks:
                    r.outcome, r.ended_s = "completed", times[-1]
                    records.append(RequestRecord(r.index, n_prompt, r.arrival_s, times, toks))
                    continue
                key = ev.error or "no tokens"
                r.outcome, r.ended_s = outcome_of(key), max(now, r.admitted_s or 0.0)
                by_status[key] = by_status.get(key, 0) + 1
                if r.outcome == "refused":
                    queue.tally.refused += 1
                elif r.outcome == "timed_out":
                    queue.tally.timed_out += 1
                if r.outcome != "failed":
                    queue.tally.end(r.ended_s)
        st = core.stats()
        scheduling = core.scheduling
    by_client = queue.tally.refused - sum(v for k, v in by_status.items() if outcome_of(k) == "refused")
    if served and by_client:  # arrivals the client did not send: it held its cap of open requests
        by_status[f"client at its cap of {cap} open requests"] = by_client
    details = {**st.details, "slots": slots, "steps": st.steps, "prefill_chunk": prefill_chunk}
    if served:
        details.update({"client_timeout_s": first_token_timeout, "max_in_flight": max_in_flight, "client_cap": cap})
    return OpenLoopRun(requests=queue.requests, completed=sorted(records, key=lambda x: x.stream),
                       scheduling=scheduling, tally=queue.tally, failed_by_status=by_status,
                       kv_bytes_peak=st.kv_bytes_peak, kv_pool_bytes=st.kv_pool_bytes, details=details)


def rate_sweep(engine: Any, prompt_for: PromptFor, *, rates: Sequence[float] | None, sweep_points: int | None,
               process: str, seed: int, requests: int | None, duration_s: float | None, slots: int,
               max_waiting: int, timeout_s: float, output_tokens: int, prefill_chunk: int, slo: Slo | None,
               max_error_rate: float | None, saturation_share: float, peak: Any = None,
               kv_bytes_per_token: float | None = None, kv_budget_bytes: float | None = None,
               max_context: int | None = None, serve: Callable[..., Any] | None = None,
               progress: Callable[[str], None] = lambda s: None,
               on_point: Callable[[dict], None] | None = None) -> dict:
    """The open-loop sweep of one tier: each rate of ``rates`` ascending, or a sweep
    (the synchronous rate: ``n`` requests one at a time; the saturated throughput: all
    ``n`` at once, no queue limit, no timeout; then ``sweep_points`` rates evenly between),
    stopping after the first point that is saturated or over ``max_error_rate``.

    Args:
        prompt_for: ``(stream, i) -> prompt ids``; each point uses its own ``stream`` (1000 +
            its number), so every request of the sweep is a fresh prompt.
        requests / duration_s: the length of each point (one of them).
        slots: requests served at once; max_waiting, timeout_s: the queue (load.queue).
        serve: the open-loop function (default :func:`open_loop`; tests pass a scripted one).
        on_point: called after each point with the section as it stands (as
            :func:`qeval.serving.closed_loop.load_sweep`).

    Returns:
        a dict of :class:`qeval.results_load.ArrivalsSection`'s fields.

    Raises:
        ValueError: neither rates nor sweep_points given.
    """
    serve = serve or open_loop
    if not rates and not sweep_points:
        raise ValueError("rate_sweep needs rates or sweep_points")
    points: list[dict] = []
    common = dict(output_tokens=output_tokens, prefill_chunk=prefill_chunk, kv_budget_bytes=kv_budget_bytes,
                  kv_bytes_per_token=kv_bytes_per_token, max_context=max_context)
    n_fixed = int(requests or 16)  # a sweep's ends are counted in requests (the recipe refuses duration_s with a sweep)

    def run(kind: str, rate: float | None, times: Iterable[float], expected: int, **kw: Any) -> dict:
        stream = 1000 + len(points)
        if peak is not None:
            peak.reset()
        try:
            r = serve(engine, prompt_for, arrivals=times, stream=stream, label=f"load at {kind} {rate or ''}".rstrip(),
                      **common, **kw)
        except NotAdmitted as e:
            progress(f"load: {kind} {rate or ''} not admitted: {e}")
            return not_run_point(rate, kind, expected, str(e))
        except oom_types() as e:
            progress(f"load: {kind} {rate or ''} ran out of memory")
            return not_run_point(rate, kind, expected, f"out of memory: {e.__class__.__name__}: {e}"[:300])
        p = rate_point_stats(r, kind=kind, rate_rps=rate, slo=slo, max_error_rate=max_error_rate,
                             saturation_share=saturation_share)
        p["peak_bytes"] = peak.read() if peak is not None else None
        return p

    stopped = None
    todo: list[float] = sorted(float(x) for x in rates) if rates else []

    def arrivals_section(pts: list[dict]) -> dict:
        ran = {p.get("rate_rps") for p in pts if p.get("kind") == "rate"}
        return {"mode": "sweep" if sweep_points else "rates", "process": process, "seed": int(seed),
                "slots": int(slots), "max_waiting": int(max_waiting), "timeout_s": float(timeout_s),
                "saturation_share": float(saturation_share), "requests_per_point": requests,
                "duration_s": duration_s, "points": list(pts), "knee": knee(pts), "stopped": stopped,
                "not_run_rps": [r for r in todo if r not in ran] if stopped else []}
    if sweep_points:
        inf = float("inf")
        progress(f"load: sweep: synchronous ({n_fixed} requests one at a time)")
        sync = run("synchronous", None, [0.0] * n_fixed, n_fixed, slots=1, max_waiting=n_fixed, timeout_s=inf,
                   max_in_flight=1)
        points.append(sync)
        if on_point is not None:
            on_point(arrivals_section(points))
        progress(f"load: sweep: throughput ({n_fixed} requests at once, {slots} slots)")
        thr = run("throughput", None, [0.0] * n_fixed, n_fixed, slots=slots, max_waiting=n_fixed, timeout_s=inf)
        points.append(thr)
        if on_point is not None:
            on_point(arrivals_section(points))
        lo, hi = sync.get("achieved_rps"), thr.get("achieved_rps")
        if not lo or not hi:
            stopped = "the sweep's ends did not complete (synchronous or throughput point failed)"
        else:
            todo = sweep_rates(lo, hi, sweep_points)
    for i, rate in enumerate(todo):
        if stopped:
            break
        # drawn as the clock reaches them: memory follows the slots and the queue, not rate x duration
        times = iter_arrival_times(rate, process=process, seed=seed + i, requests=requests, duration_s=duration_s)
        expected = requests or max(1, int(math.ceil(rate * float(duration_s or 0))))
        progress(f"load: {rate:g} req/s ({process}, " + (f"{requests} requests" if requests else
                 f"{duration_s:g} s, about {expected} requests") + f", queue {max_waiting}, timeout {timeout_s:g} s)")
        p = run("rate", rate, times, expected, slots=slots, max_waiting=max_waiting, timeout_s=timeout_s)
        points.append(p)
        stopped = stop_reason(p, max_error_rate=max_error_rate, saturation_share=saturation_share)
        if stopped:
            progress(f"load: {stopped}")
        if on_point is not None:
            on_point(arrivals_section(points))
    return arrivals_section(points)


def _run(ctx: ServingContext) -> dict | None:
    """``load.arrivals`` through ``load.queue``, ``max(load.concurrency)`` slots, fresh prompts per point."""
    ld = ctx.load
    ar, q = ld.arrivals, ld.queue
    if ar is None:
        return None

    def on_point(sec: dict) -> None:
        last = sec["points"][-1]
        ctx.keep(f"the open loop at {last.get('rate_rps') or last.get('kind')}"
                 + (" req/s" if last.get("rate_rps") else ""), "arrivals", sec)
    return rate_sweep(ctx.engine, ctx.prompts(), rates=ar.rates, sweep_points=ar.sweep.points if ar.sweep else None,
                      process=ar.process, seed=ar.seed, requests=ar.requests, duration_s=ar.duration_s,
                      slots=max(ld.concurrency), max_waiting=q.max_waiting, timeout_s=q.timeout_s,
                      output_tokens=ld.output_tokens, prefill_chunk=ld.prefill_chunk, slo=ctx.slo,
                      max_error_rate=ld.slo.max_error_rate, saturation_share=ar.saturation_share, peak=ctx.peak,
                      kv_bytes_per_token=ctx.kv_bytes_per_token, kv_budget_bytes=ctx.kv_budget_bytes,
                      max_context=ctx.max_context, progress=ctx.progress, on_point=on_point)


#: The open loop (``load.arrivals``): last, after every closed-loop workload.
WORKLOAD = Workload("arrivals", 50, _run)
