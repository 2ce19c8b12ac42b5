"""Open-loop load: statistics of one rate point, saturation, where a sweep stops, and the
knee of a tier.

The open loop (:func:`qeval.serving.open_loop.open_loop`, on any engine's core) serves
requests that arrive on a schedule
(:func:`qeval.measure.arrivals.arrival_times`) through a bounded waiting queue
(:class:`qeval.measure.arrivals.WaitingQueue`) and returns an :class:`OpenLoopRun`.

Definitions (GuideLLM's benchmark report and vLLM ``bench serve``; percentiles with
``numpy.percentile``, linear interpolation):

* **offered rate** (requests/s): the schedule's realised arrival rate, (n - 1) / (last
  arrival - first arrival); ``rate_rps`` is the rate asked.
* **achieved rate** (requests/s): completed requests / duration, the duration running from
  the first arrival to the last request's end (its last token, refusal, drop or failure).
* **TTFT** (s): arrival -> first token: the queue wait is part of it (vLLM's TTFT starts
  when the request is sent). **ITL**, **e2e**: as :mod:`qeval.measure.load`, over the
  completed requests.
* **queue wait** (s): arrival -> a place in the batch (in-process engines; served tiers
  queue inside the server, where the client cannot see it: None).
* **refused**: found the queue full (in process), or HTTP 429/503 (served). **timed out**:
  waited more than ``timeout_s`` for a place (in process) or for its first token (served).
  **failed**: any other error. **error rate**: (refused + timed out + failed) / arrived.
* **goodput**: new tokens (and requests) of the completed requests within the request SLO
  (TTFT <= ``ttft_p95_s`` and TPOT <= ``itl_p95_s``: DistServe, vLLM ``--goodput``) / duration.
* **meets the SLO**: at least one completed request, TTFT p95 and ITL p95 within the SLO,
  and the error rate at most ``max_error_rate``.
* **saturated**: achieved < offered x (1 - ``saturation_share``): requests arrive faster
  than they end (GuideLLM's over-saturation stop). A sweep stops after the first point that
  is saturated or over the error limit, and says which.
* **knee**: the highest measured rate that meets the SLO, with the measured rates below and
  above it; never extrapolated past the last measured rate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .arrivals import Request, Tally
from .load import RequestRecord, Slo, meets_request_slo, percentiles

#: Outcomes a finished request can have (:class:`qeval.measure.arrivals.Request`).
OUTCOMES = ("completed", "refused", "timed_out", "failed")


@dataclass
class OpenLoopRun:
    """What an engine's open-loop loop returns.

    Attributes:
        requests: arrivals' fates (outcome, arrival, admission and end times, s): every
            arrival without ``tally``; with it, the ones recorded one by one (the first
            :data:`~qeval.measure.arrivals.KEEP_RECORDS` and every one that got a place).
        completed: a :class:`~qeval.measure.load.RequestRecord` per completed request
            (``stream`` is the request's index in the schedule; ``start_s`` its arrival).
        scheduling: continuous | static | server.
        kv_bytes_peak: KV bytes in use at the fullest step (None if unknown).
        kv_pool_bytes: KV bytes allocated for the point (None if it grows on demand).
        failed_by_status: served tiers: HTTP status (str) -> requests that got it.
        details: engine extras.
        tally: every arrival counted (:class:`~qeval.measure.arrivals.Tally`: arrived,
            refused, timed out, first and last arrival), where ``requests`` keeps only some;
            None: ``requests`` holds every arrival.
    """
    requests: list[Request]
    completed: list[RequestRecord]
    scheduling: str
    kv_bytes_peak: int | None = None
    kv_pool_bytes: int | None = None
    failed_by_status: dict[str, int] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    tally: Tally | None = None


def offered_rate(arrivals: Sequence[float], rate_rps: float | None = None, n: int | None = None) -> float | None:
    """(n - 1) / (last - first arrival) in requests/s; ``rate_rps`` when the schedule has
    one arrival or all arrive at once. ``n``: arrivals counted (default ``len(arrivals)``;
    a tally gives its first and last arrival and the count)."""
    ts = [float(t) for t in arrivals]
    n = len(ts) if n is None else int(n)
    span = ts[-1] - ts[0] if ts else 0.0
    return (n - 1) / span if n > 1 and span > 0 else (float(rate_rps) if rate_rps else None)


def rate_point_stats(run: OpenLoopRun, *, kind: str = "rate", rate_rps: float | None, slo: Slo | None,
                     max_error_rate: float | None, saturation_share: float) -> dict[str, Any]:
    """Statistics of one open-loop point (definitions in the module docstring).

    Returns:
        a dict of :class:`qeval.results_load.RatePoint`'s fields.

    Raises:
        ValueError: no request arrived, a request still waiting or running, or a completed
            request without tokens.
    """
    reqs, tally = run.requests, run.tally
    if not reqs and (tally is None or not tally.arrived):
        raise ValueError("an open-loop point needs at least one request")
    if any(r.outcome not in OUTCOMES for r in reqs):
        raise ValueError("every request must have ended (completed, refused, timed_out or failed)")
    recs = run.completed
    if any(not r.token_times_s for r in recs):
        raise ValueError("every completed request needs at least one new token")
    counts = {o: sum(1 for r in reqs if r.outcome == o) for o in OUTCOMES}
    ends = [float(r.ended_s) for r in reqs if r.ended_s is not None] + [float(x.token_times_s[-1]) for x in recs]
    if tally is None:
        n = len(reqs)
        first = float(min(r.arrival_s for r in reqs))
        arrivals = sorted(r.arrival_s for r in reqs)
    else:  # every request that got a place is in reqs; the others are counted only
        counts["refused"], counts["timed_out"] = tally.refused, tally.timed_out
        n = tally.arrived
        first = float(tally.first_arrival_s or 0.0)
        arrivals = [first, float(tally.last_arrival_s or first)] if n > 1 else [first]
        if tally.last_unserved_end_s is not None:
            ends.append(float(tally.last_unserved_end_s))
    dur = max(ends) - first if ends else 0.0
    offered = offered_rate(arrivals, rate_rps, n) if kind == "rate" else None
    achieved = counts["completed"] / dur if dur > 0 else None
    errors = counts["refused"] + counts["timed_out"] + counts["failed"]
    n_out = sum(len(r.token_ids) for r in recs)
    waits = [r.admitted_s - r.arrival_s for r in reqs if r.admitted_s is not None and r.outcome == "completed"]
    out: dict[str, Any] = {
        "kind": kind, "rate_rps": rate_rps, "offered_rps": offered, "achieved_rps": achieved,
        "requests": n, **counts, "failed_by_status": dict(run.failed_by_status),
        "error_rate": errors / n, "duration_s": dur, "output_tokens": n_out,
        "decode_tokens_per_s": n_out / dur if dur > 0 else None,
        "ttft_s": percentiles([r.ttft_s for r in recs], (50, 95, 99)),
        "itl_s": percentiles([g for r in recs for g in r.itl_s], (50, 95, 99)),
        "e2e_s": percentiles([r.e2e_s for r in recs], (50, 95, 99)),
        "queue_wait_s": percentiles(waits, (50, 95)) if run.scheduling != "server" else None,
        "kv_bytes_peak": run.kv_bytes_peak, "kv_pool_bytes": run.kv_pool_bytes,
        "scheduling": run.scheduling, "details": dict(run.details),
    }
    out["saturated"] = is_saturated(offered, achieved, saturation_share) if kind == "rate" else False
    if slo is not None:
        good = [r for r in recs if meets_request_slo(r, slo)]
        out["goodput_tokens_per_s"] = sum(len(r.token_ids) for r in good) / dur if dur > 0 else None
        out["goodput_rps"] = len(good) / dur if dur > 0 else None
        out["slo_attainment"] = len(good) / n
        out["meets_slo"] = rate_meets_slo(out, slo, max_error_rate)
    return out


def not_run_point(rate_rps: float | None, kind: str, requests: int, reason: str) -> dict[str, Any]:
    """A point the engine could not hold (not admitted): every request counted as failed,
    the reason kept, no figures."""
    return {"kind": kind, "rate_rps": rate_rps, "requests": int(requests), "failed": int(requests),
            "error_rate": 1.0, "meets_slo": False, "saturated": None, "reason": str(reason)}


def is_saturated(offered: float | None, achieved: float | None, share: float) -> bool:
    """achieved < offered x (1 - share) (both requests/s); False when either is unknown
    and offered is unknown; True when nothing completed at a positive offered rate."""
    if offered is None:
        return False
    if achieved is None:
        return bool(offered > 0)
    return bool(achieved < offered * (1.0 - share))


def rate_meets_slo(point: dict, slo: Slo, max_error_rate: float | None) -> bool:
    """Something completed, TTFT p95 <= ``slo.ttft_p95_s``, ITL p95 <= ``slo.itl_p95_s``
    (no ITL with single-token answers: TTFT only) and error rate <= ``max_error_rate``
    (None: no limit)."""
    if not point.get("completed"):
        return False
    if max_error_rate is not None and (point.get("error_rate") or 0.0) > max_error_rate:
        return False
    ttft = (point.get("ttft_s") or {}).get("p95")
    itl = (point.get("itl_s") or {}).get("p95")
    if ttft is None or ttft > slo.ttft_p95_s:
        return False
    return itl is None or itl <= slo.itl_p95_s


def stop_reason(point: dict, *, max_error_rate: float | None, saturation_share: float) -> str | None:
    """Why a sweep stops after ``point`` (one line), or None to go on: the point is
    saturated, or its error rate is above ``max_error_rate``."""
    rate = point.get("rate_rps")
    if point.get("reason"):
        return f"stopped at {rate:g} req/s: not admitted ({point['reason']})"
    if point.get("saturated"):
        off, ach = point.get("offered_rps") or 0.0, point.get("achieved_rps") or 0.0
        below = 100.0 * (1.0 - ach / off) if off else 100.0
        return (f"saturated at {rate:g} req/s: achieved {ach:.3g} req/s is {below:.0f}% below the offered "
                f"{off:.3g} req/s (limit {100 * saturation_share:.0f}%)")
    er = point.get("error_rate")
    if max_error_rate is not None and er is not None and er > max_error_rate:
        return (f"error rate {100 * er:.0f}% at {rate:g} req/s is above the limit of {100 * max_error_rate:.0f}% "
                f"({point.get('refused', 0)} refused, {point.get('timed_out', 0)} timed out, "
                f"{point.get('failed', 0)} failed)")
    return None


def sweep_rates(synchronous_rps: float, throughput_rps: float, points: int) -> list[float]:
    """``points`` rates evenly spaced strictly between the synchronous rate and the
    saturated throughput (GuideLLM's sweep: the ends are measured, the rates between are
    run open loop); equal ends give ``points`` copies collapsed to one.

    Raises:
        ValueError: points < 1 or a rate <= 0.
    """
    if points < 1 or not synchronous_rps > 0 or not throughput_rps > 0:
        raise ValueError("a sweep needs points >= 1 and positive end rates")
    lo, hi = sorted((float(synchronous_rps), float(throughput_rps)))
    rates = [lo + (hi - lo) * (i + 1) / (points + 1) for i in range(points)]
    return sorted({float(f"{r:.6g}") for r in rates})


def knee(points: Sequence[dict]) -> dict[str, Any]:
    """The knee over the ``kind == "rate"`` points (dicts with ``rate_rps`` and
    ``meets_slo``): the highest measured rate meeting the SLO, the measured rate below it
    and the first measured rate above it (which misses). Returns a dict of
    :class:`qeval.results_load.Knee`'s fields; never extrapolated."""
    pts = sorted((p for p in points if p.get("kind", "rate") == "rate" and p.get("rate_rps")),
                 key=lambda p: float(p["rate_rps"]))
    rates = [float(p["rate_rps"]) for p in pts]
    ok = [i for i, p in enumerate(pts) if p.get("meets_slo")]
    if not pts:
        return {"rate_rps": None, "below_rps": None, "above_rps": None, "note": "no rate measured"}
    if not ok:
        return {"rate_rps": None, "below_rps": None, "above_rps": rates[0],
                "note": f"no measured rate meets the SLO (the lowest, {rates[0]:g} req/s, misses it)"}
    i = ok[-1]
    below = rates[i - 1] if i > 0 else None
    above = rates[i + 1] if i + 1 < len(rates) else None
    if above is None:
        note = (f"every rate up to the last measured, {rates[i]:g} req/s, meets the SLO; the knee may lie "
                "higher (not extrapolated)") if len(ok) == len(rates) else \
               f"{rates[i]:g} req/s is the last measured rate and meets the SLO (not extrapolated)"
    else:
        note = f"meets the SLO at {rates[i]:g} req/s and misses it at {above:g} req/s"
    return {"rate_rps": rates[i], "below_rps": below, "above_rps": above, "note": note}


