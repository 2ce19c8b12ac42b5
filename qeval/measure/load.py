"""Serving under load: statistics of a closed-loop concurrency sweep, users at an SLO,
goodput and the batching gain.

An engine that can batch serves ``concurrency`` streams at once from one model and one
KV pool (:mod:`qeval.engines.llamacpp_load`, :mod:`qeval.engines.hf_core`). Each stream
runs a closed loop (GuideLLM's "concurrent" mode, vLLM ``bench serve
--max-concurrency``): it sends its next request, a fresh prompt of ``depth`` tokens
asking for ``output_tokens`` new tokens (end-of-sequence ignored, like ``--ignore-eos``),
as soon as its last one ended. The engine returns a :class:`LoadRun`: one
:class:`RequestRecord` per request with the time each new token became known on the host.

Definitions (the conventions of vLLM ``benchmarks/benchmark_serving.py`` / ``vllm bench
serve`` and GuideLLM's benchmark report; percentiles with ``numpy.percentile``, linear
interpolation, as vLLM computes them):

* **TTFT** (s): request sent -> its first new token known. Waiting for a place in the
  batch (chunked prefill behind other prompts) is part of it.
* **ITL** (s): every gap between two consecutive new tokens of one request; the
  percentiles run over all gaps of all requests (vLLM "ITL").
* **TPOT** (s): per request (e2e - TTFT) / (n - 1) (vLLM "TPOT"); the mean is reported.
* **e2e latency** (s): request sent -> its last token known.
* **aggregate decode tokens/s**: all new tokens / the run's duration (vLLM "Output token
  throughput"; the duration runs from the first request sent to the last token known).
* **requests/s**: completed requests / duration (vLLM "Request throughput").
* **goodput** (tokens/s): new tokens of the requests that met the SLO / duration; a
  request meets it when its TTFT <= ``ttft_p95_s`` and its TPOT <= ``itl_p95_s`` (the
  per-request attainment of DistServe, arXiv:2401.09670, and vLLM ``--goodput ttft:..
  tpot:..``; vLLM counts requests/s, qeval counts their tokens/s).
* **users at SLO**: the largest measured concurrency whose TTFT p95 <= ``ttft_p95_s`` and
  ITL p95 <= ``itl_p95_s`` with no request refused (0 when none qualifies).
* **batching gain** at N: aggregate decode tokens/s at N / at concurrency 1.
* **decode-step tokens/s**: tokens of the steps that held no prompt tokens / the time
  of those steps: the pure batched-decode rate, comparable to llama.cpp
  ``llama-batched-bench``'s S_TG.

A point whose KV cache (``concurrency`` x (depth + output_tokens) tokens) cannot fit the
model's context or the memory budget is **not admitted**: it is recorded with the reason
and ``requests_not_admitted = concurrency x requests_per_stream`` and never run, so it
never crashes the tier (:func:`admission`, :class:`NotAdmitted`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, Callable, Sequence

import numpy as np

SCHEDULING = ("continuous", "static")


class NotAdmitted(Exception):
    """An engine cannot hold a load point (no KV slot, context too large, allocation
    refused). ``str(e)`` is the reason recorded in the result."""


@dataclass
class RequestRecord:
    """One request of a closed-loop run.

    Attributes:
        stream: the stream (0 .. concurrency - 1) that sent it.
        prompt_tokens: prompt length (tokens).
        start_s: when it was sent, seconds since the run started.
        token_times_s: for each new token, seconds since the run started when it was known.
        token_ids: the new token ids (greedy).
    """
    stream: int
    prompt_tokens: int
    start_s: float
    token_times_s: list[float]
    token_ids: list[int]

    @property
    def ttft_s(self) -> float:
        """First token time - send time (s)."""
        return self.token_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        """Last token time - send time (s)."""
        return self.token_times_s[-1] - self.start_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive new tokens (s), ``len(token_times_s) - 1`` of them."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (n - 1) (s); None for a single-token request."""
        n = len(self.token_times_s)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass
class LoadRun:
    """What an engine's closed loop returns.

    Attributes:
        concurrency: streams served at once.
        scheduling: "continuous" (a stream's next request joins the running batch at once,
            its prefill sharing steps with the others' decode) or "static" (a batch of
            ``concurrency`` requests starts together and ends together).
        requests: every completed request.
        duration_s: first request sent -> last token known (s).
        kv_bytes_peak: KV cache bytes in use at the fullest step (tokens held x bytes per
            token, or bytes held by the cache object), None if unknown.
        kv_pool_bytes: KV bytes the engine allocated for the point (llama.cpp allocates its
            whole context), None if it grows on demand.
        decode_step_tokens: new tokens produced by steps that held no prompt tokens.
        decode_step_s: seconds spent in those steps.
        steps: forward passes (``llama_decode`` calls / ``model.forward`` calls).
        details: engine extras (context size, batch size, ...).
        cached_prompt_tokens: prompt tokens served from a reused prefix's KV cache (not
            prefilled again), over all requests; None when the engine did not say (a fresh
            prompt workload, or a server that does not report it).
    """
    concurrency: int
    scheduling: str
    requests: list[RequestRecord]
    duration_s: float
    kv_bytes_peak: int | None = None
    kv_pool_bytes: int | None = None
    decode_step_tokens: int = 0
    decode_step_s: float = 0.0
    steps: int = 0
    details: dict = field(default_factory=dict)
    cached_prompt_tokens: int | None = None


@dataclass
class Slo:
    """Service-level objective: TTFT p95 and ITL p95 limits (s); both > 0."""
    ttft_p95_s: float
    itl_p95_s: float


def percentiles(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    """``{"p50": ..}`` for each q in ``qs`` via ``numpy.percentile`` (linear interpolation,
    vLLM's convention); None for every q when ``values`` is empty."""
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def meets_request_slo(r: RequestRecord, slo: Slo) -> bool:
    """TTFT <= ``slo.ttft_p95_s`` and TPOT <= ``slo.itl_p95_s`` (DistServe/vLLM goodput)."""
    tpot = r.tpot_s
    return r.ttft_s <= slo.ttft_p95_s and (tpot is None or tpot <= slo.itl_p95_s)


def point_stats(run: LoadRun, slo: Slo | None = None) -> dict:
    """Statistics of one admitted load point (definitions in the module docstring).

    Returns:
        a JSON-ready dict: ``concurrency``, ``admitted`` (True), ``scheduling``,
        ``requests``, ``requests_not_admitted`` (0), ``output_tokens``, ``duration_s``,
        ``decode_tokens_per_s``, ``requests_per_s``, ``ttft_s`` / ``itl_s`` (p50, p95, p99),
        ``e2e_s`` (p50, p95), ``tpot_mean_s``, ``decode_step_tokens_per_s``,
        ``kv_bytes_peak``, ``kv_pool_bytes``, ``steps``, ``prompt_tokens`` (all requests'),
        ``cached_prompt_tokens`` and ``prefix_hit_rate`` (cached / prompt tokens; None when
        the engine did not count), and with an SLO ``meets_slo``,
        ``goodput_tokens_per_s`` and ``slo_attainment`` (share of requests meeting it).

    Raises:
        ValueError: the run holds no request or a request without tokens.
    """
    reqs = run.requests
    if not reqs:
        raise ValueError("a load point needs at least one completed request")
    if any(not r.token_times_s for r in reqs):
        raise ValueError("every request needs at least one new token")
    dur = float(run.duration_s)
    n_out = sum(len(r.token_ids) for r in reqs)
    itls = [g for r in reqs for g in r.itl_s]
    tpots = [r.tpot_s for r in reqs if r.tpot_s is not None]
    out: dict[str, Any] = {
        "concurrency": run.concurrency, "admitted": True, "reason": None, "scheduling": run.scheduling,
        "requests": len(reqs), "requests_not_admitted": 0, "output_tokens": n_out, "duration_s": dur,
        "decode_tokens_per_s": n_out / dur if dur > 0 else None,
        "requests_per_s": len(reqs) / dur if dur > 0 else None,
        "ttft_s": percentiles([r.ttft_s for r in reqs], (50, 95, 99)),
        "itl_s": percentiles(itls, (50, 95, 99)),
        "e2e_s": percentiles([r.e2e_s for r in reqs], (50, 95)),
        "tpot_mean_s": float(np.mean(tpots)) if tpots else None,
        "decode_step_tokens_per_s": (run.decode_step_tokens / run.decode_step_s
                                     if run.decode_step_s > 0 and run.decode_step_tokens else None),
        "kv_bytes_peak": run.kv_bytes_peak, "kv_pool_bytes": run.kv_pool_bytes,
        "steps": run.steps, "details": dict(run.details),
        "prompt_tokens": sum(int(r.prompt_tokens) for r in reqs),
        "cached_prompt_tokens": None if run.cached_prompt_tokens is None else int(run.cached_prompt_tokens),
    }
    n_prompt = out["prompt_tokens"]
    out["prefix_hit_rate"] = (out["cached_prompt_tokens"] / n_prompt
                              if out["cached_prompt_tokens"] is not None and n_prompt else None)
    if slo is not None:
        good = [r for r in reqs if meets_request_slo(r, slo)]
        out["goodput_tokens_per_s"] = sum(len(r.token_ids) for r in good) / dur if dur > 0 else None
        out["slo_attainment"] = len(good) / len(reqs)
        out["meets_slo"] = point_meets_slo(out, slo)
    return out


def not_admitted_point(concurrency: int, requests_per_stream: int, reason: str) -> dict:
    """The record of a point that was not run: ``admitted`` False, the ``reason``, and
    ``requests_not_admitted`` = concurrency x requests_per_stream; no figures."""
    return {"concurrency": int(concurrency), "admitted": False, "reason": str(reason), "scheduling": None,
            "requests": 0, "requests_not_admitted": int(concurrency) * int(requests_per_stream),
            "meets_slo": False}


def point_meets_slo(point: dict, slo: Slo) -> bool:
    """Admitted, nothing refused, TTFT p95 <= ``slo.ttft_p95_s`` and ITL p95 <= ``slo.itl_p95_s``
    (a point with a single token per request has no ITL: only TTFT counts)."""
    if not point.get("admitted") or point.get("requests_not_admitted"):
        return False
    ttft = (point.get("ttft_s") or {}).get("p95")
    itl = (point.get("itl_s") or {}).get("p95")
    if ttft is None or ttft > slo.ttft_p95_s:
        return False
    return itl is None or itl <= slo.itl_p95_s


def users_at_slo(points: Sequence[dict], slo: Slo) -> int:
    """The largest measured concurrency meeting the SLO (:func:`point_meets_slo`); 0 when
    no point does."""
    ok = [int(p["concurrency"]) for p in points if point_meets_slo(p, slo)]
    return max(ok) if ok else 0


def batching_gain(points: Sequence[dict]) -> dict[str, float | None]:
    """Concurrency (str) -> aggregate decode tokens/s at N / at 1; empty without an admitted
    concurrency-1 point."""
    base = next((p.get("decode_tokens_per_s") for p in points
                 if p.get("admitted") and int(p["concurrency"]) == 1), None)
    if not base:
        return {}
    return {str(p["concurrency"]): (p["decode_tokens_per_s"] / base if p.get("decode_tokens_per_s") else None)
            for p in points if p.get("admitted")}


def admission(*, concurrency: int, depth: int, output_tokens: int, kv_bytes_per_token: float | None,
              max_context: int | None, kv_budget_bytes: float | None,
              pool_tokens: int | None = None) -> str | None:
    """Why a point cannot be admitted, or None when it fits.

    Args:
        concurrency: streams at once.
        depth, output_tokens: tokens per request (the KV cache holds depth + output_tokens
            per stream at its fullest).
        kv_bytes_per_token: the tier's measured KV bytes per token (None: not checked).
        max_context: the model's context (tokens per sequence); None: not checked.
        kv_budget_bytes: bytes the KV pool may take (memory budget - weights - overhead);
            None: not checked.
        pool_tokens: KV cells the engine's pool holds for all sequences together (a
            server's context size, e.g. llama-server ``--ctx-size`` with ``--kv-unified``);
            None: not checked.
    """
    per_seq = int(depth) + int(output_tokens)
    if pool_tokens is not None and concurrency * per_seq > pool_tokens:
        return (f"{concurrency} x (depth {depth} + output_tokens {output_tokens}) = {concurrency * per_seq} tokens "
                f"is beyond the engine's KV pool of {pool_tokens} tokens (its context size)")
    if max_context is not None and per_seq > max_context:
        return (f"depth {depth} + output_tokens {output_tokens} = {per_seq} tokens per sequence is beyond "
                f"the model's context of {max_context}")
    if kv_bytes_per_token and kv_budget_bytes is not None:
        need = concurrency * per_seq * kv_bytes_per_token
        if need > kv_budget_bytes:
            fit = int(max(kv_budget_bytes, 0) // (per_seq * kv_bytes_per_token))
            return (f"KV cache of {concurrency} x {per_seq} tokens = {need / 2**30:.2f} GiB exceeds the KV budget "
                    f"of {max(kv_budget_bytes, 0) / 2**30:.2f} GiB ({fit} streams fit)")
    return None


def summarize(points: Sequence[dict], slo: Slo | None) -> dict:
    """The derived figures of a sweep: ``users_at_slo`` (None without an SLO),
    ``batching_gain`` per concurrency, ``max_decode_tokens_per_s`` and the concurrency
    where it was reached, ``requests_not_admitted`` in total."""
    adm = [p for p in points if p.get("admitted") and p.get("decode_tokens_per_s")]
    best = max(adm, key=lambda p: p["decode_tokens_per_s"], default=None)
    return {"users_at_slo": users_at_slo(points, slo) if slo is not None else None,
            "batching_gain": batching_gain(points),
            "max_decode_tokens_per_s": best["decode_tokens_per_s"] if best else None,
            "max_decode_at_concurrency": int(best["concurrency"]) if best else None,
            "requests_not_admitted": sum(int(p.get("requests_not_admitted") or 0) for p in points)}


PromptFor = Callable[[int, int], Sequence[int]]


class LazyPrompts:
    """``prompts[(stream, k)]``: a closed-loop point's prompts, each made when a request
    starts (token ids from ``prompt_for``), never a table of concurrency x requests entries
    (4096 streams x 1,000,000 requests would be 4e9 of them); checked as made: not empty,
    at most ``max_len`` tokens (the first prompt's length, which sized the KV cache), starting
    with ``prefix`` where one is shared, and by ``check`` (an engine's own id check).

    Raises (on access):
        ValueError: a prompt that fails those checks.
    """

    def __init__(self, prompt_for: PromptFor, max_len: int, prefix: Sequence[int] | None = None,
                 check: Callable[[list[int]], None] | None = None):
        self.prompt_for, self.max_len, self.check = prompt_for, int(max_len), check
        self.prefix = [int(t) for t in prefix] if prefix else None

    def __getitem__(self, key: tuple[int, int]) -> list[int]:
        p = [int(t) for t in self.prompt_for(*key)]
        if not p or len(p) > self.max_len:
            raise ValueError(f"prompt {key} has {len(p)} tokens; a point's prompts have from 1 to {self.max_len} "
                             "(its first prompt's length, which sized the KV cache)")
        if self.prefix is not None and (p[:len(self.prefix)] != self.prefix or len(p) <= len(self.prefix)):
            raise ValueError(f"every prompt must start with the same {len(self.prefix)} tokens and have its own part")
        if self.check is not None:
            self.check(p)
        return p


def admitted_prompt(prompt_for: PromptFor, stream: int, index: int, max_len: int) -> list[int]:
    """The prompt of a request that got a place in an open-loop point, made now (token ids),
    checked as :class:`LazyPrompts` checks a closed loop's: 1 to ``max_len`` tokens (the
    point's first prompt, which sized its KV cache).

    Raises:
        ValueError: an empty prompt, or one longer than ``max_len``.
    """
    return LazyPrompts(prompt_for, max_len)[(stream, index)]


def distinct_prompts(base: Sequence[int], depth: int, stride: int = 97) -> PromptFor:
    """``prompt_for(stream, k)``: ``depth`` token ids cut from ``base`` (tiled) at an offset
    that differs for every (stream, k), so no two requests of a run share a prompt.

    Raises:
        ValueError: ``base`` is empty or ``depth`` < 1.
    """
    ids = [int(t) for t in base]
    if not ids or depth < 1:
        raise ValueError("distinct_prompts needs a non-empty base and depth >= 1")
    n = len(ids)
    reps = math.ceil((depth + n) / n) + 1
    tiled = (ids * reps)

    def prompt_for(stream: int, k: int) -> list[int]:
        off = ((stream * 1009 + k) * stride) % n
        return tiled[off:off + depth]
    return prompt_for
