"""Open-loop arrivals: the schedule of request arrival times, the bounded waiting queue
that admits them, and the clocks an engine's loop runs on. One module serves every engine
(llama.cpp and transformers in process, the served client): the schedule is drawn here,
apart from the engines and apart from the statistics (:mod:`qeval.measure.openloop`), as
GuideLLM keeps its ``scheduler/`` apart from its backends and its outputs.

Schedule (:func:`arrival_times`): ``poisson`` draws inter-arrival gaps from an exponential
distribution of mean 1/rate (a Poisson process, vLLM ``bench serve --request-rate`` with
burstiness 1, GuideLLM ``poisson``); ``constant`` spaces them exactly 1/rate apart
(GuideLLM ``constant``). The first request arrives at 0. Gaps come from
``numpy.random.default_rng(seed)`` (PCG64): the same seed, rate and length give the same
schedule on every machine.

Admission (:class:`WaitingQueue`), as a server with a queue length limit and a wait
timeout does it (llama-server decides new tasks once per ``update_slots`` loop; qeval's
in-process loops decide at every step boundary): at a boundary at time ``now`` with
``free`` slots,

1. every request that arrived by ``now`` joins the queue in arrival order unless the queue
   already holds ``max_waiting + free`` requests (the free slots take from its head at
   once): then it is **refused**, at its arrival time;
2. every queued request that has waited longer than ``timeout_s`` (``now - arrival >
   timeout_s``) is **dropped** (timed out);
3. the free slots take requests from the head of the queue (first come, first served).

Neither a refusal nor a drop is an error of the tier: they are counted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

Process = Literal["poisson", "constant"]


def arrival_times(rate_rps: float, *, process: Process = "poisson", seed: int = 0, requests: int | None = None,
                  duration_s: float | None = None) -> np.ndarray:
    """Arrival times (s since the point started, ascending, the first at 0) of an open-loop
    point.

    Args:
        rate_rps: mean arrivals per second (> 0).
        process: ``poisson`` (exponential gaps, mean 1/rate) or ``constant`` (gaps of 1/rate).
        seed: seed of ``numpy.random.default_rng`` (poisson only).
        requests: how many arrivals; or
        duration_s: every arrival before this many seconds (exactly one of the two).

    Returns:
        float64 array, shape ``[n]`` (n >= 1).

    Raises:
        ValueError: rate <= 0, an unknown process, not exactly one of requests and
            duration_s, requests < 1 or duration_s <= 0.
    """
    if not rate_rps or not np.isfinite(rate_rps) or rate_rps <= 0:
        raise ValueError(f"rate {rate_rps!r} must be a positive number of requests/s")
    if process not in ("poisson", "constant"):
        raise ValueError(f"process {process!r}: expected poisson or constant")
    if (requests is None) == (duration_s is None):
        raise ValueError("give exactly one of requests and duration_s")
    if requests is not None and requests < 1:
        raise ValueError("requests must be >= 1")
    if duration_s is not None and not duration_s > 0:
        raise ValueError("duration_s must be > 0")
    rng = np.random.default_rng(seed)
    n = requests if requests is not None else max(1, int(np.ceil(duration_s * rate_rps * 1.5)) + 16)
    while True:
        if process == "constant":
            gaps = np.full(n - 1, 1.0 / rate_rps)
        else:
            gaps = rng.exponential(1.0 / rate_rps, size=n - 1)
        t = np.concatenate([[0.0], np.cumsum(gaps)])
        if requests is not None:
            return t
        if t[-1] >= duration_s:
            return t[t < duration_s]
        n *= 2  # too few drawn for the duration (rare): draw again, longer, from a fresh generator
        rng = np.random.default_rng(seed)


@dataclass
class Request:
    """One arrival's fate in the queue.

    Attributes:
        index: its place in the schedule (0 ..).
        arrival_s: when it arrived (s since the point started).
        outcome: ``waiting`` | ``running`` | ``completed`` | ``refused`` | ``timed_out`` | ``failed``.
        admitted_s: when it left the queue for a place in the batch (None until then).
        ended_s: when it was refused, dropped, failed or got its last token.
    """
    index: int
    arrival_s: float
    outcome: str = "waiting"
    admitted_s: float | None = None
    ended_s: float | None = None


@dataclass
class WaitingQueue:
    """The bounded waiting queue of one open-loop point (rules in the module docstring).

    Args:
        arrivals: arrival times (s), ascending.
        max_waiting: most requests waiting (>= 0; 0: a request finding no free slot is refused).
        timeout_s: longest wait for a place (> 0), s.
    """
    arrivals: Sequence[float]
    max_waiting: int
    timeout_s: float
    requests: list[Request] = field(init=False)
    _next: int = field(init=False, default=0)
    _queue: list[Request] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_waiting < 0 or not self.timeout_s > 0:
            raise ValueError("max_waiting must be >= 0 and timeout_s > 0")
        ts = [float(t) for t in self.arrivals]
        if any(b < a for a, b in zip(ts, ts[1:])):
            raise ValueError("arrival times must be ascending")
        self.requests = [Request(i, t) for i, t in enumerate(ts)]

    @property
    def waiting(self) -> int:
        """Requests in the queue now."""
        return len(self._queue)

    def next_arrival(self) -> float | None:
        """Arrival time of the next request not yet seen, or None when all have arrived."""
        return self.requests[self._next].arrival_s if self._next < len(self.requests) else None

    def done(self) -> bool:
        """Every request has arrived and none is waiting."""
        return self._next >= len(self.requests) and not self._queue

    def admit(self, now: float, free: int) -> list[Request]:
        """One step boundary at ``now`` with ``free`` slots: arrivals join or are refused,
        overdue waiters are dropped, and up to ``free`` requests leave the queue (returned,
        marked running with ``admitted_s = now``)."""
        while self._next < len(self.requests) and self.requests[self._next].arrival_s <= now:
            r = self.requests[self._next]
            self._next += 1
            if len(self._queue) >= self.max_waiting + max(free, 0):
                r.outcome, r.ended_s = "refused", r.arrival_s
            else:
                self._queue.append(r)
        keep = []
        for r in self._queue:
            if now - r.arrival_s > self.timeout_s:
                r.outcome, r.ended_s = "timed_out", r.arrival_s + self.timeout_s
            else:
                keep.append(r)
        self._queue = keep
        out, self._queue = self._queue[:max(free, 0)], self._queue[max(free, 0):]
        for r in out:
            r.outcome, r.admitted_s = "running", now
        return out


class WallClock:
    """Seconds since :meth:`start` on ``time.perf_counter`` (the engines' real clock)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def start(self) -> None:
        """Set time 0 to now."""
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since time 0."""
        return time.perf_counter() - self.t0

    def step(self) -> float:
        """Called after each engine step: the time it ended."""
        return self.now()

    def idle_until(self, t: float) -> float:
        """Nothing to do before ``t``: sleep until then; returns the time after."""
        d = t - self.now()
        if d > 0:
            time.sleep(d)
        return self.now()


class StepClock:
    """A scripted clock for tests: every engine step takes ``step_s`` seconds and idling
    jumps to the next arrival, so a loop's timeline (and its refusals and drops) is exact
    whatever the machine's speed."""

    def __init__(self, step_s: float) -> None:
        self.step_s = float(step_s)
        self.t = 0.0

    def start(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def step(self) -> float:
        self.t += self.step_s
        return self.t

    def idle_until(self, t: float) -> float:
        self.t = max(self.t, float(t))
        return self.t
