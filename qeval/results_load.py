"""The run format's load section: ``tiers/<tier>.json`` ``load`` and ``stages/<tier>.load.json``
``load``, as typed models (part of the run-format module :mod:`qeval.results`, kept beside it
for size; :class:`qeval.results.RunLayout` still owns every path).

Two kinds of load live in one section:

* the **closed loop** (``points``, one :class:`LoadPoint` per concurrency): N streams, each
  sending its next request as soon as its last one ended (users at SLO, batching gain);
* the **open loop** (``arrivals``, :class:`ArrivalsSection`): requests arrive at a rate
  (Poisson or constant), wait in a bounded queue, are refused when it is full and dropped
  when they wait past ``timeout_s``; one :class:`RatePoint` per offered rate, the knee
  (:class:`Knee`) and where a sweep stopped.

Definitions of every figure: :mod:`qeval.measure.load` (closed loop) and
:mod:`qeval.measure.openloop` (open loop). Seconds, requests/s, tokens/s, bytes.

The models forbid unknown keys (a writer's typo fails in the tests); counts are whole
numbers >= 0, percentiles objects. A run folder written before the open loop existed reads
as it is (``arrivals`` None); a section that does not fit is one line naming the run file
and the field (:func:`qeval.results.parse_model`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: A whole count (requests, tokens, bytes, steps): >= 0, at most 2**40 ... 2**62.
Count = Annotated[int, Field(ge=0, le=1 << 62)]


class _LoadModel(BaseModel):
    # strict: "4" is not a count and true is not a number; unknown keys are errors
    model_config = ConfigDict(extra="forbid", strict=True)


class Percentiles(_LoadModel):
    """Percentiles of one latency over a point's requests (s; ``numpy.percentile``, linear
    interpolation as vLLM computes them); None when not computed or no value existed."""
    p50: float | None = Field(None, description="median, s")
    p95: float | None = Field(None, description="95th percentile, s")
    p99: float | None = Field(None, description="99th percentile, s (absent for e2e and queue wait)")


class LoadSlo(_LoadModel):
    """The recipe's ``load.slo`` the sweep was judged against."""
    ttft_p95_s: float | None = Field(None, description="TTFT 95th percentile limit, s")
    itl_p95_s: float | None = Field(None, description="inter-token latency 95th percentile limit, s")
    max_error_rate: float | None = Field(None, description="open loop: most share of requests refused, timed "
                                         "out or failed at a rate that meets the SLO (None in older runs)")


class LoadPoint(_LoadModel):
    """One closed-loop point: ``concurrency`` streams served at once (qeval.measure.load)."""
    concurrency: int = Field(gt=0, le=1 << 20, description="streams served at once")
    admitted: bool = Field(True, description="False: the point was not run (KV cache or context too large)")
    reason: str | None = Field(None, description="why it was not admitted")
    scheduling: str | None = Field(None, description="continuous | static | server: how the engine batched")
    requests: Count = Field(0, description="completed requests")
    requests_not_admitted: Count | None = Field(0, description="concurrency x requests_per_stream when not admitted")
    output_tokens: Count | None = Field(None, description="new tokens of all requests")
    duration_s: float | None = Field(None, description="first request sent -> last token known, s")
    decode_tokens_per_s: float | None = Field(None, description="aggregate new tokens / duration")
    requests_per_s: float | None = Field(None, description="completed requests / duration")
    ttft_s: Percentiles | None = Field(None, description="time to first token, s (p50, p95, p99)")
    itl_s: Percentiles | None = Field(None, description="inter-token latency over all gaps, s (p50, p95, p99)")
    e2e_s: Percentiles | None = Field(None, description="request sent -> last token, s (p50, p95)")
    tpot_mean_s: float | None = Field(None, description="mean time per output token after the first, s")
    decode_step_tokens_per_s: float | None = Field(None, description="tokens/s of steps that held no prompt tokens")
    goodput_tokens_per_s: float | None = Field(None, description="new tokens of requests within the SLO / duration")
    slo_attainment: float | None = Field(None, description="share of requests within the SLO")
    meets_slo: bool | None = Field(None, description="TTFT p95 and ITL p95 within the SLO, nothing refused")
    peak_bytes: Count | None = Field(None, description="peak memory during the point (bytes)")
    kv_bytes_peak: Count | None = Field(None, description="KV cache bytes in use at the fullest step")
    kv_pool_bytes: Count | None = Field(None, description="KV bytes the engine allocated for the point")
    steps: Count | None = Field(None, description="forward passes")
    details: dict[str, Any] = Field(default_factory=dict, description="engine extras (context size, batch size)")
    prompt_tokens: Count | None = Field(None, description="prompt tokens of all requests (None in older runs)")
    cached_prompt_tokens: Count | None = Field(None, description="prompt tokens served from a reused prefix's KV "
                                               "cache (None: not counted)")
    prefix_hit_rate: float | None = Field(None, description="cached_prompt_tokens / prompt_tokens")


class RatePoint(_LoadModel):
    """One open-loop point: requests arriving at ``rate_rps`` (qeval.measure.openloop)."""
    kind: Literal["rate", "synchronous", "throughput"] = Field(
        "rate", description="rate: arrivals at rate_rps; synchronous: one request at a time (a sweep's low "
        "end); throughput: every request at once (a sweep's high end)")
    rate_rps: float | None = Field(None, description="the rate asked, requests/s (None for synchronous/throughput)")
    offered_rps: float | None = Field(None, description="the schedule's realised arrival rate: "
                                      "(requests - 1) / (last arrival - first arrival), requests/s")
    achieved_rps: float | None = Field(None, description="completed requests / duration, requests/s")
    requests: Count = Field(0, description="requests that arrived")
    completed: Count = Field(0, description="requests that got all their tokens")
    refused: Count = Field(0, description="found the waiting queue full (in process) or got HTTP 429/503")
    timed_out: Count = Field(0, description="waited past load.queue.timeout_s for a place (or first token)")
    failed: Count = Field(0, description="any other error (e.g. another HTTP status)")
    failed_by_status: dict[str, int] = Field(default_factory=dict,
                                             description="served tiers: HTTP status -> requests")
    error_rate: float | None = Field(None, description="(refused + timed out + failed) / requests")
    duration_s: float | None = Field(None, description="first arrival -> last request ended, s")
    output_tokens: Count | None = Field(None, description="new tokens of the completed requests")
    decode_tokens_per_s: float | None = Field(None, description="output_tokens / duration")
    ttft_s: Percentiles | None = Field(None, description="arrival -> first token of completed requests, s "
                                       "(queue wait included)")
    itl_s: Percentiles | None = Field(None, description="inter-token latency over all gaps, s")
    e2e_s: Percentiles | None = Field(None, description="arrival -> last token, s")
    queue_wait_s: Percentiles | None = Field(None, description="arrival -> a place in the batch, s (p50, p95)")
    goodput_tokens_per_s: float | None = Field(None, description="new tokens of requests within the SLO / duration")
    goodput_rps: float | None = Field(None, description="requests within the SLO / duration")
    slo_attainment: float | None = Field(None, description="share of arrived requests completed within the SLO")
    meets_slo: bool | None = Field(None, description="TTFT p95 and ITL p95 within the SLO and the error rate "
                                   "at most slo.max_error_rate")
    saturated: bool | None = Field(None, description="achieved rate below offered by more than "
                                   "arrivals.saturation_share")
    peak_bytes: Count | None = Field(None, description="peak memory during the point (bytes)")
    kv_bytes_peak: Count | None = Field(None, description="KV cache bytes in use at the fullest step")
    kv_pool_bytes: Count | None = Field(None, description="KV bytes the engine allocated for the point")
    scheduling: str | None = Field(None, description="continuous | static | server")
    reason: str | None = Field(None, description="why the point was not run (not admitted), else None")
    details: dict[str, Any] = Field(default_factory=dict, description="engine extras")


class Knee(_LoadModel):
    """The highest measured rate meeting the SLO, with the measured rates that bracket it;
    never extrapolated past the last measured rate."""
    rate_rps: float | None = Field(None, description="the knee: highest measured offered rate meeting the SLO "
                                   "(None: no measured rate meets it)")
    below_rps: float | None = Field(None, description="the measured rate below the knee (None: the knee is the "
                                    "lowest)")
    above_rps: float | None = Field(None, description="the first measured rate above the knee, which misses the "
                                    "SLO (None: every measured rate met it; the knee may lie higher)")
    note: str = Field("", description="one line saying what the bracket means")


class ArrivalsSection(_LoadModel):
    """The open-loop sweep of one tier (the recipe's ``load.arrivals`` and ``load.queue``)."""
    mode: Literal["rates", "sweep"] = Field(description="rates: the recipe's list; sweep: synchronous, "
                                            "throughput and rates between (GuideLLM's sweep)")
    process: Literal["poisson", "constant"] = Field(description="inter-arrival times: exponential or fixed")
    seed: int = Field(description="numpy Generator seed of the arrival schedules")
    slots: int = Field(gt=0, description="requests served at once (the largest load.concurrency)")
    max_waiting: Count = Field(description="waiting queue length: a request finding it full is refused")
    timeout_s: float = Field(gt=0, description="a request waiting longer for a place is dropped, s")
    saturation_share: float = Field(description="a point is saturated when achieved < offered x (1 - this)")
    requests_per_point: Count | None = Field(None, description="requests per rate (or None with duration_s)")
    duration_s: float | None = Field(None, description="seconds of arrivals per rate (or None with requests)")
    points: list[RatePoint] = Field(default_factory=list, description="measured points, in the order run")
    knee: Knee | None = Field(None, description="the knee over the rate points")
    stopped: str | None = Field(None, description="why the sweep stopped before its last rate, one line")
    not_run_rps: list[float] = Field(default_factory=list, description="rates not run after the stop")

    @property
    def rate_points(self) -> list[RatePoint]:
        """The ``kind == "rate"`` points, ascending by offered rate."""
        return sorted((p for p in self.points if p.kind == "rate" and p.rate_rps),
                      key=lambda p: p.rate_rps or 0.0)


class PrefixRun(_LoadModel):
    """The closed loop served with a shared prefix, the prefix's KV reused (``reuse``) or
    prefilled per request: one point per concurrency."""
    reuse: bool = Field(description="True: the prefix's KV cache reused across requests")
    how: str | None = Field(None, description="how the engine reused it (sequence copy, cache copy, "
                            "cache_prompt, prefix caching) or served it fresh")
    users_at_slo: Count | None = Field(None, description="largest concurrency meeting the SLO")
    prompt_tokens: Count | None = Field(None, description="prompt tokens over every point's requests")
    cached_prompt_tokens: Count | None = Field(None, description="of them served from the cache (None: not counted)")
    hit_rate: float | None = Field(None, description="cached_prompt_tokens / prompt_tokens")
    points: list[LoadPoint] = Field(default_factory=list, description="one per concurrency, ascending")

    def point(self, concurrency: int) -> LoadPoint | None:
        """The point at ``concurrency`` streams, or None."""
        return next((p for p in self.points if p.concurrency == concurrency), None)


class PrefixSection(_LoadModel):
    """Shared-prefix workload (the recipe's ``load.shared_prefix_tokens``): every request is
    the same prefix + its own part (depth tokens in all)."""
    shared_prefix_tokens: Count = Field(description="tokens of the shared prefix")
    depth: Count = Field(description="prompt tokens per request, prefix included")
    runs: list[PrefixRun] = Field(default_factory=list, description="with and/or without reuse")
    not_measured: str | None = Field(None, description="why a mode the recipe asked for was not measured")

    def run(self, reuse: bool) -> PrefixRun | None:
        """The run with (``reuse`` True) or without reuse, or None."""
        return next((r for r in self.runs if r.reuse is reuse), None)


class InterferenceRow(_LoadModel):
    """One long prompt at one chunk size (qeval.measure.interference: the window is the long
    request's arrival -> its first token)."""
    chunk_size: Count | None = Field(description="prompt tokens of the long prompt per step; None: unchunked")
    window_s: float = Field(description="arrival -> first token of the long prompt, s")
    long_ttft_s: float = Field(description="the long request's TTFT, s")
    streams: Count = Field(description="running streams with a gap in the window")
    n_gaps: Count = Field(description="their inter-token gaps overlapping the window")
    max_gap_s: float | None = Field(None, description="largest inter-token gap in the window, s")
    itl_p50_s: float | None = Field(None, description="median gap in the window, s")
    itl_p99_s: float | None = Field(None, description="99th percentile gap in the window, s")
    baseline_tokens_per_s: float | None = Field(None, description="the streams' decode rate before the window")
    window_tokens_per_s: float | None = Field(None, description="their decode rate inside the window")
    lost_tokens_per_s: float | None = Field(None, description="baseline - window decode tokens/s")
    lost_tokens: float | None = Field(None, description="lost tokens/s x window, tokens")
    steps: Count | None = Field(None, description="engine steps of the timed loop")
    long_steps: Count | None = Field(None, description="steps that held tokens of the long prompt")


class InterferenceSection(_LoadModel):
    """N streams decoding, one long prompt arriving (the recipe's ``load.interference``)."""
    prompt_tokens: Count = Field(description="tokens of the long prompt")
    streams: Count = Field(description="streams decoding when it arrives")
    stream_depth: Count | None = Field(None, description="prompt tokens of each running stream")
    rows: list[InterferenceRow] = Field(default_factory=list, description="unchunked first, then by chunk size")
    not_measured: str | None = Field(None, description="why it was not measured on this tier, one line")


class BurstSection(_LoadModel):
    """``load.burst``: N requests landing at once on an idle engine (:mod:`qeval.serving.burst`)."""
    requests: Count = Field(description="requests in the burst (all arrive at 0 s)")
    slots: Count = Field(description="requests served at once")
    completed: Count = Field(0, description="requests that got all their tokens")
    refused: Count = Field(0, description="found the waiting queue full (load.queue.max_waiting) or HTTP 429/503")
    timed_out: Count = Field(0, description="waited past load.queue.timeout_s for a place (or a first token)")
    failed: Count = Field(0, description="any other error")
    ttft_s: Percentiles | None = Field(None, description="arrival -> first token of completed requests, s")
    ttft_max_s: float | None = Field(None, description="the last completed request's first token, s after the burst")
    drain_s: float | None = Field(None, description="the burst's arrival -> the last request ended, s")
    decode_tokens_per_s: float | None = Field(None, description="new tokens of the completed requests / drain_s")
    scheduling: str | None = Field(None, description="continuous | static | server")
    not_measured: str | None = Field(None, description="why it was not run (not admitted, no serving core)")


class GridDepth(_LoadModel):
    """The closed loop at one depth of the context x concurrency grid (``load.depths``)."""
    depth: Count = Field(description="prompt tokens per request")
    users_at_slo: Count | None = Field(None, description="largest concurrency meeting the SLO at this depth")
    points: list[LoadPoint] = Field(default_factory=list, description="one cell per concurrency: admitted and "
                                    "measured, or not admitted with the reason")


class GridSection(_LoadModel):
    """Context x concurrency in one KV pool: each cell admitted against the pool (the engine's
    context size, or the memory budget after the weights) or not, with the reason."""
    pool_tokens: Count | None = Field(None, description="KV cells of the engine's pool (a server's context "
                                      "size); None: the pool is sized per point")
    depths: list[GridDepth] = Field(default_factory=list, description="ascending depth")

    def cell(self, depth: int, concurrency: int) -> LoadPoint | None:
        """The cell at ``depth`` and ``concurrency``, or None."""
        d = next((g for g in self.depths if g.depth == depth), None)
        return d and next((p for p in d.points if p.concurrency == concurrency), None)


class LoadSection(_LoadModel):
    """A tier's ``load`` section: the closed-loop sweep's figures and points, the open-loop
    ``arrivals`` (None when the recipe has none), or ``error`` when the load stage failed
    (the tier's other results stand), with the points it finished before it stopped
    (``partial``, ``stopped``: written point by point, so a timeout, a signal or a memory
    error loses none)."""
    error: str | None = Field(None, description="the load stage failed: its one-line reason")
    partial: bool = Field(False, description="the stage stopped before its end: these are the points it finished")
    stopped: str | None = Field(None, description="why and where a partial section stopped ('load stopped at "
                                "arrivals 4 req/s after 60 s: load timed out after 60 s')")
    depth: Count | None = Field(None, description="prompt tokens per request")
    output_tokens: Count | None = Field(None, description="new tokens per request (end of sequence ignored)")
    requests_per_stream: Count | None = Field(None, description="closed loop: requests each stream sends in turn")
    prefill_chunk: Count | None = Field(None, description="prompt tokens per engine step (chunked prefill)")
    slo: LoadSlo | None = Field(None, description="the SLO the points were judged against")
    scheduling: list[str] = Field(default_factory=list, description="the schedules that ran")
    users_at_slo: Count | None = Field(None, description="largest concurrency meeting the SLO with nothing refused")
    batching_gain: dict[str, float | None] = Field(default_factory=dict,
                                                   description="concurrency -> decode tokens/s at N / at 1")
    max_decode_tokens_per_s: float | None = Field(None, description="best aggregate decode tokens/s of the sweep")
    max_decode_at_concurrency: Count | None = Field(None, description="where it was reached")
    requests_not_admitted: Count | None = Field(None, description="requests of points not admitted, in total")
    kv_bytes_per_token: float | None = Field(None, description="the tier's KV bytes per token (admission)")
    kv_budget_bytes: float | None = Field(None, description="bytes the KV cache may take")
    kv_budget_source: str | None = Field(None, description="where the budget came from")
    engine: str | None = Field(None, description="the engine that served")
    backend: str | None = Field(None, description="its backend")
    device: str | None = Field(None, description="cpu | cuda")
    threads: Count | None = Field(None, description="CPU threads")
    memory_kind: str | None = Field(None, description="how peak memory was read")
    held_bytes: Count | None = Field(None, description="bytes the loaded engine held before the sweep")
    points: list[LoadPoint] = Field(default_factory=list, description="closed-loop points, ascending concurrency")
    arrivals: ArrivalsSection | None = Field(None, description="the open-loop sweep (None without load.arrivals)")
    prefix: PrefixSection | None = Field(None, description="shared-prefix workload (None without "
                                         "load.shared_prefix_tokens)")
    interference: InterferenceSection | None = Field(None, description="a long prompt landing mid-decode (None "
                                                     "without load.interference)")
    grid: GridSection | None = Field(None, description="context x concurrency grid (None without load.depths)")
    burst: BurstSection | None = Field(None, description="N requests at once on an idle engine (None without "
                                       "load.burst)")

    def point(self, concurrency: int) -> LoadPoint | None:
        """The closed-loop point at ``concurrency`` streams, or None."""
        return next((p for p in self.points if p.concurrency == concurrency), None)
