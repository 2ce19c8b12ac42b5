"""The transformers engine core: every workload of :mod:`qeval.serving` on a
:class:`qeval.engines.hf.HFEngine` (:class:`qeval.serving.core.EngineCore`). Two schedules,
and the core says which one runs (``scheduling``):

* **continuous** (:class:`HFContinuousCore`) — transformers' own continuous batching
  (``model.init_continuous_batching``, ``ContinuousBatchingManager``, transformers >= 5.x): a
  paged KV cache shared by every request, chunked prefill (``max_batch_tokens`` = slots +
  ``prefill_chunk`` tokens per step) sharing steps with the others' decode, a background
  generation thread. It was checked and used because it exposes per-token host times
  (``add_request(..., record_timestamps=True)`` -> ``GenerationOutput.timestamps``,
  ``time.perf_counter`` like qeval's :class:`~qeval.measure.arrivals.WallClock`, and
  ``created_time`` when the request was queued). Prefix sharing is off (every prompt is
  fresh) and CUDA graphs are off (timings stay honest on first use). Its steps run in its own
  thread, so qeval does not step it (``controls_steps`` False): :meth:`HFContinuousCore.step`
  waits for finished requests (``get_result``) and returns each with all its tokens. Used for
  the model's default KV cache (``auto``) when the workload's own queue does not decide when
  a request starts and no prefix is cached; its paged cache has no int8 variant.
* **static** (:class:`HFStaticCore`) — batched greedy steps written here over transformers
  cache objects (the tier's own: ``DynamicCache`` or the int8 ``QuantizedCache``): the requests
  submitted since the last step form one batch (a *group*), left-padded to its longest prompt
  (attention mask zero on padding; position ids counted from each row's first real token, as
  ``generate`` does), prefilled in ``prefill_chunk`` columns, decoded together one forward per
  step, ending together. Each :meth:`HFStaticCore.step` runs one forward per live group (a
  request submitted beside a running batch, the interference workload's long prompt, forms
  its own group with its own cache: transformers has no ragged batch that fuses a prefill
  chunk with other sequences' decode in one forward outside its continuous-batching manager,
  whose steps are not exposed) and stamps every token of the step with the workload clock's
  ``step()``. Used for an int8 KV cache, for the open loop (transformers' manager keeps its
  own unbounded queue and its own clock, so admission, refusals and drops could not be
  decided by qeval's queue), for a cached prefix, and when continuous batching cannot start
  (the reason in ``stats().details["continuous_error"]``).

A shared prefix (:meth:`HFStaticCore.cache_prefix`) is prefilled once for ``slots`` rows into
a cache, and every group of prefix requests starts from ``copy.deepcopy`` of it: transformers'
own way to reuse a prompt cache across generations (its "Re-use a cache" recipe in the
KV-cache docs: a prefilled ``DynamicCache`` deep-copied per prompt and passed as
``past_key_values``). Checked first: the continuous-batching manager (``generate_batch`` /
``ContinuousBatchingManager``) had no prefix sharing between requests in transformers 5.1x;
5.2x's shares paged blocks (``allow_block_sharing``) but decides itself what it reuses, so
it runs without here and a cached prefix runs static, alike in both modes of the prefix
workload; ``DynamicCache`` has no copy method of its own (``crop`` cuts back one cache, it
does not fork it). A group of fewer rows keeps the first rows of the copy
(``Cache.batch_select_indices``; refused for the int8 cache, whose quantized layers it would
leave whole).

Greedy only; end-of-sequence ignored (fixed output length). Each batched sequence produces
the tokens it produces alone (tests/test_load.py, float32). :mod:`qeval.engines.hf` imports
this module (its ``open_core`` and :func:`cache_nbytes`, kept here so that the core does not
import the engine back).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Sequence

from ..measure.load import RequestRecord
from ..serving.core import CoreSpec, CoreStats, TokenEvent

SCHEDULES = ("auto", "continuous", "static")
PAGE_SIZE = 64  # tokens per page of the continuous-batching manager's paged cache
WAIT_S = 600.0  # the longest wait for a finished request when the workload sets none


def open_core(engine: Any, spec: CoreSpec, clock: Any) -> Any:
    """The core of ``engine`` (an :class:`~qeval.engines.hf.HFEngine`) for one workload run.

    ``spec.scheduling``: ``continuous`` (transformers' manager), ``static`` (qeval's batches)
    or ``auto``: continuous for the model's default KV cache when ``spec.qeval_admits`` is
    False and no prefix is cached (``spec.prefix_tokens`` 0), else static; under ``auto`` a
    manager that cannot start (an exception in its set-up, start or warm-up) gives the static
    core, with the reason in ``stats().details["continuous_error"]``.

    Returns:
        :class:`HFContinuousCore` or :class:`HFStaticCore` (a context manager).

    Raises:
        ValueError: an unknown schedule.
        Exception: what the manager raised when ``continuous`` was asked for explicitly.
    """
    if spec.scheduling not in SCHEDULES:
        raise ValueError(f"scheduling {spec.scheduling!r}: expected auto, continuous or static")
    want_cb = spec.scheduling == "continuous" or (
        spec.scheduling == "auto" and engine.kv_cache == "model" and not spec.qeval_admits and spec.prefix_tokens == 0)
    error = None
    if want_cb:
        try:
            return HFContinuousCore(engine, spec, clock)
        except Exception as e:  # the model/backend does not run under paged attention: static batches
            if spec.scheduling == "continuous":
                raise
            error = f"{e.__class__.__name__}: {e}"[:300]
    core = HFStaticCore(engine, spec, clock)
    if error:
        core.details["continuous_error"] = error
    return core


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache object: every tensor reachable from its
    layers (keys, values, quantized data, scales, residual buffers), each storage once."""
    import torch  # start-up time: torch loads only in stage processes

    seen: set[int] = set()
    total = 0

    def walk(o: Any, depth: int = 0) -> None:
        nonlocal total
        if depth > 6 or o is None:
            return
        if isinstance(o, torch.Tensor):
            if o.numel() == 0:
                return
            st = o.untyped_storage()
            if st.data_ptr() in seen:
                return
            seen.add(st.data_ptr())
            total += st.nbytes()
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x, depth + 1)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (torch.nn.Module, type)):
            for k, x in vars(o).items():
                if k in ("config",):
                    continue
                walk(x, depth + 1)

    for layer in getattr(cache, "layers", []) or []:
        walk(layer)
    return total


def kv_tokens_peak(records: Sequence[RequestRecord]) -> int:
    """Most tokens held in the KV cache at once, from the request timelines: at each token
    time, every request in flight holds its prompt plus the tokens it has so far."""
    peak = 0
    for r in records:
        for t in r.token_times_s:
            held = 0
            for o in records:
                if o.start_s <= t <= o.token_times_s[-1]:
                    held += o.prompt_tokens + sum(1 for x in o.token_times_s if x <= t)
            peak = max(peak, held)
    return peak


def _check_prompt(engine: Any, spec: CoreSpec, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """``prompt`` as a list of ints, checked (ValueError: empty, ids outside the vocabulary,
    max_new_tokens < 1, or longer than the spec's ``max_seq_tokens`` with its new tokens)."""
    ids = [int(t) for t in prompt]
    if not ids or max_new_tokens < 1:
        raise ValueError("a request needs at least one prompt token and max_new_tokens >= 1")
    vocab = getattr(engine, "vocab_size", None)
    if vocab is not None and any(t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt ids must lie in 0 .. {vocab - 1} (the model's vocabulary)")
    if len(ids) + max_new_tokens > spec.max_seq_tokens:
        raise ValueError(f"{len(ids)} prompt tokens + {max_new_tokens} new ones are beyond the core's "
                         f"{spec.max_seq_tokens} tokens per sequence")
    return ids


# ---- continuous: transformers' ContinuousBatchingManager --------------------------------------

class HFContinuousCore:
    """transformers' ``ContinuousBatchingManager`` as a core (module docstring).

    Configured as qeval's closed loop has always run it: pages of :data:`PAGE_SIZE` tokens,
    ``slots x ceil(max_seq_tokens / 64) + 1`` of them, ``max_batch_tokens = slots +
    prefill_chunk`` (``max_seq_tokens`` when the spec's chunk is None), at most ``slots``
    requests per batch, no block sharing, no CUDA graphs, no async batching, no switch to
    flash attention; one short request (``warm_prompt[:16]``, 2 new tokens) runs through it
    untimed at open. The model's attention implementation is restored on close.

    Args:
        engine: a loaded :class:`~qeval.engines.hf.HFEngine` (model kv cache).
        spec: :class:`~qeval.serving.core.CoreSpec`.
        clock: the workload's :class:`~qeval.measure.arrivals.WallClock` (token times are the
            manager's ``time.perf_counter`` stamps minus ``clock.t0``, read when a request is
            returned, so the clock may start after the core opened).

    Raises:
        ValueError: a clock without ``t0`` (a scripted clock cannot time another thread).
        Exception: what transformers raised setting up, starting or warming up the manager.
    """

    controls_steps = False
    scheduling = "continuous"
    kv_pool_tokens = None

    def __init__(self, engine: Any, spec: CoreSpec, clock: Any) -> None:
        if not hasattr(clock, "t0"):
            raise ValueError("transformers' continuous batching runs on the wall clock (its own thread stamps tokens)")
        import torch  # start-up time: torch loads only in stage processes
        from transformers import GenerationConfig  # start-up time: transformers loads only in stage processes
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # start-up time: as above

        self.engine, self.spec, self.clock, self._torch = engine, spec, clock, torch
        self.slots = n = spec.slots
        per_seq = spec.max_seq_tokens + spec.prefix_tokens
        # the tier's KV bytes per token (sizes kv_bytes_peak); measured by the engine, untimed, when not given
        self.kvpt = spec.kv_bytes_per_token or engine.kv_bytes_per_token(64)
        warm = list(spec.warm_prompt or [])
        new_tokens = max(1, per_seq - len(warm)) if warm else max(1, spec.max_seq_tokens // 2)
        chunk = spec.prefill_chunk or spec.max_seq_tokens
        self.num_blocks = n * -(-per_seq // PAGE_SIZE) + 1
        self.max_batch_tokens = n + chunk
        cbc = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=self.num_blocks,
                                       max_batch_tokens=self.max_batch_tokens, max_requests_per_batch=n,
                                       allow_block_sharing=False, use_cuda_graph=False, use_async_batching=False,
                                       auto_switch_to_flash=False, max_memory_percent=0.9)
        gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0, temperature=None, top_p=None, top_k=None)
        model = engine.model
        self._original_attn = model.config._attn_implementation
        self._mgr = None
        self._live: dict[str, tuple[int, int, int]] = {}  # request id -> (rid, prompt tokens, max new tokens)
        self._records: list[RequestRecord] = []
        self._pool: int | None = None
        self._closed = False
        self.details: dict = {"engine": "transformers ContinuousBatchingManager", "page_size": PAGE_SIZE,
                              "num_blocks": self.num_blocks, "max_batch_tokens": self.max_batch_tokens}
        try:
            with torch.inference_mode():  # the manager's thread runs in the caller's inference mode
                self._mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
                self._mgr.start()
                # warm-up: one short request through the loop (first-call costs out of the run)
                self._mgr.add_request((warm or list(range(1, 17)))[:16], request_id="warmup", max_new_tokens=2,
                                      eos_token_id=-1)
                self._wait("warmup", WAIT_S)
        except BaseException:
            self.close()
            raise

    def _wait(self, request_id: str | None, timeout_s: float | None) -> Any:
        """The next finished result (of ``request_id`` when given, else of a live request),
        polling ``get_result`` a second at a time; None after ``timeout_s``.

        Raises:
            RuntimeError: the manager's loop stopped; no result in :data:`WAIT_S` s when
                ``timeout_s`` is None."""
        limit = WAIT_S if timeout_s is None else max(0.0, float(timeout_s))
        deadline = time.monotonic() + limit
        mgr = self._mgr
        while True:
            left = deadline - time.monotonic()
            r = mgr.get_result(timeout=min(1.0, max(left, 0.0)))
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                if time.monotonic() >= deadline:
                    if timeout_s is None:
                        raise RuntimeError(f"no result from continuous batching in {limit:.0f} s")
                    return None
                continue
            if r.is_finished() and (r.request_id == request_id if request_id is not None else r.request_id in self._live):
                return r

    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        """Queue a request in the manager (``add_request``, its per-token times recorded).
        ``prefill_chunk`` and ``timeout_s`` are not the manager's (its step budget is set at
        open; in process there is no first-token timeout).

        Raises:
            ValueError: ``prefix`` (no prefix cache here), no room (``slots`` requests live),
                or a bad prompt (:meth:`HFStaticCore.submit`).
            RuntimeError: the manager dropped the request."""
        if prefix:
            raise ValueError("transformers' continuous batching core caches no prefix (use scheduling static)")
        if len(self._live) >= self.slots:
            raise ValueError(f"no room: {self.slots} requests are live")
        ids = _check_prompt(self.engine, self.spec, prompt, max_new_tokens)
        key = str(rid)
        self._live[key] = (rid, len(ids), int(max_new_tokens))
        got = self._mgr.add_request(ids, request_id=key, max_new_tokens=int(max_new_tokens), record_timestamps=True,
                                    eos_token_id=-1)
        if got is None:
            del self._live[key]
            raise RuntimeError(f"transformers' continuous batching did not take request {rid}")

    def _event(self, r: Any) -> TokenEvent:
        rid, n_prompt, max_new = self._live.pop(r.request_id)
        if r.error or len(r.generated_tokens) != max_new or not r.timestamps \
                or len(r.timestamps) != len(r.generated_tokens):
            raise RuntimeError(f"continuous batching returned request {r.request_id} with "
                               f"{len(r.generated_tokens)} tokens (error: {r.error})")
        t0 = self.clock.t0
        times = [t - t0 for t in r.timestamps]
        toks = [int(t) for t in r.generated_tokens]
        self._records.append(RequestRecord(rid, n_prompt, r.created_time - t0, times, toks))
        return TokenEvent(rid, toks, times, done=True, cached_tokens=0)

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """The requests that finished: waits up to ``timeout_s`` (None: up to :data:`WAIT_S`
        s) for the first, then takes every other one already finished. Each is one done
        :class:`~qeval.serving.core.TokenEvent` with all its tokens and their times on the
        workload clock. [] when none finished in ``timeout_s`` or nothing is live.

        Raises:
            RuntimeError: the manager's loop stopped, a request came back short or with an
                error, or none finished in :data:`WAIT_S` s with ``timeout_s`` None."""
        if not self._live:
            return []
        r = self._wait(None, timeout_s)
        if r is None:
            return []
        events = [self._event(r)]
        while self._live:
            r = self._mgr.get_result(timeout=0)
            if r is None:
                break
            if r.is_finished() and r.request_id in self._live:
                events.append(self._event(r))
        return events

    def release(self, rid: int) -> None:
        """Cancel the request in the manager if it still runs (``cancel_request``). Idempotent."""
        key = str(rid)
        if key in self._live:
            del self._live[key]
            if self._mgr is not None:
                self._mgr.cancel_request(key)

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Not here: the manager runs without block sharing.

        Raises:
            ValueError: always (a cached prefix opens the static core under ``auto``)."""
        raise ValueError("transformers' continuous batching core caches no prefix (use scheduling static)")

    def free(self) -> int:
        """``slots`` minus the requests live (the manager takes a request at its next step)."""
        return max(0, self.slots - len(self._live))

    def _pool_bytes(self) -> int | None:
        if self._pool is None and self._mgr is not None:
            self._pool = _cache_bytes(self._mgr)
        return self._pool

    def stats(self) -> CoreStats:
        """``kv_bytes_peak``: the most tokens in flight at once (:func:`kv_tokens_peak` over
        the finished requests' timelines) x the tier's KV bytes per token; ``kv_pool_bytes``:
        the paged cache's tensors (:func:`_cache_bytes`); no steps counted (the manager's
        thread steps)."""
        peak = int(round(kv_tokens_peak(self._records) * self.kvpt)) if self._records else None
        return CoreStats(steps=0, kv_bytes_peak=peak, kv_pool_bytes=self._pool_bytes(), details=dict(self.details))

    def close(self) -> None:
        """Stop and destroy the manager; restore the model's attention implementation. Idempotent."""
        if self._closed:
            return
        self._closed = True
        mgr, model = self._mgr, self.engine.model
        try:
            if mgr is not None:
                try:
                    self._pool_bytes()
                except Exception:
                    pass
                mgr.stop(block=True, timeout=30)
                try:
                    mgr.destroy()
                except Exception:
                    pass
        finally:
            if model is not None and model.config._attn_implementation != self._original_attn:
                model.set_attn_implementation(self._original_attn)

    def __enter__(self) -> "HFContinuousCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _cache_bytes(mgr: Any) -> int | None:
    """Bytes of the paged KV cache tensors the manager allocated (None if not found): its
    ``batch_processor.cache``'s ``key_cache`` / ``value_cache`` lists (transformers 5.1x) or its
    one ``cache_tensor`` buffer (5.2x: every layer's pages, and two trash sectors, in one
    uint8 tensor), each storage once. Read while the manager runs (``stop`` drops its batch
    processor)."""
    cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
    if cache is None:
        return None
    import torch  # start-up time: torch loads only in stage processes
    total, seen = 0, set()
    for name in ("key_cache", "value_cache", "cache_tensor"):
        held = getattr(cache, name, None)
        for t in ([held] if isinstance(held, torch.Tensor) else held or []):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total or (cache_nbytes(cache) or None)


# ---- static batches over transformers caches --------------------------------------------------

class _Group:
    """One static batch: ``rows`` (token ids, left-padded to the longest) on ``cache``, one
    forward per :meth:`forward` call: the next ``chunk`` prompt columns while prefilling (the
    last chunk gives the first tokens), then one decode step.

    ``cache``: a cache already holding ``offset`` tokens of every row (a reused shared prefix,
    no padding; the rows are then the next tokens, of one length); None: a new one."""

    def __init__(self, engine: Any, rows: list[list[int]], chunk: int | None, pad_id: int = 0,
                 cache: Any = None, offset: int = 0) -> None:
        import torch  # start-up time: torch loads only in stage processes
        self.engine, self._torch = engine, torch
        n = self.n = len(rows)
        width = self.width = max(len(p) for p in rows)
        ids = torch.full((n, width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        if offset:
            mask = torch.ones((n, offset + width), dtype=torch.long)
            pos = torch.arange(offset, offset + width, dtype=torch.long).expand(n, width)
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
        dev = engine.device
        self.ids, self.mask, self.pos = ids.to(dev), mask.to(dev), pos.to(dev)
        self.cache = engine.new_cache() if cache is None else cache
        self.offset = offset
        self.chunk = int(chunk or width)
        self.fed = 0
        self.nxt: Any = None
        self.last: Any = None

    @property
    def prefilling(self) -> bool:
        """Prompt columns are left to feed."""
        return self.fed < self.width

    def forward(self) -> Any:
        """One forward (call under ``torch.inference_mode``). Returns the greedy next token of
        every row, a device tensor of shape ``[n]``, or None after a prefill chunk that was not
        the last."""
        torch, model, kw = self._torch, self.engine.model, self.engine._cache_kw
        if self.fed < self.width:
            c0 = self.fed
            c1 = min(c0 + self.chunk, self.width)
            out = model(input_ids=self.ids[:, c0:c1], attention_mask=self.mask[:, :self.offset + c1],
                        position_ids=self.pos[:, c0:c1], **{kw: self.cache}, use_cache=True, logits_to_keep=1)
            self.fed = c1
            if c1 < self.width:
                return None
            self.last = self.pos[:, -1]
        else:
            self.mask = torch.cat([self.mask, torch.ones((self.n, 1), dtype=self.mask.dtype, device=self.mask.device)],
                                  dim=1)
            self.last = self.last + 1
            out = model(input_ids=self.nxt[:, None], attention_mask=self.mask, position_ids=self.last[:, None],
                        **{kw: self.cache}, use_cache=True)
        self.nxt = out.logits[:, -1].argmax(-1)
        return self.nxt


def _static_batch(engine: Any, batch: list[list[int]], output_tokens: int, prefill_chunk: int | None,
                  pad_id: int = 0) -> list[list[int]]:
    """One static batch run to its end, untimed (the warm-up): ``batch`` (token ids per row)
    left-padded, prefilled ``prefill_chunk`` columns per forward (None: all at once), then
    greedy decode. Returns the tokens per step, ``[output_tokens][rows]``."""
    import torch  # start-up time: torch loads only in stage processes
    g = _Group(engine, batch, prefill_chunk, pad_id)
    toks: list[list[int]] = []
    with torch.inference_mode():
        while len(toks) < output_tokens:
            nxt = g.forward()
            if nxt is not None:
                toks.append(nxt.tolist())  # the host copy synchronises CUDA too
    return toks


def _warm_up(engine: Any, batch: list[list[int]], output_tokens: int, prefill_chunk: int | None, pad_id: int,
             rows: Sequence[int] | None = None) -> None:
    """First-call costs out of the timed run, as a server's start-up warm-up takes them.

    Every device: one short row (first-call set-up of the kernels and thread pools). CUDA:
    also a batch of each row count in ``rows`` (default: ``len(batch)``), the first rows of
    ``batch`` at full length and ``output_tokens``, untimed, once per engine and shape
    (``engine._warmed_shapes``). Measured on an H200 (torch 2.11, transformers 5.17, a
    230 M-parameter llama, eager decode): a batch whose row count had not run before
    decoded at 52-57 ms a step and a row count that had, at 10-20 ms (the first 16-row
    batch at 35 ms, then 18), whatever other shapes had run; so the open loop, whose batches
    take any row count up to its slots, warms each of them. On the CPU (SmolLM2-135M, one
    thread) repeated batches of 1, 2 and 4 rows varied by up to 30 % with no first-run
    pattern above that, and a full-length batch costs as much as the point itself, so none
    is run there."""
    _static_batch(engine, [batch[0][:16]], 2, min(prefill_chunk or 16, 16), pad_id)
    if engine.device != "cuda":
        return
    warmed = getattr(engine, "_warmed_shapes", None)
    if warmed is None:
        warmed = set()
        engine._warmed_shapes = warmed
    for n in rows or [len(batch)]:
        key = (n, max(len(p) for p in batch[:n]), output_tokens, prefill_chunk)
        if key not in warmed:
            _static_batch(engine, batch[:n], output_tokens, prefill_chunk, pad_id)
            warmed.add(key)


class _Req:
    """A request of the static core: its prompt (its own part with ``prefix``), new tokens
    wanted, prefill chunk, tokens so far, and its group (None: not started)."""
    __slots__ = ("rid", "prompt", "max_new", "prefix", "chunk", "toks", "group", "row", "released")

    def __init__(self, rid: int, prompt: list[int], max_new: int, prefix: bool, chunk: int | None) -> None:
        self.rid, self.prompt, self.max_new, self.prefix, self.chunk = rid, prompt, max_new, prefix, chunk
        self.toks: list[int] = []
        self.group: _Group | None = None
        self.row = -1
        self.released = False

    @property
    def done(self) -> bool:
        """It has all its new tokens."""
        return len(self.toks) >= self.max_new


class HFStaticCore:
    """Static batches over transformers caches as a core (module docstring).

    At a step the requests submitted since the last one form one new group (those with a
    cached prefix and those without, or with different prefill chunks, form one group each),
    with its own cache: ``engine.new_cache()``, or a ``copy.deepcopy`` of the prefix cache
    (:meth:`cache_prefix`) for prefix requests. Then one forward per live group, oldest first,
    the host copies of the tokens after the last forward, and ``clock.step()``: every token of
    the step gets that time. A group ends when each of its rows is done or released.

    Args:
        engine: a loaded :class:`~qeval.engines.hf.HFEngine` (its model, device, cache kind).
        spec: :class:`~qeval.serving.core.CoreSpec`; ``warm_prompt`` shapes the warm-up
            (:func:`_warm_up`: on CUDA each row count 1 .. slots when ``qeval_admits``, else
            ``slots`` rows).
        clock: the workload's clock (``step()`` after each step).
        pad_id: the id left padding uses (masked out; any valid id).
    """

    controls_steps = True
    scheduling = "static"
    kv_pool_tokens = None

    def __init__(self, engine: Any, spec: CoreSpec, clock: Any, pad_id: int = 0) -> None:
        import torch  # start-up time: torch loads only in stage processes
        self.engine, self.spec, self.clock, self._torch = engine, spec, clock, torch
        self.slots = spec.slots
        self.pad_id = int(pad_id)
        self.details: dict = {"engine": "qeval static batches (transformers cache)", "kv_cache": engine.kv_cache}
        self._reqs: dict[int, _Req] = {}
        self._pending: list[_Req] = []
        self._groups: list[tuple[_Group, list[_Req]]] = []
        self._prefix: list[int] = []
        self._held: Any = None
        self._steps = self._dec_tokens = self._batches = 0
        self._dec_s = 0.0
        self._kv_peak = 0
        self._prev_t: float | None = None
        warm = [int(t) for t in (spec.warm_prompt or [])]
        if warm:
            out = max(1, spec.max_seq_tokens + spec.prefix_tokens - len(warm))
            with torch.inference_mode():
                _warm_up(engine, [warm] * spec.slots, out, spec.prefill_chunk, self.pad_id,
                         rows=range(1, spec.slots + 1) if spec.qeval_admits else None)
        else:
            _static_batch(engine, [[t % engine.vocab_size for t in range(1, 17)]], 2, 16, self.pad_id)

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Prefill ``ids`` once for ``slots`` rows into a cache of the tier's kind (chunks of
        the spec's ``prefill_chunk``), untimed; prefix requests' groups start from a deep copy.

        Raises:
            ValueError: an empty prefix or ids outside the vocabulary."""
        torch = self._torch
        prefix = [int(t) for t in ids]
        if not prefix:
            raise ValueError("a prefix of at least one token is needed")
        if any(t < 0 or t >= self.engine.vocab_size for t in prefix):
            raise ValueError(f"prefix ids must lie in 0 .. {self.engine.vocab_size - 1} (the model's vocabulary)")
        eng, chunk = self.engine, self.spec.prefill_chunk or len(prefix)
        held = eng.new_cache()
        x = torch.tensor([prefix] * self.slots, dtype=torch.long, device=eng.device)
        with torch.inference_mode():
            for c0 in range(0, len(prefix), chunk):
                eng.model(input_ids=x[:, c0:c0 + chunk], **{eng._cache_kw: held}, use_cache=True, logits_to_keep=1)
        self._prefix, self._held = prefix, held

    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        """Queue a request; it starts at the next step, in a new group with the others queued
        (module docstring). ``prompt``: with ``prefix``, the part after the cached prefix.
        ``prefill_chunk``: its group's columns per forward (default the spec's; None there: all
        at once). ``timeout_s`` is ignored (in process there is no first-token timeout).

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, a prompt and its new tokens
                beyond ``max_seq_tokens``, a rid already live, ``slots`` requests live, or
                ``prefix`` without :meth:`cache_prefix`."""
        if rid in self._reqs:
            raise ValueError(f"request {rid} is already live")
        if len(self._reqs) >= self.slots:
            raise ValueError(f"no room: {self.slots} requests are live")
        if prefix and self._held is None:
            raise ValueError("prefix=True needs a cached prefix (cache_prefix)")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        ids = _check_prompt(self.engine, self.spec, prompt, max_new_tokens)
        r = _Req(rid, ids, int(max_new_tokens), bool(prefix), prefill_chunk or self.spec.prefill_chunk)
        self._reqs[rid] = r
        self._pending.append(r)

    def _start(self) -> None:
        """The queued requests as new groups (one per kind: prefix or not, prefill chunk)."""
        kinds: dict[tuple[bool, int | None], list[_Req]] = {}
        for r in self._pending:
            kinds.setdefault((r.prefix, r.chunk), []).append(r)
        self._pending = []
        for (pre, chunk), reqs in kinds.items():
            rows = [r.prompt for r in reqs]
            if pre:
                if len({len(p) for p in rows}) != 1:
                    raise ValueError("a reused prefix needs own parts of one length per batch (no padding)")
                cache = copy.deepcopy(self._held)
                if len(rows) < self.slots:
                    self._select_rows(cache, len(rows))
                g = _Group(self.engine, rows, chunk, self.pad_id, cache=cache, offset=len(self._prefix))
            else:
                g = _Group(self.engine, rows, chunk, self.pad_id)
            for i, r in enumerate(reqs):
                r.group, r.row = g, i
            self._groups.append((g, reqs))
            self._batches += 1

    def _select_rows(self, cache: Any, n: int) -> None:
        """Keep the first ``n`` rows of a copied prefix cache (``batch_select_indices``).

        Raises:
            ValueError: the cache cannot select rows (no ``batch_select_indices``, or
                quantized layers, whose packed data it would leave whole)."""
        select = getattr(cache, "batch_select_indices", None)
        quantized = any(hasattr(layer, "_quantized_keys") for layer in getattr(cache, "layers", None) or [])
        if select is None or quantized:
            raise ValueError(f"a prefix group of {n} rows needs a cache that selects rows of its {self.slots}; "
                             f"{type(cache).__name__} cannot")
        select(self._torch.arange(n, device=self.engine.device))

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """One step: the queued requests start as a group, every live group runs one forward,
        then ``t = clock.step()``; returns one :class:`~qeval.serving.core.TokenEvent` per
        request that got a token (time ``t``; ``done`` with its last one, ``cached_tokens``
        then the prefix's length for a prefix request, else 0). [] when nothing is live (the
        clock not stepped). ``timeout_s`` is ignored (qeval runs every step)."""
        if self._pending:
            self._start()
        if not self._groups:
            return []
        torch = self._torch
        pure = not any(g.prefilling for g, _ in self._groups)
        got = []
        with torch.inference_mode():
            for g, reqs in self._groups:
                nxt = g.forward()
                self._steps += 1
                if nxt is not None:
                    got.append((nxt, reqs))
            got = [(nxt.tolist(), reqs) for nxt, reqs in got]  # the host copies synchronise CUDA too
        t = self.clock.step()
        events: list[TokenEvent] = []
        n_tok = 0
        for row, reqs in got:
            for r in reqs:
                if r.released or r.done:
                    continue
                r.toks.append(int(row[r.row]))
                n_tok += 1
                done = r.done
                events.append(TokenEvent(r.rid, [r.toks[-1]], [t], done=done,
                                         cached_tokens=(len(self._prefix) if r.prefix else 0) if done else None))
        if pure and self._prev_t is not None:
            self._dec_tokens += n_tok
            self._dec_s += t - self._prev_t
        self._prev_t = t
        self._drop_ended()
        return events

    def _drop_ended(self) -> None:
        keep = []
        for g, reqs in self._groups:
            if all(r.released or r.done for r in reqs):
                self._kv_peak = max(self._kv_peak, cache_nbytes(g.cache))
            else:
                keep.append((g, reqs))
        self._groups = keep

    def release(self, rid: int) -> None:
        """Forget the request; its group's cache is freed once every row of it is done or
        released (a static batch keeps its rows to the end). Idempotent."""
        r = self._reqs.pop(rid, None)
        if r is None:
            return
        r.released = True
        if r.group is None:
            self._pending = [p for p in self._pending if p is not r]
        else:
            self._drop_ended()

    def free(self) -> int:
        """0 while a group runs (static batching: a request waits for the batch's end), else
        ``slots`` minus the requests queued."""
        if self._groups:
            return 0
        return max(0, self.slots - len(self._pending))

    def stats(self) -> CoreStats:
        """``steps``: forwards; ``decode_step_tokens`` / ``decode_step_s``: the tokens and
        seconds (from the previous step's end) of steps where no group prefilled; ``kv_bytes_peak``:
        the largest group cache (``cache_nbytes``, at its end; live ones now); no pool
        (caches grow on demand); details: engine, ``kv_cache``, ``batches`` (groups formed)
        and ``continuous_error`` where continuous batching could not start."""
        peak = max([self._kv_peak] + [cache_nbytes(g.cache) for g, _ in self._groups])
        return CoreStats(steps=self._steps, decode_step_tokens=self._dec_tokens, decode_step_s=self._dec_s,
                         kv_bytes_peak=peak or None, kv_pool_bytes=None,
                         details={**self.details, "batches": self._batches})

    def close(self) -> None:
        """Drop every group and the prefix cache. Idempotent."""
        self._groups, self._pending, self._reqs = [], [], {}
        self._held = None

    def __enter__(self) -> "HFStaticCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
