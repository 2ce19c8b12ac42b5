"""The closed loop: N streams, each sending its next request the moment its last one ended
(vLLM ``bench serve --max-concurrency``, GuideLLM ``concurrent``), on any engine core; and
the concurrency sweep over it (:func:`load_sweep`), with admission, peak memory and the
statistics of :mod:`qeval.measure.load`.

One loop for every engine (:mod:`qeval.serving.core`): while a stream waits and the core has
room (:meth:`~qeval.serving.core.EngineCore.free`), its next request is submitted; then one
step; every token event is added to its request; a request that has its ``output_tokens`` is
released and its stream queues its next one. On a continuous core a stream's next request
joins the running batch at the next step; on a static core it waits for the batch's end; on
a served core the server schedules. Greedy, end-of-sequence ignored (fixed output length).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

from ..measure.arrivals import WallClock
from ..measure.load import (LazyPrompts, LoadRun, NotAdmitted, PromptFor, RequestRecord, Slo, admission,
                            not_admitted_point, point_stats, summarize)
from .core import CoreSpec, open_core
from .workload import ServingContext, Workload


def oom_types() -> tuple[type, ...]:
    """The exceptions that mean out of memory here: ``MemoryError`` and, where torch is
    loaded, ``torch.OutOfMemoryError`` (a point that ran out is recorded, never raised)."""
    try:
        import torch  # start-up time: torch loads only in stage processes
        return (MemoryError, torch.OutOfMemoryError)
    except (ImportError, AttributeError):
        return (MemoryError,)


def closed_loop(engine: Any, prompt_for: PromptFor, *, concurrency: int, output_tokens: int,
                requests_per_stream: int, prefill_chunk: int = 256, kv_bytes_per_token: float | None = None,
                kv_budget_bytes: float | None = None, max_context: int | None = None, pool_tokens: int | None = None,
                shared_prefix: int = 0, reuse_prefix: bool = False, scheduling: str = "auto",
                label: str = "", clock: Any = None) -> LoadRun:
    """Serve ``concurrency`` closed-loop streams on ``engine``'s core.

    Args:
        prompt_for: ``(stream, k) -> prompt token ids`` of the stream's k-th request; the first
            prompt's length sizes the sequences (every prompt at most as long, made as its
            request starts: :class:`~qeval.measure.load.LazyPrompts`).
        concurrency: N streams (and the core's slots).
        output_tokens: new tokens per request (>= 1).
        requests_per_stream: requests each stream sends in turn (>= 1).
        prefill_chunk: prompt tokens per step (chunked prefill).
        kv_bytes_per_token, kv_budget_bytes, max_context, pool_tokens: admission
            (:func:`qeval.measure.load.admission`).
        shared_prefix: every prompt starts with the same this many tokens; with
            ``reuse_prefix`` the core caches them once (untimed: a system prompt already held)
            and every request starts from that cache; without, each request prefills them.
        scheduling: the engine's schedule where it has several (``auto``).
        label: the point's name (a served engine names its KV-pool phase with it).
        clock: :class:`~qeval.measure.arrivals.WallClock` (default) or a scripted
            :class:`~qeval.measure.arrivals.StepClock` (tests).

    Returns:
        :class:`~qeval.measure.load.LoadRun` (``cached_prompt_tokens`` with ``shared_prefix``:
        summed from the requests' ends, None when the engine did not report them).

    Raises:
        NotAdmitted: the point does not fit (admission) or the engine refused it.
        ValueError: bad arguments or prompts.
    """
    if concurrency < 1 or output_tokens < 1 or requests_per_stream < 1 or prefill_chunk < 1:
        raise ValueError("concurrency, output_tokens, requests_per_stream and prefill_chunk must be >= 1")
    first = [int(t) for t in prompt_for(0, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    if shared_prefix and len(first) <= shared_prefix:
        raise ValueError(f"every prompt must start with the same {shared_prefix} tokens and have its own part")
    why = admission(concurrency=concurrency, depth=len(first), output_tokens=output_tokens,
                    kv_bytes_per_token=kv_bytes_per_token, max_context=max_context, kv_budget_bytes=kv_budget_bytes,
                    pool_tokens=pool_tokens)
    if why:
        raise NotAdmitted(why)
    prefix = first[:shared_prefix] if shared_prefix else []
    prompts = LazyPrompts(prompt_for, len(first), prefix=prefix or None)
    reuse = bool(prefix) and reuse_prefix
    spec = CoreSpec(slots=concurrency, max_seq_tokens=len(first) - (len(prefix) if reuse else 0) + output_tokens,
                    prefill_chunk=prefill_chunk, prefix_tokens=len(prefix) if reuse else 0,
                    shared_prefix=len(prefix),
                    kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token,
                    warm_prompt=tuple(first), scheduling="static" if shared_prefix and scheduling == "auto"
                    else scheduling, label=label)
    clock = clock or WallClock()
    records: list[RequestRecord] = []
    cached: list[int | None] = []
    with open_core(engine, spec, clock) as core:
        if reuse:
            core.cache_prefix(prefix)
        # (stream, k, when it was ready to send): in process the end of the step that gave the stream's
        # last request its last token (the request goes into the next step); served, when it is sent
        waiting: deque[tuple[int, int, float]] = deque((s, 0, 0.0) for s in range(concurrency))
        live: dict[int, tuple[int, int, list[int], float, list[int], list[float]]] = {}
        rid = 0
        clock.start()
        while waiting or live:
            room = core.free()
            while waiting and room > 0:
                s, k, ready = waiting.popleft()
                p = prompts[(s, k)]
                core.submit(rid, p[len(prefix):] if reuse else p, output_tokens, prefix=reuse)
                live[rid] = (s, k, p, ready if core.controls_steps else clock.now(), [], [])
                rid += 1
                room -= 1
            for ev in core.step():
                s, k, p, start, toks, times = live[ev.rid]
                toks += ev.tokens
                times += ev.times
                if ev.error is not None:
                    raise NotAdmitted(f"a request at concurrency {concurrency} ended with {ev.error}")
                if not ev.done:
                    continue
                if not toks:
                    raise RuntimeError("a request ended with no token")
                records.append(RequestRecord(s, len(p), start, times, toks))
                cached.append(ev.cached_tokens)
                del live[ev.rid]
                core.release(ev.rid)
                if k + 1 < requests_per_stream:
                    waiting.append((s, k + 1, times[-1]))
        st = core.stats()
    duration = max((r.token_times_s[-1] for r in records), default=0.0)
    n_cached = (sum(int(c) for c in cached) if all(c is not None for c in cached) else None) if shared_prefix else None
    return LoadRun(concurrency=concurrency, scheduling=core.scheduling, requests=records, duration_s=duration,
                   kv_bytes_peak=st.kv_bytes_peak, kv_pool_bytes=st.kv_pool_bytes,
                   decode_step_tokens=st.decode_step_tokens, decode_step_s=st.decode_step_s, steps=st.steps,
                   cached_prompt_tokens=n_cached, details={**st.details, "prefill_chunk": prefill_chunk})


def load_sweep(engine: Any, prompt_for: PromptFor, *, concurrency: Sequence[int], depth: int, output_tokens: int,
               requests_per_stream: int, prefill_chunk: int, slo: Slo | None, peak: Any = None,
               kv_bytes_per_token: float | None = None, kv_budget_bytes: float | None = None,
               max_context: int | None = None, shared_prefix: int = 0, reuse_prefix: bool = False,
               pool_tokens: int | None = None, progress: Callable[[str], None] = lambda s: None,
               on_point: Callable[[dict], None] | None = None) -> dict:
    """Measure every concurrency (ascending) with :func:`closed_loop`.

    Args:
        prompt_for: ``(stream, k) -> depth`` prompt token ids, distinct per request.
        peak: a :class:`qeval.measure.memory.PeakMemory` reset before each point (None: no
            peak memory figures).
        shared_prefix, reuse_prefix: as :func:`closed_loop` (the shared-prefix workload,
            :mod:`qeval.serving.prefix`).
        on_point: called after each point with the section as it stands (the same dict
            this returns, over the points so far): the load stage writes it to the run
            folder, so a stage stopped later keeps what it measured.
        kv_bytes_per_token, kv_budget_bytes, max_context, pool_tokens: admission.

    Returns:
        the tier's ``load`` section: ``depth``, ``output_tokens``, ``requests_per_stream``,
        ``prefill_chunk``, ``slo``, ``scheduling`` (the schedules that ran), ``points`` (one
        dict per concurrency, :func:`~qeval.measure.load.point_stats` plus ``peak_bytes``,
        or a not-admitted record), and :func:`~qeval.measure.load.summarize`'s figures.
        A point the engine or budget cannot hold is recorded as not admitted, never raised.

    Raises:
        ValueError: the engine has no core.
    """
    points: list[dict] = []

    def section(pts: list[dict]) -> dict:
        out = {"depth": int(depth), "output_tokens": int(output_tokens), "requests_per_stream": int(requests_per_stream),
               "prefill_chunk": int(prefill_chunk),
               "slo": {"ttft_p95_s": slo.ttft_p95_s, "itl_p95_s": slo.itl_p95_s} if slo else None,
               "scheduling": sorted({p["scheduling"] for p in pts if p.get("scheduling")}),
               "kv_bytes_per_token": kv_bytes_per_token, "kv_budget_bytes": kv_budget_bytes,
               "points": list(pts)}
        out.update(summarize(pts, slo))
        return out

    for c in sorted(set(int(x) for x in concurrency)):
        progress(f"load: concurrency {c} ({requests_per_stream} requests per stream, depth {depth}, "
                 f"{output_tokens} new tokens each)")
        if peak is not None:
            peak.reset()
        try:
            run = closed_loop(engine, prompt_for, concurrency=c, output_tokens=output_tokens,
                              requests_per_stream=requests_per_stream, prefill_chunk=prefill_chunk,
                              kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token,
                              max_context=max_context, pool_tokens=pool_tokens, shared_prefix=shared_prefix,
                              reuse_prefix=reuse_prefix, label=f"load at concurrency {c}")
            why = None
        except NotAdmitted as e:
            run, why = None, str(e)
        except oom_types() as e:
            run, why = None, f"out of memory: {e.__class__.__name__}: {e}"[:300]
        if run is None:
            progress(f"load: concurrency {c} not admitted: {why}")
            points.append(not_admitted_point(c, requests_per_stream, why))
        else:
            p = point_stats(run, slo)
            p["peak_bytes"] = peak.read() if peak is not None else None
            points.append(p)
        if on_point is not None:
            on_point(section(points))
    return section(points)


def _run(ctx: ServingContext) -> dict:
    """The concurrency sweep at the load depth: the load section's own figures."""
    return load_sweep(ctx.engine, ctx.prompts(), depth=ctx.depth, **ctx.sweep_args(),
                      on_point=lambda sec: ctx.keep(f"the closed loop at {sec['points'][-1]['concurrency']} streams",
                                                    None, sec))


#: The closed loop at ``load.concurrency`` (always, when the load stage runs).
WORKLOAD = Workload("load", 10, _run)
