"""The shared-prefix workload: every prompt starts with the same system prompt, served once
with its KV cache reused (the core caches it, :meth:`~qeval.serving.core.EngineCore.cache_prefix`)
and once prefilled per request, each a closed-loop sweep over the same concurrencies
(:func:`qeval.serving.closed_loop.load_sweep`).

How a core reuses the prefix is its own (llama.cpp: one sequence copied into each request's,
``llama_memory_seq_cp``; transformers: a prefilled cache deep-copied per batch; a server: its
prompt cache), named by the core's ``prefix_how`` and recorded beside the figures.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..measure.load import PromptFor, distinct_prompts
from .closed_loop import load_sweep
from .workload import ServingContext, Workload


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


def prefix_how(engine: Any) -> str:
    """How ``engine``'s core reuses a shared prefix, one line (its ``prefix_how``; a generic
    line where it does not say)."""
    how = getattr(engine, "prefix_how", None)
    return str(how() if callable(how) else how or "the engine's prefix cache")


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
    how = how or prefix_how(engine)
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


def _run(ctx: ServingContext) -> dict | None:
    """``load.shared_prefix_tokens`` with ``load.prefix_cache`` (on, off or both)."""
    ld = ctx.load
    if not ld.shared_prefix_tokens:
        return None
    modes = {"on": [True], "off": [False], "both": [False, True]}[ld.prefix_cache]
    return prefix_sweep(ctx.engine, ctx.base_ids, depth=ctx.depth, prefix_tokens=ld.shared_prefix_tokens, modes=modes,
                        **ctx.sweep_args())


#: The shared-prefix workload (``load.shared_prefix_tokens``).
WORKLOAD = Workload("prefix", 30, _run)
