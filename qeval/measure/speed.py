"""Speed sweep: TTFT and decode tokens/s at each context depth, with peak memory.

Definitions (docs/design.md): TTFT (s) = prompt of depth d in, first new token out.
Decode tokens/s = (n - 1) / (t_last - t_first) over n new tokens after depth d.
Warm-up runs first (``warmup`` runs at the shallowest depth, as llama-bench warms up once
before its tests), then the median of ``repeats`` at each depth; thread count pinned by
the worker. Each depth's peak memory is taken over its repeats.

Each depth is one timed phase: an engine that serves through another process's KV pool
(``kv_pool_phase``, :meth:`qeval.engines.openai.OpenAIEngine.kv_pool_phase`) starts it on
an empty pool, checked by the server's own counters, and the depth's row keeps that record
(``kv_pool``).
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import QevalInputError
from .bandwidth import roofline_tokens_per_s
from .memory import PeakMemory


def depth_prompt_ids(tokenizer: Any, text_path: str | Path, depth: int) -> list[int]:
    """Exactly ``depth`` token ids from the fixed long text (tiled when the text is shorter).

    Raises:
        QevalInputError: text file missing or empty.
    """
    p = Path(text_path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise QevalInputError(f"cannot read depth text: {e}", file=p) from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise QevalInputError("depth text is empty", file=p)
    out: list[int] = []
    while len(out) < depth:
        out.extend(ids)
    return out[:depth]


def speed_sweep(engine: Any, prompts: dict[int, Sequence[int]], *, decode_tokens: int, repeats: int,
                warmup: int, peak: PeakMemory, prefill_repeats: int | None = None,
                warmup_tokens: int | None = None,
                progress: Callable[[str], None] = lambda s: None) -> tuple[dict, dict, dict, dict]:
    """Measure every depth in ``prompts`` (depth -> exactly ``depth`` token ids).

    The first ``prefill_repeats`` repeats of a depth (default: all) prefill the whole
    prompt and give TTFT and prefill tokens/s as well as decode tokens/s; the others, where
    the engine has ``decode_again`` (its KV cache cut back to ``depth - 1`` tokens, the
    last prompt token fed again, then the same greedy decode), give decode tokens/s only:
    the decode of a repeat reads the same cache either way, and a 4096-token prefill at one
    thread costs far more than the decode it precedes. An engine without ``decode_again``
    (or whose cache cannot be cut) prefills every repeat. ``decode_from_cache`` per depth
    counts the repeats that did not prefill. The ``warmup`` generations (untimed, at the
    shallowest depth) decode ``warmup_tokens`` (default ``decode_tokens``): enough to pay
    the first calls of prefill and decode; an int8 KV cache's timed decode spans its
    re-quantization period (129 tokens), its warm-up need not.

    Returns:
        ``(speed, peak_bytes, kv_bytes, extra)``: per depth (str) a dict with ``ttft_s``,
        ``prefill_tokens_per_s``, ``decode_tokens_per_s`` (medians) and the raw lists
        (:func:`add_roofline` adds the roofline bound and share), and for a served engine
        ``kv_pool`` (how its KV pool was emptied, the server's counters before and after); the peak memory (bytes)
        during that depth's runs; the KV cache bytes held for its tokens after it (from the
        cache object, when the engine's ``capabilities.kv_bytes``; else 0); and
        ``{"kv_allocated_bytes", "reserved_unallocated_bytes"}``: the KV bytes allocated
        for it (``engine.last_cache_allocated_bytes`` where the engine allocates a whole
        context, as llama.cpp does; else the bytes held) and, on CUDA, what torch's
        allocator reserved beyond the peak allocation (:meth:`PeakMemory.reserved_unallocated`).
    """
    speed: dict[str, dict] = {}
    peaks: dict[str, int | None] = {}
    kv: dict[str, int] = {}
    extra: dict[str, dict] = {}
    shallowest = min(prompts)
    for _ in range(warmup):  # once, at the shallowest depth: first-call costs, allocator, kernels
        progress(f"warm-up at depth {shallowest}")
        engine.generate(list(prompts[shallowest]), min(decode_tokens, warmup_tokens or decode_tokens),
                        ignore_stop=True)
    ready = getattr(engine, "prepare_decode", None)
    pool_phase = getattr(engine, "kv_pool_phase", None)  # a served engine: each depth on an empty KV pool
    for depth in sorted(prompts):
        ids = list(prompts[depth])
        if ready is not None:  # e.g. a static cache allocated and its decode step compiled: untimed
            ready(len(ids) + decode_tokens)
        with (pool_phase(f"speed at depth {depth}") if pool_phase is not None else nullcontext()) as pool:
            peak.reset()
            ttfts: list[float] = []
            decs: list[float] = []
            again = getattr(engine, "decode_again", None)
            full = repeats if prefill_repeats is None else max(1, min(prefill_repeats, repeats))
            from_cache = 0
            for r in range(repeats):
                g = None
                if r >= full and again is not None:
                    progress(f"depth {depth}: repeat {r + 1}/{repeats} (decode from the cache cut back to the depth)")
                    g = again(ids, decode_tokens)
                    from_cache += g is not None
                if g is None:
                    progress(f"depth {depth}: repeat {r + 1}/{repeats}")
                    g = engine.generate(ids, decode_tokens, ignore_stop=True)
                    ttfts.append(g.prefill_s)
                if g.decode_tokens_per_s:
                    decs.append(g.decode_tokens_per_s)
        peaks[str(depth)] = peak.read()
        kv[str(depth)] = int(engine.last_cache_bytes or 0) if engine.capabilities.kv_bytes else 0
        allocated = engine.last_cache_allocated_bytes if engine.capabilities.kv_bytes else None
        extra[str(depth)] = {"kv_allocated_bytes": int(allocated or kv[str(depth)]),
                             "reserved_unallocated_bytes": peak.reserved_unallocated()}
        ttft = statistics.median(ttfts)
        dec = statistics.median(decs) if decs else None
        speed[str(depth)] = {
            "ttft_s": ttft,
            "prefill_tokens_per_s": depth / ttft if ttft > 0 else None,
            "decode_tokens_per_s": dec,
            "ttft_s_all": ttfts,
            "decode_tokens_per_s_all": decs,
            "decode_from_cache": from_cache,
        }
        if pool is not None:
            speed[str(depth)]["kv_pool"] = pool
    return speed, peaks, kv, extra


def kv_bytes_per_token_from_sweep(kv: dict[str, int], decode_tokens: int) -> float | None:
    """KV bytes per token from the caches left by the sweep (depth -> bytes after
    ``depth + decode_tokens - 1`` tokens): the slope between the shallowest and deepest
    depth (a quantized cache's full-precision residual buffer is a constant and drops
    out), or bytes / tokens when only one depth was measured."""
    pts = sorted((int(d) + decode_tokens - 1, b) for d, b in kv.items() if b)
    if not pts:
        return None
    if len(pts) == 1:
        return pts[0][1] / pts[0][0]
    (t0, b0), (t1, b1) = pts[0], pts[-1]
    return (b1 - b0) / (t1 - t0)


def add_roofline(speed: dict, bandwidth: float | None, weight_bytes: int | None,
                 kv_bytes_per_token: float | None) -> None:
    """Add ``roofline_tokens_per_s`` and ``roofline_share`` (achieved / bound) per depth, in place."""
    for d, row in speed.items():
        bound = roofline_tokens_per_s(bandwidth, weight_bytes, kv_bytes_per_token, int(d))
        row["roofline_tokens_per_s"] = bound
        dec = row.get("decode_tokens_per_s")
        row["roofline_share"] = (dec / bound) if (bound and dec) else None
