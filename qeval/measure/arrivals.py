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
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

import numpy as np

Process = Literal["poisson", "constant"]


def iter_arrival_times(rate_rps: float, *, process: Process = "poisson", seed: int = 0,
                       requests: int | None = None, duration_s: float | None = None) -> Iterator[float]:
    """Arrival times (s since the point started, ascending, the first at 0) of an open-loop
    point, drawn as they are consumed: memory does not grow with ``rate x duration``.

    The gaps come from one ``numpy.random.default_rng(seed)`` in blocks of
    :data:`GAP_BLOCK` draws; numpy's generator gives the same sequence whether it is drawn
    in one call or in blocks, so the times are those of one long draw.

    Args:
        rate_rps: mean arrivals per second (> 0).
        process: ``poisson`` (exponential gaps, mean 1/rate) or ``constant`` (gaps of 1/rate).
        seed: seed of ``numpy.random.default_rng`` (poisson only).
        requests: how many arrivals; or
        duration_s: every arrival before this many seconds (exactly one of the two).

    Raises:
        ValueError: rate <= 0, an unknown process, not exactly one of requests and
            duration_s, requests < 1 or duration_s <= 0 (when the first time is asked for).
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
    return _arrivals(float(rate_rps), process, seed, requests, duration_s)


#: Gaps drawn at a time by :func:`iter_arrival_times` (32 KiB of float64).
GAP_BLOCK = 4096


def _arrivals(rate: float, process: str, seed: int, requests: int | None, duration_s: float | None) -> Iterator[float]:
    rng = np.random.default_rng(seed)
    t, n = 0.0, 0
    yield 0.0
    n = 1
    while requests is None or n < requests:
        k = GAP_BLOCK if requests is None else min(GAP_BLOCK, requests - n)
        gaps = np.full(k, 1.0 / rate) if process == "constant" else rng.exponential(1.0 / rate, size=k)
        for g in gaps:
            t += float(g)
            if duration_s is not None and t >= duration_s:
                return
            yield t
            n += 1


def arrival_times(rate_rps: float, *, process: Process = "poisson", seed: int = 0, requests: int | None = None,
                  duration_s: float | None = None) -> np.ndarray:
    """:func:`iter_arrival_times` as a float64 array, shape ``[n]`` (n >= 1): for the
    short schedules of tests and benchmarks; the load stage consumes the iterator.

    Raises:
        ValueError: as :func:`iter_arrival_times`.
    """
    return np.fromiter(iter_arrival_times(rate_rps, process=process, seed=seed, requests=requests,
                                          duration_s=duration_s), dtype=np.float64)


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


#: Arrivals a :class:`WaitingQueue` keeps a record of one by one (the rest are counted):
#: an open-loop point offered 1,000,000 req/s for a minute holds 10,000 records, not 60 million.
KEEP_RECORDS = 10_000


@dataclass
class Tally:
    """Counts of one open-loop point's arrivals, complete whatever was kept one by one:
    ``arrived``, ``refused``, ``timed_out``, the first and last arrival (s) and the last end
    of a request that never got a place (s; None when none)."""
    arrived: int = 0
    refused: int = 0
    timed_out: int = 0
    first_arrival_s: float | None = None
    last_arrival_s: float | None = None
    last_unserved_end_s: float | None = None

    def end(self, t: float) -> None:
        self.last_unserved_end_s = t if self.last_unserved_end_s is None else max(self.last_unserved_end_s, t)


class WaitingQueue:
    """The bounded waiting queue of one open-loop point (rules in the module docstring).

    Arrivals are pulled from ``arrivals`` (any iterable, e.g. :func:`iter_arrival_times`)
    as the clock reaches them, so the queue holds at most ``max_waiting + free`` requests
    and memory does not grow with the schedule's length: every arrival is counted in
    :attr:`tally`; :attr:`requests` keeps a record of the first ``keep`` arrivals and of
    every request that got a place (those the engine serves, bounded by what it can serve).

    Args:
        arrivals: arrival times (s), ascending.
        max_waiting: most requests waiting (>= 0; 0: a request finding no free slot is refused).
        timeout_s: longest wait for a place (> 0), s.
        keep: arrivals recorded one by one beyond the admitted ones (default :data:`KEEP_RECORDS`).

    Raises:
        ValueError: max_waiting < 0, timeout_s <= 0, or arrival times that go back.
    """

    def __init__(self, arrivals: Iterable[float], max_waiting: int, timeout_s: float, keep: int = KEEP_RECORDS):
        if max_waiting < 0 or not timeout_s > 0:
            raise ValueError("max_waiting must be >= 0 and timeout_s > 0")
        self.max_waiting, self.timeout_s, self.keep = int(max_waiting), float(timeout_s), int(keep)
        if isinstance(arrivals, (list, tuple, np.ndarray)):  # held already: checked now (an iterator: as drawn)
            if any(float(b) < float(a) for a, b in zip(arrivals, arrivals[1:])):
                raise ValueError("arrival times must be ascending")
        self._it = iter(arrivals)
        self._peek: float | None = None
        self._pull()
        self.tally = Tally()
        self.requests: list[Request] = []
        self._queue: list[Request] = []

    def _pull(self) -> None:
        last = self._peek
        try:
            self._peek = float(next(self._it))
        except StopIteration:
            self._peek = None
            return
        if last is not None and self._peek < last:
            raise ValueError("arrival times must be ascending")

    @property
    def waiting(self) -> int:
        """Requests in the queue now."""
        return len(self._queue)

    def next_arrival(self) -> float | None:
        """Arrival time of the next request not yet seen, or None when all have arrived."""
        return self._peek

    def done(self) -> bool:
        """Every request has arrived and none is waiting."""
        return self._peek is None and not self._queue

    def _record(self, r: Request) -> None:
        if r.index < self.keep:
            self.requests.append(r)

    def admit(self, now: float, free: int) -> list[Request]:
        """One step boundary at ``now`` with ``free`` slots: arrivals join or are refused,
        overdue waiters are dropped, and up to ``free`` requests leave the queue (returned,
        marked running with ``admitted_s = now``)."""
        tally = self.tally
        while self._peek is not None and self._peek <= now:
            r = Request(tally.arrived, self._peek)
            tally.arrived += 1
            tally.first_arrival_s = r.arrival_s if tally.first_arrival_s is None else tally.first_arrival_s
            tally.last_arrival_s = r.arrival_s
            self._pull()
            self._record(r)
            if len(self._queue) >= self.max_waiting + max(free, 0):
                r.outcome, r.ended_s = "refused", r.arrival_s
                tally.refused += 1
                tally.end(r.arrival_s)
            else:
                self._queue.append(r)
        keep = []
        for r in self._queue:
            if now - r.arrival_s > self.timeout_s:
                r.outcome, r.ended_s = "timed_out", r.arrival_s + self.timeout_s
                tally.timed_out += 1
                tally.end(r.ended_s)
            else:
                keep.append(r)
        self._queue = keep
        out, self._queue = self._queue[:max(free, 0)], self._queue[max(free, 0):]
        for r in out:
            r.outcome, r.admitted_s = "running", now
            if r.index >= self.keep:
                self.requests.append(r)  # every request that got a place is kept: the engine serves it
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
