"""The engine core: the one serving surface an engine implements for every workload.

A workload opens a core with :func:`open_core` (the engine's ``open_core(spec, clock)``),
then drives it with four calls, whatever engine is behind it:

* :meth:`EngineCore.submit` a request: prompt token ids, new tokens wanted, whether it starts
  from the cached shared prefix, its own prefill chunk, a first-token timeout (served);
* :meth:`EngineCore.step`: in process (``controls_steps``), one engine step (one
  ``llama_decode`` of the running sequences, one forward per transformers batch), and the
  :class:`TokenEvent` list it produced, stamped with the workload's clock at the step's end;
  served or scheduled by a background thread, the events that arrived (waiting up to a
  timeout for the first), stamped when they arrived;
* :meth:`EngineCore.release` a request (its KV cells freed; a running served request is
  aborted);
* :meth:`EngineCore.cache_prefix`: a shared prefix prefilled once, before the clock starts.

It declares ``slots`` (sequences it serves at once), ``kv_pool_tokens`` (cells of its KV
pool, None when it grows on demand), ``controls_steps`` and ``scheduling`` (``continuous``:
a request joins the running batch at the next step; ``static``: a batch starts and ends
together, :meth:`EngineCore.free` is 0 while one runs; ``server``: the server schedules).
:meth:`EngineCore.free` says how many more requests the core takes now under its own
scheduling; the workloads submit no more than that (except the interference workload's long
prompt, which lands beside a running batch by design). Admission (context, KV budget) is
the workloads' (:func:`qeval.measure.load.admission`): a core raises
:class:`~qeval.measure.load.NotAdmitted` only for what its engine refuses itself (llama.cpp
refusing a context, no KV slot at a step).

Checked first: vLLM's ``EngineCore`` (``add_request``, ``step`` -> ``EngineCoreOutputs``,
``abort_requests``) and GuideLLM's ``BackendInterface.resolve``; neither is importable here
without its engine, so this is the same shape over qeval's engines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ..measure.load import NotAdmitted  # noqa: F401 - re-exported: what a core raises for what its engine refuses


@dataclass(frozen=True)
class CoreSpec:
    """What a workload asks of a core when it opens one.

    Attributes:
        slots: sequences served at once (>= 1); served: the most requests in flight.
        max_seq_tokens: the longest sequence any request reaches (prompt + new tokens),
            without the cached prefix (sizes each sequence's KV cells).
        prefill_chunk: prompt tokens per step shared by the prompts being prefilled; None:
            a whole prompt in one step.
        prefix_tokens: a shared prefix of this many tokens will be cached
            (:meth:`EngineCore.cache_prefix`); 0: none.
        shared_prefix: every prompt starts with the same this many tokens, reused or not (a
            server's prompt cache must then be kept from sharing them when they are not:
            vLLM's ``cache_salt``); 0: fresh prompts.
        kv_budget_bytes: bytes the KV pool may take (an engine that allocates its whole pool
            up front refuses a pool over it); None: not checked.
        kv_bytes_per_token: the tier's measured KV bytes per token (None: the engine's own).
        warm_prompt: a prompt of the workload's shape, run untimed as the core opens (first-call
            costs out of the run); None: the engine's minimal warm-up.
        scheduling: the engine's schedule where it has several (transformers: ``auto``,
            ``continuous``, ``static``); ``auto``: the engine's default for the workload.
        qeval_admits: the workload's queue decides when a request starts (the open loop): an
            engine whose batching runs in its own thread with its own queue (transformers'
            continuous batching manager) uses a schedule qeval steps instead.
        label: what the core serves, for the engine's records (a served engine starts each
            core on an empty KV pool and names the phase with it).
    """
    slots: int
    max_seq_tokens: int
    prefill_chunk: int | None = 256
    prefix_tokens: int = 0
    shared_prefix: int = 0
    kv_budget_bytes: float | None = None
    kv_bytes_per_token: float | None = None
    warm_prompt: tuple[int, ...] | None = None
    scheduling: str = "auto"
    qeval_admits: bool = False
    label: str = ""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_seq_tokens < 1:
            raise ValueError("a core needs slots >= 1 and max_seq_tokens >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 (None: a whole prompt per step)")


@dataclass
class TokenEvent:
    """New tokens of one request, or its end.

    Attributes:
        rid: the request's id (as submitted).
        tokens: new token ids (greedy), in order; empty for an end without tokens.
        times: seconds on the workload's clock when each became known (same length).
        done: the request ended: the event that brings its last token (``max_new_tokens``
            of them) says so, as does an end with ``error``.
        error: why it ended without all its tokens: ``"timeout"`` (no first token within its
            timeout), an HTTP status (``"429"``), ``"connection (...)"``, ``"error (...)"``;
            None when it completed.
        cached_tokens: with ``done``: prompt tokens served from a cached prefix (None: not
            reported, as a server without the OpenAI usage field).
    """
    rid: int
    tokens: list[int]
    times: list[float]
    done: bool = False
    error: str | None = None
    cached_tokens: int | None = None


@dataclass
class CoreStats:
    """What a core measured about itself over its life (read after the workload).

    Attributes:
        steps: engine steps (``llama_decode`` calls, model forwards; 0 where a server steps).
        decode_step_tokens: tokens produced by steps that held no prompt token.
        decode_step_s: seconds of those steps (llama-batched-bench's S_TG counts these).
        kv_bytes_peak: KV bytes in use at the fullest step (None if unknown).
        kv_pool_bytes: KV bytes allocated for the core (None if it grows on demand).
        details: engine extras (context size, batch size, schedule, ...).
    """
    steps: int = 0
    decode_step_tokens: int = 0
    decode_step_s: float = 0.0
    kv_bytes_peak: int | None = None
    kv_pool_bytes: int | None = None
    details: dict = field(default_factory=dict)


class EngineCore(Protocol):
    """The serving surface of one engine (module docstring). A context manager: leaving it
    frees the core's context, threads and connections."""

    slots: int
    kv_pool_tokens: int | None
    controls_steps: bool
    scheduling: str

    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        """Start a request (it joins at the next step). ``prefix``: its prompt starts with the
        cached prefix, whose KV is reused (False: prefilled with the rest). ``prefill_chunk``:
        this request's prompt tokens per step (default the spec's). ``timeout_s``: served: no
        first token within this many seconds ends it with ``error="timeout"``.

        Raises:
            ValueError: a bad prompt (empty, ids outside the vocabulary, longer than the spec),
                no room (more than ``slots`` requests), or ``prefix`` without a cached one."""
        ...

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """One step (in process) or the events that arrived (waiting at most ``timeout_s`` for
        the first; served). Returns [] when nothing ran or arrived.

        Raises:
            NotAdmitted: the engine found no KV slot for the step.
            RuntimeError: the engine failed."""
        ...

    def release(self, rid: int) -> None:
        """Free the request's KV cells (abort it if it still runs). Idempotent."""
        ...

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Prefill ``ids`` once as the shared prefix later requests start from (untimed)."""
        ...

    def free(self) -> int:
        """Requests the core starts at its next step under its scheduling (module docstring)."""
        ...

    def stats(self) -> CoreStats:
        """The core's own counters (:class:`CoreStats`)."""
        ...

    def __enter__(self) -> "EngineCore":
        ...

    def __exit__(self, *exc: Any) -> None:
        ...


def can_serve(engine: Any) -> bool:
    """The engine implements a core (``open_core``)."""
    return callable(getattr(engine, "open_core", None))


def open_core(engine: Any, spec: CoreSpec, clock: Any) -> EngineCore:
    """``engine.open_core(spec, clock)``: the engine's core for one workload run.

    Raises:
        ValueError: the engine has no core.
        NotAdmitted: the engine refuses what the spec asks (e.g. a context it cannot allocate).
    """
    if not can_serve(engine):
        raise ValueError(f"engine {getattr(engine, 'name', engine)!r} cannot serve batches (no open_core)")
    return engine.open_core(spec, clock)
