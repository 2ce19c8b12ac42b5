"""The burst workload: N requests landing at once on an idle engine (``load.burst``), the
moment a service restarts and its clients reconnect, or a batch job lands.

One open-loop point (:func:`qeval.serving.open_loop.open_loop`) whose arrivals are all at 0 s,
served ``max(load.concurrency)`` at a time through the recipe's queue (``load.queue``: its
``max_waiting`` refuses, its ``timeout_s`` drops), on any engine core. Reported: TTFT
percentiles over the completed requests and the last first token (how long the unluckiest
caller waited), the time to drain the burst, and what was refused or dropped. Percentiles:
``numpy.percentile`` through :func:`qeval.measure.load.percentiles` (linear interpolation, as
vLLM). GuideLLM's ``throughput`` profile sends all requests at once too; it reports no drain
time or last first token, so they are computed here.
"""
from __future__ import annotations

from typing import Any

from ..measure.load import NotAdmitted, percentiles
from .closed_loop import oom_types
from .core import can_serve
from .open_loop import open_loop
from .workload import ServingContext, Workload


def burst(engine: Any, prompt_for: Any, *, requests: int, slots: int, max_waiting: int, timeout_s: float,
          output_tokens: int, prefill_chunk: int = 256, kv_bytes_per_token: float | None = None,
          kv_budget_bytes: float | None = None, max_context: int | None = None, clock: Any = None,
          stream: int = 4000) -> dict:
    """``requests`` requests at 0 s on ``engine``'s core (module docstring).

    Args:
        prompt_for: ``(stream, i) -> prompt token ids`` of the i-th request.
        requests: the burst's size (>= 1); slots, max_waiting, timeout_s: as
            :func:`~qeval.serving.open_loop.open_loop`.
        clock: a :class:`~qeval.measure.arrivals.StepClock` in tests (default the wall clock).
        stream: the ``stream`` argument of ``prompt_for`` (fresh prompts, apart from other workloads').

    Returns:
        a dict of :class:`qeval.results_load.BurstSection`'s fields; ``not_measured`` says why
        when the point is not admitted or the engine has no core.
    """
    out: dict = {"requests": int(requests), "slots": int(slots), "not_measured": None}
    if not can_serve(engine):
        out["not_measured"] = f"the {getattr(engine, 'name', 'engine')} engine has no serving core"
        return out
    try:
        run = open_loop(engine, prompt_for, arrivals=[0.0] * int(requests), slots=slots, max_waiting=max_waiting,
                        timeout_s=timeout_s, output_tokens=output_tokens, prefill_chunk=prefill_chunk,
                        kv_bytes_per_token=kv_bytes_per_token, kv_budget_bytes=kv_budget_bytes,
                        max_context=max_context, clock=clock, stream=stream, label=f"burst of {requests}")
    except (NotAdmitted, *oom_types()) as e:
        out["not_measured"] = f"not admitted: {e}"[:300]
        return out
    done = run.completed
    counts = {k: sum(r.outcome == k for r in run.requests) for k in ("refused", "timed_out", "failed")}
    ends = [r.ended_s for r in run.requests if r.ended_s is not None]
    drain = max(ends) if ends else None
    n_out = sum(len(r.token_ids) for r in done)
    ttfts = [r.ttft_s for r in done]
    out.update(completed=len(done), **counts, scheduling=run.scheduling,
               ttft_s=percentiles(ttfts, (50, 95, 99)) if ttfts else None,
               ttft_max_s=max(ttfts) if ttfts else None, drain_s=drain,
               decode_tokens_per_s=n_out / drain if drain else None)
    return out


def _run(ctx: ServingContext) -> dict | None:
    """``load.burst``: its requests, ``max(load.concurrency)`` slots, ``load.queue``."""
    ld = ctx.load
    if getattr(ld, "burst", None) is None:
        return None
    ctx.progress(f"load: a burst of {ld.burst.requests} requests at once ({max(ld.concurrency)} slots)")
    return burst(ctx.engine, ctx.prompts(), requests=ld.burst.requests, slots=max(ld.concurrency),
                 max_waiting=ld.queue.max_waiting, timeout_s=ld.queue.timeout_s, output_tokens=ld.output_tokens,
                 prefill_chunk=ld.prefill_chunk, kv_bytes_per_token=ctx.kv_bytes_per_token,
                 kv_budget_bytes=ctx.kv_budget_bytes, max_context=ctx.max_context)


#: The burst workload (``load.burst``): after the closed-loop workloads, before the open loop.
WORKLOAD = Workload("burst", 45, _run)
