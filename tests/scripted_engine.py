"""A scripted engine for the serving layer's tests: no model, an exact timeline.

:class:`ScriptedEngine` implements the engine core (:class:`qeval.serving.core.EngineCore`)
and nothing else: every workload of :mod:`qeval.serving` runs on it unchanged, which is the
point (a new engine gets every workload by implementing the core). Its core batches
continuously, like llama.cpp's: each step decodes one token for every request past its prefill
and feeds up to ``prefill_chunk`` prompt tokens of the waiting ones, oldest first; with a
:class:`qeval.measure.arrivals.StepClock` each step takes a set time, so every TTFT, gap and
queue outcome is known in advance. A request's tokens depend on its prompt alone (the next
token is ``(sum(prompt) + 7 * i) % 1000`` for its i-th new token), so batched answers can be
compared with answers alone. ``scheduling="static"`` takes new requests only between batches.
"""
from __future__ import annotations

from typing import Any, Sequence

from qeval.serving.core import CoreSpec, CoreStats, TokenEvent


def expected_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """The tokens the scripted engine answers ``prompt`` with (``n`` of them)."""
    s = sum(int(t) for t in prompt)
    return [(s + 7 * i) % 1000 for i in range(n)]


class ScriptedCore:
    """The scripted core (module docstring). ``log`` lists every step's (decoding requests,
    prompt tokens fed)."""

    controls_steps = True

    def __init__(self, spec: CoreSpec, clock: Any, scheduling: str = "continuous") -> None:
        self.spec, self.clock, self.scheduling = spec, clock, scheduling
        self.slots = spec.slots
        self.kv_pool_tokens = spec.slots * spec.max_seq_tokens
        self.live: dict[int, dict] = {}
        self.prefix: list[int] = []
        self.order = 0
        self.log: list[tuple[int, int]] = []
        self._stats = CoreStats(details={"engine": "scripted"})
        self.closed = False

    def free(self) -> int:
        if self.scheduling == "static" and self.live:
            return 0
        return self.slots - len(self.live)

    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        if len(self.live) >= self.slots:
            raise ValueError("no free slot")
        if not prompt:
            raise ValueError("empty prompt")
        full = (self.prefix if prefix else []) + [int(t) for t in prompt]
        self.live[rid] = {"prompt": full, "fed": len(self.prefix) if prefix else 0, "toks": [],
                          "max": int(max_new_tokens), "order": self.order, "chunk": prefill_chunk,
                          "cached": len(self.prefix) if prefix else 0}
        self.order += 1

    def release(self, rid: int) -> None:
        self.live.pop(rid, None)

    def cache_prefix(self, ids: Sequence[int]) -> None:
        self.prefix = [int(t) for t in ids]

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        running = [(rid, r) for rid, r in self.live.items() if len(r["toks"]) < r["max"]]
        if not running:
            return []
        out = [rid for rid, r in running if r["fed"] == len(r["prompt"])]
        budget = self.spec.prefill_chunk or 10**9
        fed = 0
        for rid, r in sorted(((rid, r) for rid, r in running if r["fed"] < len(r["prompt"])),
                             key=lambda x: x[1]["order"]):
            take = min(budget, len(r["prompt"]) - r["fed"], r["chunk"] or budget)
            r["fed"] += take
            budget -= take
            fed += take
            if r["fed"] == len(r["prompt"]):
                out.append(rid)
        t = self.clock.step()
        self._stats.steps += 1
        self.log.append((len(out), fed))
        events = []
        for rid in out:
            r = self.live[rid]
            tok = expected_tokens(r["prompt"], len(r["toks"]) + 1)[-1]
            r["toks"].append(tok)
            done = len(r["toks"]) >= r["max"]
            events.append(TokenEvent(rid, [tok], [t], done=done, cached_tokens=r["cached"] if done else None))
        return events

    def stats(self) -> CoreStats:
        return self._stats

    def __enter__(self) -> "ScriptedCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed = True


class ScriptedEngine:
    """An engine that is only a core (:class:`ScriptedCore`); ``cores`` keeps each one opened."""

    name = "scripted"

    def __init__(self, scheduling: str = "continuous") -> None:
        self.scheduling = scheduling
        self.cores: list[ScriptedCore] = []

    def open_core(self, spec: CoreSpec, clock: Any) -> ScriptedCore:
        core = ScriptedCore(spec, clock, self.scheduling)
        self.cores.append(core)
        return core

    def prefix_how(self) -> str:
        return "scripted prefix"
