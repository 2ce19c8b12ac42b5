"""The context depth x concurrency grid: the closed-loop sweep
(:func:`qeval.serving.closed_loop.load_sweep`) at each depth over the same concurrencies, every
cell admitted against the KV pool (the model's or the engine's context, and the KV budget) or
recorded as not admitted with the reason: where context length and concurrency trade against
each other in one KV pool.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..measure.load import PromptFor
from .closed_loop import load_sweep
from .workload import ServingContext, Workload


def grid_sweep(engine: Any, prompts_at: Callable[[int], PromptFor], *, depths: Sequence[int],
               measured: dict[int, dict] | None = None, pool_tokens: int | None = None, **sweep: Any) -> dict:
    """:func:`load_sweep` at each of ``depths``.

    Args:
        prompts_at: ``depth -> prompt_for`` (fresh prompts of that depth).
        measured: ``{depth: load_sweep output}`` already run (the main sweep's depth), reused.
        pool_tokens: KV cells of the engine's shared pool (None: not checked).
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


def _run(ctx: ServingContext) -> dict | None:
    """``load.depths``: the grid, the closed loop's own sweep reused as its row at the load depth."""
    if not ctx.load.depths:
        return None
    return grid_sweep(ctx.engine, ctx.prompts, depths=ctx.load.depths, measured={ctx.depth: dict(ctx.sections["load"])},
                      **ctx.sweep_args())


#: The depth x concurrency grid (``load.depths``).
WORKLOAD = Workload("grid", 20, _run)
