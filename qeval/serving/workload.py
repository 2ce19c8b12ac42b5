"""The workload registry and the one place the load stage runs them.

A workload is one module of this package that defines ``WORKLOAD``, a :class:`Workload`: its
name (the key of its section in the tier's ``load`` result), its order, and ``run(ctx)``,
which reads its own field of the recipe's load section (``ctx.load``, the typed
:class:`qeval.recipe.LoadSpec`, read by attribute) and returns its section, or None when the
recipe does not ask for it. :func:`run_workloads` finds them the way every registry of qeval
does (:func:`qeval.plugins.registered`: modules of this package defining ``WORKLOAD``, then
entry points of the ``qeval.workloads`` group) and runs them in order on one engine. Adding
a workload is one module here, its recipe field, its result type and its test; no engine and
no stage module changes.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..measure.load import PromptFor, Slo, distinct_prompts
from ..plugins import registered


@dataclass
class ServingContext:
    """What every workload of one tier's load stage shares.

    Attributes:
        engine: the loaded engine (its core: :mod:`qeval.serving.core`).
        load: the recipe's load section (:class:`qeval.recipe.LoadSpec`).
        base_ids: token ids of the recipe's depth text; every prompt is cut from them.
        depth: the load depth (prompt tokens per request).
        kv_bytes_per_token: the tier's measured KV bytes per token (None: unknown); for an
            engine with sliding-window layers (``engine.sliding_window``) and its model cache,
            raised at construction to the bytes per token of a sequence at the load depth
            plus its output tokens (``engine.kv_bytes_at_depth(c) / c``: ``full x c +
            sliding x min(c, window)``), since a slope measured past the window counts the
            full layers only (issue 64); the figure given is kept in ``kv_bytes_per_token_measured``.
        kv_budget_bytes: bytes the KV cache may take (memory budget less what the loaded engine
            holds); None: not checked.
        max_context: the model's context (tokens per sequence).
        pool_tokens: KV cells of the engine's shared pool (a server's context size), None when
            it has none.
        peak: a :class:`qeval.measure.memory.PeakMemory` (reset and read per point) or None.
        progress: a one-line logger.
        keep: ``keep(at, key, section)``: journal a section as it stands (``key`` None: merge
            into the top of the load result); a stage stopped later keeps what it measured.
        checkpoint: ``checkpoint(name)``: called before each workload runs (the stage's named
            fault points).
        sections: what the workloads before this one returned, by name.
    """
    engine: Any
    load: Any
    base_ids: list[int]
    depth: int
    kv_bytes_per_token: float | None = None
    kv_budget_bytes: float | None = None
    max_context: int | None = None
    pool_tokens: int | None = None
    peak: Any = None
    progress: Callable[[str], None] = lambda s: None
    keep: Callable[[str, str | None, dict], None] = lambda at, key, section: None
    checkpoint: Callable[[str], None] = lambda name: None
    sections: dict = field(default_factory=dict)
    kv_bytes_per_token_measured: float | None = None

    def __post_init__(self) -> None:
        """Admission at the load depth for sliding-window layers (attribute notes)."""
        self.kv_bytes_per_token_measured = self.kv_bytes_per_token
        at = getattr(self.engine, "kv_bytes_at_depth", None)
        if (self.kv_bytes_per_token and callable(at) and getattr(self.engine, "sliding_window", None)
                and getattr(self.engine, "kv_cache", None) == "model"):
            tokens = int(self.depth) + int(getattr(self.load, "output_tokens", 0) or 0)
            if tokens > 0:
                self.kv_bytes_per_token = max(float(self.kv_bytes_per_token), at(tokens) / tokens)

    @property
    def slo(self) -> Slo:
        """The load section's SLO (TTFT p95 and ITL p95, s)."""
        return Slo(self.load.slo.ttft_p95_s, self.load.slo.itl_p95_s)

    def prompts(self, depth: int | None = None) -> PromptFor:
        """Fresh prompts of ``depth`` tokens (default the load depth), distinct per request."""
        return distinct_prompts(self.base_ids, int(depth or self.depth))

    def sweep_args(self) -> dict:
        """The closed-loop sweep's arguments every workload built on it shares
        (:func:`qeval.serving.closed_loop.load_sweep`)."""
        ld = self.load
        return dict(concurrency=ld.concurrency, output_tokens=ld.output_tokens,
                    requests_per_stream=ld.requests_per_stream, prefill_chunk=ld.prefill_chunk, slo=self.slo,
                    peak=self.peak, kv_bytes_per_token=self.kv_bytes_per_token, kv_budget_bytes=self.kv_budget_bytes,
                    max_context=self.max_context, pool_tokens=self.pool_tokens, progress=self.progress)


@dataclass(frozen=True)
class Workload:
    """One registered workload.

    Attributes:
        name: its section's key in the load result (``None``-keyed workloads merge into the
            top: the closed loop, whose figures are the load section itself).
        order: when it runs among the others (ascending).
        run: ``run(ctx) -> section dict | None`` (None: the recipe does not ask for it).
    """
    name: str
    order: int
    run: Callable[[ServingContext], dict | None]


def workloads() -> list[Workload]:
    """Every registered workload, in order (this package's modules defining ``WORKLOAD``, then
    the ``qeval.workloads`` entry points).

    Raises:
        RuntimeError: two workloads with one name."""
    found = [w for _, w in registered(__package__, sys.modules[__package__].__path__, "WORKLOAD")]
    names = [w.name for w in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"workload names registered twice: {sorted(n for n in names if names.count(n) > 1)}")
    return sorted(found, key=lambda w: (w.order, w.name))


def run_workloads(ctx: ServingContext) -> dict:
    """Run every registered workload on ``ctx.engine`` in order; the closed loop (``load``)
    gives the section's top level, every other workload its own key.

    Returns:
        the tier's load result (a dict of :class:`qeval.results_load.LoadSection`'s fields
        without the stage's own: slo, engine, memory)."""
    out: dict = {}
    for w in workloads():
        ctx.checkpoint(w.name)
        section = w.run(ctx)
        if section is None:
            continue
        ctx.sections[w.name] = section
        if w.name == "load":
            out.update(section)
        else:
            out[w.name] = section
            ctx.keep(f"the {w.name} workload", w.name, section)
    return out
