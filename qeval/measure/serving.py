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
"""
from __future__ import annotations

import importlib
from contextlib import nullcontext
from typing import Any, Callable, Sequence

from .load import NotAdmitted, PromptFor, Slo, admission, not_admitted_point, point_stats, summarize


def serve_function(engine: Any) -> Callable[..., Any] | None:
    """The closed-loop batched serve function ``engine`` declares (``capabilities.serve``,
    ``"module:function"``, imported on use), or None when the engine cannot batch."""
    target = engine.capabilities.serve
    if target is None:
        return None
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _oom_types() -> tuple[type, ...]:
    try:
        import torch  # start-up time: torch loads only in stage processes
        return (MemoryError, torch.OutOfMemoryError)
    except (ImportError, AttributeError):
        return (MemoryError,)


def load_sweep(engine: Any, prompt_for: PromptFor, *, concurrency: Sequence[int], depth: int, output_tokens: int,
               requests_per_stream: int, prefill_chunk: int, slo: Slo | None, peak: Any = None,
               kv_bytes_per_token: float | None = None, kv_budget_bytes: float | None = None,
               max_context: int | None = None, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Measure every concurrency (ascending) on ``engine``.

    Args:
        prompt_for: ``(stream, k) -> depth`` prompt token ids, distinct per request.
        peak: a :class:`qeval.measure.memory.PeakMemory` reset before each point (None: no
            peak memory figures).
        kv_bytes_per_token: the tier's measured KV bytes per token (admission).
        kv_budget_bytes: bytes the KV cache may take (the memory budget less what the loaded
            engine holds); None: not checked.
        max_context: the model's context (tokens per sequence).

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
    for c in sorted(set(int(x) for x in concurrency)):
        why = admission(concurrency=c, depth=depth, output_tokens=output_tokens,
                        kv_bytes_per_token=kv_bytes_per_token, max_context=max_context,
                        kv_budget_bytes=kv_budget_bytes)
        if why:
            progress(f"load: concurrency {c} not admitted: {why}")
            points.append(not_admitted_point(c, requests_per_stream, why))
            continue
        progress(f"load: concurrency {c} ({requests_per_stream} requests per stream, depth {depth}, "
                 f"{output_tokens} new tokens each)")
        pool_phase = getattr(engine, "kv_pool_phase", None)  # a served engine: each point on an empty KV pool
        with (pool_phase(f"load at concurrency {c}") if pool_phase is not None else nullcontext()) as pool:
            if peak is not None:
                peak.reset()
            try:
                run = serve(engine, prompt_for, concurrency=c, output_tokens=output_tokens,
                            requests_per_stream=requests_per_stream, prefill_chunk=prefill_chunk,
                            kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token,
                            max_context=max_context)
            except NotAdmitted as e:
                run, why = None, str(e)
            except _oom_types() as e:
                run, why = None, f"out of memory: {e.__class__.__name__}: {e}"[:300]
            if run is not None and pool is not None:
                run.details["kv_pool"] = pool  # its "after" counters are filled as the phase ends
        if run is None:
            progress(f"load: concurrency {c} not admitted: {why}")
            points.append(not_admitted_point(c, requests_per_stream, why))
            continue
        p = point_stats(run, slo)
        p["peak_bytes"] = peak.read() if peak is not None else None
        points.append(p)
    out = {"depth": int(depth), "output_tokens": int(output_tokens), "requests_per_stream": int(requests_per_stream),
           "prefill_chunk": int(prefill_chunk),
           "slo": {"ttft_p95_s": slo.ttft_p95_s, "itl_p95_s": slo.itl_p95_s} if slo else None,
           "scheduling": sorted({p["scheduling"] for p in points if p.get("scheduling")}),
           "kv_bytes_per_token": kv_bytes_per_token, "kv_budget_bytes": kv_budget_bytes,
           "points": points}
    out.update(summarize(points, slo))
    return out
