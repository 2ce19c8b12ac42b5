"""The load sweep of one tier: every concurrency of the recipe's ``load.concurrency``
served as a closed loop by the engine's batched path, with admission, peak memory and
the statistics of :mod:`qeval.measure.load`.

Engines that can batch declare their serve function (``capabilities.serve``): llama.cpp
(:func:`qeval.engines.llamacpp_load.serve_closed_loop`, continuous batching) and
transformers (:func:`qeval.engines.hf_load.serve_closed_loop`, continuous or static
batches). Any other engine has no load section.

Each admitted point is one timed phase: an engine that serves through another process's
KV pool (``kv_pool_phase``, :meth:`qeval.engines.openai.OpenAIEngine.kv_pool_phase`)
starts it on an empty pool, checked by the server's own counters; the record is kept in
the point's ``details["kv_pool"]``.
The open loop (:func:`rate_sweep`) uses the ``serve_open_loop`` function beside the
engine's closed-loop serve function (same module): requests arriving at each rate of
``load.arrivals`` through the bounded queue of ``load.queue`` (schedules from
:mod:`qeval.measure.arrivals`, statistics from :mod:`qeval.measure.openloop`).
"""
from __future__ import annotations

import importlib
import math
from contextlib import nullcontext
import inspect
from typing import Any, Callable, Iterable, Sequence

from .arrivals import iter_arrival_times
from .interference import interference_stats
from .load import NotAdmitted, PromptFor, Slo, admission, distinct_prompts, not_admitted_point, point_stats, summarize
from .openloop import knee, not_run_point, rate_point_stats, stop_reason, sweep_rates


def serve_function(engine: Any) -> Callable[..., Any] | None:
    """The closed-loop batched serve function ``engine`` declares (``capabilities.serve``,
    ``"module:function"``, imported on use), or None when the engine cannot batch."""
    target = engine.capabilities.serve
    if target is None:
        return None
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def open_loop_function(engine: Any) -> Callable[..., Any] | None:
    """``serve_open_loop`` of the module that holds the engine's closed-loop serve function,
    or None when the engine cannot batch or has no open loop."""
    target = engine.capabilities.serve
    if target is None:
        return None
    return getattr(importlib.import_module(target.partition(":")[0]), "serve_open_loop", None)


def _oom_types() -> tuple[type, ...]:
    try:
        import torch  # start-up time: torch loads only in stage processes
        return (MemoryError, torch.OutOfMemoryError)
    except (ImportError, AttributeError):
        return (MemoryError,)


def load_sweep(engine: Any, prompt_for: PromptFor, *, concurrency: Sequence[int], depth: int, output_tokens: int,
               requests_per_stream: int, prefill_chunk: int, slo: Slo | None, peak: Any = None,
               kv_bytes_per_token: float | None = None, kv_budget_bytes: float | None = None,
               max_context: int | None = None, shared_prefix: int = 0, reuse_prefix: bool = False,
               pool_tokens: int | None = None, progress: Callable[[str], None] = lambda s: None,
               on_point: Callable[[dict], None] | None = None) -> dict:
    """Measure every concurrency (ascending) on ``engine``.

    Args:
        prompt_for: ``(stream, k) -> depth`` prompt token ids, distinct per request.
        peak: a :class:`qeval.measure.memory.PeakMemory` reset before each point (None: no
            peak memory figures).
        kv_bytes_per_token: the tier's measured KV bytes per token (admission).
        kv_budget_bytes: bytes the KV cache may take (the memory budget less what the loaded
            engine holds); None: not checked.
        max_context: the model's context (tokens per sequence).
        shared_prefix: > 0: every prompt starts with the same ``shared_prefix`` tokens (a
            system prompt); the serve function gets ``shared_prefix`` and ``reuse_prefix``
            (True: serve the prefix from a reused KV cache; False: prefill it per request).
        pool_tokens: KV cells of the engine's shared pool (a server's context size); a
            point needing more is not admitted (None: not checked).
        on_point: called after each point with the section as it stands (the same dict
            this returns, over the points so far): the load stage writes it to the run
            folder, so a stage stopped later keeps what it measured.

    Returns:
        the tier's ``load`` section: ``depth``, ``output_tokens``, ``requests_per_stream``,
        ``prefill_chunk``, ``slo``, ``scheduling`` (the schedules that ran), ``points`` (one
        dict per concurrency, :func:`~qeval.measure.load.point_stats` plus ``peak_bytes``,
        or a not-admitted record), and :func:`~qeval.measure.load.summarize`'s figures.
        A point the engine or budget cannot hold is recorded as not admitted, never raised.

    Raises:
        ValueError: the engine cannot batch.
    """
    serve = serve_function(engine)
    if serve is None:
        raise ValueError(f"engine {getattr(engine, 'name', engine)!r} cannot batch")
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
        why = admission(concurrency=c, depth=depth, output_tokens=output_tokens,
                        kv_bytes_per_token=kv_bytes_per_token, max_context=max_context,
                        kv_budget_bytes=kv_budget_bytes, pool_tokens=pool_tokens)
        if why:
            progress(f"load: concurrency {c} not admitted: {why}")
            points.append(not_admitted_point(c, requests_per_stream, why))
            if on_point is not None:
                on_point(section(points))
            continue
        progress(f"load: concurrency {c} ({requests_per_stream} requests per stream, depth {depth}, "
                 f"{output_tokens} new tokens each)")
        pool_phase = getattr(engine, "kv_pool_phase", None)  # a served engine: each point on an empty KV pool
        with (pool_phase(f"load at concurrency {c}") if pool_phase is not None else nullcontext()) as pool:
            if peak is not None:
                peak.reset()
            extra = {"shared_prefix": int(shared_prefix), "reuse_prefix": bool(reuse_prefix)} if shared_prefix else {}
            try:
                run = serve(engine, prompt_for, concurrency=c, output_tokens=output_tokens,
                            requests_per_stream=requests_per_stream, prefill_chunk=prefill_chunk,
                            kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token,
                            max_context=max_context, **extra)
            except NotAdmitted as e:
                run, why = None, str(e)
            except _oom_types() as e:
                run, why = None, f"out of memory: {e.__class__.__name__}: {e}"[:300]
            if run is not None and pool is not None:
                run.details["kv_pool"] = pool  # its "after" counters are filled as the phase ends
        if run is None:
            progress(f"load: concurrency {c} not admitted: {why}")
            points.append(not_admitted_point(c, requests_per_stream, why))
            if on_point is not None:
                on_point(section(points))
            continue
        p = point_stats(run, slo)
        p["peak_bytes"] = peak.read() if peak is not None else None
        points.append(p)
        if on_point is not None:
            on_point(section(points))

    return section(points)


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
        serve: the open-loop function (default :func:`open_loop_function` of the engine).
        on_point: called after each point with the section as it stands (as :func:`load_sweep`).

    Returns:
        a dict of :class:`qeval.results_load.ArrivalsSection`'s fields.

    Raises:
        ValueError: the engine has no open loop, or neither rates nor sweep_points given.
    """
    serve = serve or open_loop_function(engine)
    if serve is None:
        raise ValueError(f"engine {getattr(engine, 'name', engine)!r} has no open loop")
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
        pool_phase = getattr(engine, "kv_pool_phase", None)  # a served engine: each point on an empty KV pool
        with (pool_phase(f"load at {kind} {rate or ''}".rstrip()) if pool_phase is not None
              else nullcontext()) as pool:
            try:
                r = serve(engine, prompt_for, arrivals=times, stream=stream, **common, **kw)
            except NotAdmitted as e:
                progress(f"load: {kind} {rate or ''} not admitted: {e}")
                return not_run_point(rate, kind, expected, str(e))
            except _oom_types() as e:
                progress(f"load: {kind} {rate or ''} ran out of memory")
                return not_run_point(rate, kind, expected, f"out of memory: {e.__class__.__name__}: {e}"[:300])
            if pool is not None:
                r.details["kv_pool"] = pool  # its "after" counters are filled as the phase ends
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
                   **({"max_in_flight": 1} if _served(serve) else {}))
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


def _served(serve: Callable[..., Any]) -> bool:
    """The open-loop function takes ``max_in_flight`` (the served client)."""
    return "max_in_flight" in inspect.signature(serve).parameters


def prefixed_prompts(base: Sequence[int], depth: int, prefix_tokens: int) -> PromptFor:
    """``prompt_for(stream, k)``: the same ``prefix_tokens`` tokens (cut from the middle of
    ``base``, tiled) followed by a distinct own part of ``depth - prefix_tokens`` tokens
    (:func:`qeval.measure.load.distinct_prompts`): a shared system prompt and fresh questions.

    Raises:
        ValueError: ``prefix_tokens`` not in ``1 .. depth - 1``, or an empty ``base``.
    """
    if not 0 < prefix_tokens < depth:
        raise ValueError(f"a shared prefix of {prefix_tokens} tokens needs 1 .. {depth - 1} (depth {depth})")
    ids = [int(t) for t in base]
    if not ids:
        raise ValueError("prefixed_prompts needs a non-empty base")
    tiled = ids * (prefix_tokens // len(ids) + 2)
    prefix = tiled[len(ids) // 2:len(ids) // 2 + prefix_tokens]
    own = distinct_prompts(ids, depth - prefix_tokens)

    def prompt_for(stream: int, k: int) -> list[int]:
        return prefix + list(own(stream, k))
    return prompt_for


def prefix_sweep(engine: Any, base: Sequence[int], *, depth: int, prefix_tokens: int, modes: Sequence[bool],
                 how: str | None = None, **sweep: Any) -> dict:
    """The closed loop with a shared prefix, once per mode of ``modes`` (True: the prefix's
    KV reused; False: prefilled per request), each a :func:`load_sweep` over the same
    concurrencies (``sweep``: its other arguments).

    Returns:
        a dict of :class:`qeval.results_load.PrefixSection`'s fields: per run its points,
        users at SLO, prompt tokens, those served from the cache and the hit rate (cached /
        prompt tokens, None where the engine did not count).
    """
    progress = sweep.get("progress") or (lambda s: None)
    runs = []
    for reuse in modes:
        progress(f"load: shared prefix of {prefix_tokens} tokens, {'reused' if reuse else 'prefilled per request'}")
        out = load_sweep(engine, prefixed_prompts(base, depth, prefix_tokens), depth=depth,
                         shared_prefix=prefix_tokens, reuse_prefix=reuse, **sweep)
        pts = [p for p in out["points"] if p.get("admitted")]
        n_prompt = sum(int(p.get("prompt_tokens") or 0) for p in pts)
        cached = [p.get("cached_prompt_tokens") for p in pts]
        n_cached = sum(int(c) for c in cached) if cached and all(c is not None for c in cached) else None
        runs.append({"reuse": bool(reuse), "how": (how if reuse else "prefilled per request"),
                     "users_at_slo": out.get("users_at_slo"), "prompt_tokens": n_prompt,
                     "cached_prompt_tokens": n_cached,
                     "hit_rate": n_cached / n_prompt if n_cached is not None and n_prompt else None,
                     "points": out["points"]})
    return {"shared_prefix_tokens": int(prefix_tokens), "depth": int(depth), "runs": runs}


def interference_function(engine: Any) -> Callable[..., Any] | None:
    """``serve_with_long_prompt`` of the module that holds the engine's closed-loop serve
    function (None: the engine has no interference loop)."""
    target = engine.capabilities.serve
    if target is None:
        return None
    return getattr(importlib.import_module(target.partition(":")[0]), "serve_with_long_prompt", None)


def interference_sweep(engine: Any, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                       chunk_sizes: Sequence[int], before_tokens: int = 4, after_tokens: int = 4,
                       progress: Callable[[str], None] = lambda s: None, kv_bytes_per_token: float | None = None,
                       kv_budget_bytes: float | None = None, max_context: int | None = None) -> dict:
    """One long prompt landing on ``len(stream_prompts)`` decoding streams, unchunked (the
    whole prompt in one engine step) and at each of ``chunk_sizes`` (tokens per step), with
    the stall figures of :func:`qeval.measure.interference.interference_stats` per run.

    Admission first, as every load point's (:func:`~qeval.measure.load.admission`): the
    streams' KV (prompt + ``before_tokens + after_tokens`` each) and the long prompt's must
    fit ``kv_budget_bytes``, and the long prompt the model's context; otherwise nothing runs.

    Returns:
        a dict of :class:`qeval.results_load.InterferenceSection`'s fields; ``not_measured``
        says why when the point is not admitted, the engine has no interference loop, or it
        refuses the prompt or fails (the runs before it are kept; the load stage goes on).
    """
    out: dict[str, Any] = {"prompt_tokens": len(long_prompt), "streams": len(stream_prompts),
                           "stream_depth": max((len(p) for p in stream_prompts), default=0), "rows": [],
                           "not_measured": None}
    tail = before_tokens + after_tokens
    tokens = sum(len(p) + tail for p in stream_prompts) + len(long_prompt) + after_tokens
    if max_context is not None and len(long_prompt) + after_tokens > max_context:
        out["not_measured"] = (f"not admitted: the {len(long_prompt)}-token prompt + {after_tokens} new tokens is "
                               f"beyond the model's context of {max_context}")
        return out
    if kv_bytes_per_token and kv_budget_bytes is not None and tokens * kv_bytes_per_token > kv_budget_bytes:
        out["not_measured"] = (f"not admitted: KV cache of {tokens} tokens ({len(stream_prompts)} streams and the long "
                               f"prompt) = {tokens * kv_bytes_per_token / 2**30:.2f} GiB exceeds the KV budget of "
                               f"{max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
        progress(f"load: interference {out['not_measured']}")
        return out
    fn = interference_function(engine)
    if fn is None:
        name = getattr(engine, "name", "engine")
        out["not_measured"] = (f"the {name} engine has no loop that runs a long prompt beside decoding streams "
                               "step by step" + (" (a server schedules its own steps; its chunk size is its batch "
                                                 "setting)" if name == "openai" else ""))
        return out
    for chunk in [None, *sorted(int(c) for c in chunk_sizes)]:
        progress(f"load: interference: {len(long_prompt)}-token prompt on {len(stream_prompts)} streams, "
                 f"{'unchunked' if chunk is None else f'{chunk} tokens per step'}")
        try:
            run = fn(engine, stream_prompts, long_prompt, chunk_size=chunk, before_tokens=before_tokens,
                     after_tokens=after_tokens)
        except (ValueError, RuntimeError, NotAdmitted, *_oom_types()) as e:  # the tier's other load figures stand
            out["not_measured"] = f"{'unchunked' if chunk is None else f'chunk {chunk}'}: {e.__class__.__name__}: {e}"[:300]
            break
        st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s).to_dict()
        for k in ("window_start_s", "window_end_s"):
            st.pop(k)
        out["rows"].append({"chunk_size": chunk, **st, "steps": int(run.steps), "long_steps": int(run.long_steps)})
    return out


def grid_sweep(engine: Any, prompts_at: Callable[[int], PromptFor], *, depths: Sequence[int],
               measured: dict[int, dict] | None = None, pool_tokens: int | None = None, **sweep: Any) -> dict:
    """The context x concurrency grid: :func:`load_sweep` at each of ``depths`` over the same
    concurrencies, every cell admitted against the KV pool (the model's or the engine's
    context, ``pool_tokens``, and the KV budget) or recorded as not admitted with the reason.

    Args:
        prompts_at: ``depth -> prompt_for`` (fresh prompts of that depth).
        measured: ``{depth: load_sweep output}`` already run (the main sweep's depth), reused.
        sweep: the other :func:`load_sweep` arguments (concurrency, output_tokens, ...).

    Returns:
        a dict of :class:`qeval.results_load.GridSection`'s fields.
    """
    rows = []
    for d in sorted(int(x) for x in depths):
        out = (measured or {}).get(d)
        if out is None:
            out = load_sweep(engine, prompts_at(d), depth=d, pool_tokens=pool_tokens, **sweep)
        pts = [dict(p, details={**(p.get("details") or {}), "depth": d}) for p in out["points"]]
        rows.append({"depth": d, "users_at_slo": out.get("users_at_slo"), "points": pts})
    return {"pool_tokens": pool_tokens, "depths": rows}
