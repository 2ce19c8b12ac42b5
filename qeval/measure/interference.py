"""Interference: what one long cold prefill does to the streams already decoding.

N streams decode; one long prompt (a pasted file, a RAG context) arrives. Unless the
engine chunks its prefill (a bounded number of prompt tokens per engine step, each step
shared with the running streams' decode: Sarathi-Serve, Agrawal et al. 2024,
arXiv:2403.02310; vLLM ``--max-num-batched-tokens``, llama.cpp ``n_batch``/``n_ubatch``),
the whole prompt runs in one step and every running stream's next token waits for it.
This module measures that stall from token timelines; the engines produce them
(:func:`qeval.engines.llamacpp_interference.serve_with_long_prompt`).

Definitions (times in seconds on one clock; percentiles with ``numpy.percentile``, linear
interpolation, as :mod:`qeval.measure.load`):

* **window**: from the long request's arrival to its first token, ``[arrival_s,
  first_token_s]``: the span its prefill occupies the engine (queueing for a place in
  the batch included).
* **long TTFT**: ``first_token_s - arrival_s``.
* **gaps in the window**: every inter-token gap of a running stream (two consecutive
  tokens ``a < b`` of one stream) that overlaps the window (``b > arrival_s`` and
  ``a < first_token_s``); the largest of them (**max gap**) and their p50/p99 (**ITL p99 in
  the window**). Streams that hold no gap overlapping the window do not count.
* **baseline decode tokens/s**: the running streams' tokens per second before the window,
  from ``baseline_start_s`` (default: the time every stream had its first token) to
  ``arrival_s``; **window decode tokens/s**: their tokens stamped in ``(arrival_s,
  first_token_s]`` / the window's length; **tokens/s lost** = baseline - window, and
  **tokens lost** = that x the window's length (tokens the streams would have decoded in
  the window at the baseline rate and did not).

Libraries checked: vLLM bench, GuideLLM, AIPerf and inference-perf report per-request ITL
over a whole run, not gaps within a window set by another request; the arithmetic is numpy's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass
class InterferenceStats:
    """Interference figures of one long prompt (module docstring; seconds, tokens/s).

    Attributes:
        window_start_s, window_end_s, window_s: the window (arrival -> first token).
        long_ttft_s: the long request's TTFT (= ``window_s``).
        streams: running streams with a gap in the window.
        n_gaps: gaps overlapping the window.
        max_gap_s: the largest of them (None when none).
        itl_p50_s, itl_p99_s: their percentiles.
        baseline_tokens_per_s: the streams' decode rate before the window (None when no
            token falls before it).
        window_tokens_per_s: their rate inside the window.
        lost_tokens_per_s: baseline - window (None without a baseline).
        lost_tokens: ``lost_tokens_per_s x window_s``.
    """
    window_start_s: float
    window_end_s: float
    window_s: float
    long_ttft_s: float
    streams: int
    n_gaps: int
    max_gap_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    baseline_tokens_per_s: float | None
    window_tokens_per_s: float
    lost_tokens_per_s: float | None
    lost_tokens: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def window_gaps(timelines: Sequence[Sequence[float]], start_s: float, end_s: float) -> list[list[float]]:
    """Per stream, its inter-token gaps (s) that overlap ``[start_s, end_s]``: a gap from
    token time ``a`` to the next ``b`` overlaps when ``b > start_s`` and ``a < end_s``."""
    out = []
    for t in timelines:
        out.append([b - a for a, b in zip(t, t[1:]) if b > start_s and a < end_s])
    return out


def interference_stats(timelines: Sequence[Sequence[float]], arrival_s: float, first_token_s: float, *,
                       baseline_start_s: float | None = None) -> InterferenceStats:
    """Interference of one long prompt on the running streams (module docstring).

    Args:
        timelines: per running stream, the times (s, ascending) its new tokens became known.
        arrival_s: when the long request arrived (s, same clock).
        first_token_s: when its first token became known.
        baseline_start_s: start of the baseline interval; default the time every stream had
            its first token.

    Returns:
        :class:`InterferenceStats`.

    Raises:
        ValueError: ``first_token_s`` before ``arrival_s``, a timeline not ascending, or a
            baseline start after the arrival.
    """
    if not first_token_s >= arrival_s:
        raise ValueError(f"the first token ({first_token_s}) cannot come before the arrival ({arrival_s})")
    for i, t in enumerate(timelines):
        if any(b < a for a, b in zip(t, t[1:])):
            raise ValueError(f"timeline {i} is not ascending")
    window = first_token_s - arrival_s
    gaps = window_gaps(timelines, arrival_s, first_token_s)
    flat = [g for gs in gaps for g in gs]
    arr = np.asarray(flat, dtype=np.float64)
    live = [t for t in timelines if len(t)]
    b0 = baseline_start_s if baseline_start_s is not None else (max(t[0] for t in live) if live else arrival_s)
    if b0 > arrival_s:
        raise ValueError(f"the baseline starts ({b0}) after the arrival ({arrival_s})")
    base_tokens = sum(1 for t in timelines for x in t if b0 < x <= arrival_s)
    base = base_tokens / (arrival_s - b0) if arrival_s > b0 and base_tokens else None
    in_window = sum(1 for t in timelines for x in t if arrival_s < x <= first_token_s)
    rate = in_window / window if window > 0 else 0.0
    lost = base - rate if base is not None else None
    return InterferenceStats(
        window_start_s=arrival_s, window_end_s=first_token_s, window_s=window, long_ttft_s=window,
        streams=sum(1 for g in gaps if g), n_gaps=len(flat),
        max_gap_s=float(arr.max()) if len(arr) else None,
        itl_p50_s=float(np.percentile(arr, 50)) if len(arr) else None,
        itl_p99_s=float(np.percentile(arr, 99)) if len(arr) else None,
        baseline_tokens_per_s=base, window_tokens_per_s=rate, lost_tokens_per_s=lost,
        lost_tokens=lost * window if lost is not None else None)
