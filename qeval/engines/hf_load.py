"""Batched serving on transformers: N closed-loop streams over one model.

Two schedules, and the result says which one ran (``LoadRun.scheduling``):

* **continuous** — transformers' own continuous batching (``model.init_continuous_batching``,
  ``ContinuousBatchingManager``, transformers >= 5.x): a paged KV cache shared by every
  request, chunked prefill (``max_batch_tokens`` = N + ``prefill_chunk`` tokens per step)
  sharing steps with the others' decode, a background generation thread. It was checked
  and used because it exposes per-token host times (``add_request(...,
  record_timestamps=True)`` -> ``GenerationOutput.timestamps``, ``time.perf_counter`` like
  ours, and ``created_time`` when the request was queued). Prefix sharing is off (every
  prompt is fresh) and CUDA graphs are off (timings stay honest on first use).
  Used for the model's default KV cache; its paged cache has no int8 variant.
* **static** — a batched greedy loop written here over one transformers cache object (the
  tier's own: ``DynamicCache`` or the int8 ``QuantizedCache``): a batch of N requests is
  left-padded to its longest prompt (attention mask zero on padding; position ids
  counted from each row's first real token, as ``generate`` does), prefilled in
  ``prefill_chunk`` columns, decoded together, and ends together; the stream's next
  requests form the next batch. Used for an int8 KV cache, and when continuous batching
  is unavailable or fails (the reason in ``details["continuous_error"]``).

Open loop (:func:`serve_open_loop`): requests arrive on a schedule and wait in a bounded
queue (:class:`qeval.measure.arrivals.WaitingQueue`); whenever the engine is free it takes
up to ``slots`` waiting requests as one static batch (static batching: a request that
arrives while a batch runs waits for its end). transformers' continuous batching manager
was checked for this: it keeps its own unbounded queue and its own clock, so admission,
refusals and drops could not be decided by qeval's queue.

Greedy only; end-of-sequence ignored (fixed output length). Each batched sequence
produces the tokens it produces alone (tests/test_load.py, float32).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Iterable, Sequence

from ..measure.arrivals import WaitingQueue, WallClock
from ..measure.load import LazyPrompts, LoadRun, NotAdmitted, PromptFor, RequestRecord, admitted_prompt
from ..measure.openloop import OpenLoopRun
from .hf import cache_nbytes
from .hf_interference import serve_with_long_prompt  # noqa: F401 - the interference loop beside the serve one


def _check(concurrency: int, output_tokens: int, requests_per_stream: int, prefill_chunk: int) -> None:
    if concurrency < 1 or output_tokens < 1 or requests_per_stream < 1 or prefill_chunk < 1:
        raise ValueError("concurrency, output_tokens, requests_per_stream and prefill_chunk must be >= 1")


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


def serve_closed_loop(engine: Any, prompt_for: PromptFor, *, concurrency: int, output_tokens: int,
                      requests_per_stream: int, prefill_chunk: int = 256, scheduling: str = "auto",
                      kv_bytes_per_token: float | None = None, kv_budget_bytes: float | None = None,
                      max_context: int | None = None, pad_id: int = 0, shared_prefix: int = 0,
                      reuse_prefix: bool = False) -> LoadRun:
    """Serve ``concurrency`` closed-loop streams with a :class:`qeval.engines.hf.HFEngine`.

    Args:
        prompt_for: ``(stream, k) -> prompt token ids`` of the stream's k-th request.
        scheduling: "auto" (continuous for the model's default KV cache, else static),
            "continuous" or "static".
        kv_bytes_per_token: the tier's KV bytes per token (sizes the paged pool and the
            budget check; measured by the engine when None).
        kv_budget_bytes: the most bytes the KV cache may take; None: not checked.
        max_context: tokens per sequence the model takes; None: not checked.
        pad_id: the id left padding uses (masked out; any valid id).
        shared_prefix: every prompt starts with the same this many tokens; the point runs
            in static batches (both modes alike, so they compare).
        reuse_prefix: with ``shared_prefix``, the prefix is prefilled once for a batch of
            ``concurrency`` rows (untimed: a system prompt already cached) and every batch
            starts from a ``copy.deepcopy`` of that cache (:mod:`qeval.engines.hf_prefix`'s
            rule), prefilling only the requests' own parts.

    Returns:
        :class:`~qeval.measure.load.LoadRun` (``cached_prompt_tokens`` with ``shared_prefix``).

    Raises:
        NotAdmitted: a sequence beyond ``max_context``, or the KV cache of the point beyond
            ``kv_budget_bytes``.
        ValueError: bad arguments.
    """
    _check(concurrency, output_tokens, requests_per_stream, prefill_chunk)
    # prompts made as requests start (LazyPrompts), never a table of concurrency x requests
    # entries; the first sizes the KV cache and is checked before anything is built
    first = [int(t) for t in prompt_for(0, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    per_seq = len(first) + output_tokens
    if max_context is not None and per_seq > max_context:
        raise NotAdmitted(f"{per_seq} tokens per sequence is beyond the model's context of {max_context}")
    kvpt = kv_bytes_per_token or engine.kv_bytes_per_token(64)
    if kv_budget_bytes is not None and concurrency * per_seq * kvpt > kv_budget_bytes:
        raise NotAdmitted(f"KV cache of {concurrency} x {per_seq} tokens = {concurrency * per_seq * kvpt / 2**30:.2f} "
                          f"GiB exceeds the KV budget of {max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
    if scheduling not in ("auto", "continuous", "static"):
        raise ValueError(f"scheduling {scheduling!r}: expected auto, continuous or static")
    if shared_prefix:
        prefix = first[:shared_prefix]
        if len(first) <= shared_prefix:
            raise ValueError(f"every prompt must start with the same {shared_prefix} tokens and have its own part")
        prompts = LazyPrompts(prompt_for, len(first), prefix=prefix)
        return _static(engine, prompts, concurrency, output_tokens, requests_per_stream, prefill_chunk, pad_id,
                       prefix=prefix if reuse_prefix else None, shared_prefix=shared_prefix)
    prompts = LazyPrompts(prompt_for, len(first))
    want_cb = scheduling == "continuous" or (scheduling == "auto" and engine.kv_cache == "model")
    error = None
    if want_cb:
        try:
            return _continuous(engine, prompts, concurrency, output_tokens, requests_per_stream, prefill_chunk,
                               per_seq, kvpt)
        except NotAdmitted:
            raise
        except Exception as e:  # the model/backend does not run under paged attention: static batches
            if scheduling == "continuous":
                raise
            error = f"{e.__class__.__name__}: {e}"[:300]
    run = _static(engine, prompts, concurrency, output_tokens, requests_per_stream, prefill_chunk, pad_id)
    if error:
        run.details["continuous_error"] = error
    return run


# ---- continuous: transformers' ContinuousBatchingManager --------------------------------

def _continuous(engine: Any, prompts: dict, n: int, output_tokens: int, per_stream: int, prefill_chunk: int,
                per_seq: int, kvpt: float) -> LoadRun:
    import torch  # start-up time: torch loads only in stage processes
    from transformers import GenerationConfig  # start-up time: transformers loads only in stage processes
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # start-up time: as above

    model = engine.model
    page = 64
    pages_per_seq = -(-per_seq // page)
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=n * pages_per_seq + 1,
                                   max_batch_tokens=n + prefill_chunk, max_requests_per_batch=n,
                                   allow_block_sharing=False, use_cuda_graph=False, use_async_batching=False,
                                   auto_switch_to_flash=False, max_memory_percent=0.9)
    gc = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=-1,
                          pad_token_id=0, temperature=None, top_p=None, top_k=None)
    original_attn = model.config._attn_implementation
    records: list[RequestRecord] = []
    with torch.inference_mode():
        mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
        try:
            mgr.start()
            # warm-up: one short request through the loop (first-call costs out of the run)
            mgr.add_request(prompts[(0, 0)][:16], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
            _wait(mgr, "warmup")
            owner: dict[str, tuple[int, int]] = {}
            t0 = time.perf_counter()

            def send(s: int, k: int) -> None:
                rid = f"s{s}k{k}"
                owner[rid] = (s, k)
                mgr.add_request(prompts[(s, k)], request_id=rid, max_new_tokens=output_tokens,
                                record_timestamps=True, eos_token_id=-1)

            for s in range(n):
                send(s, 0)
            left = n * per_stream
            while left:
                r = _wait(mgr, None)
                if r.request_id not in owner:
                    continue
                s, k = owner[r.request_id]
                if r.error or len(r.generated_tokens) != output_tokens or not r.timestamps:
                    raise RuntimeError(f"continuous batching returned request {r.request_id} with "
                                       f"{len(r.generated_tokens)} tokens (error: {r.error})")
                records.append(RequestRecord(s, len(prompts[(s, k)]), r.created_time - t0,
                                             [t - t0 for t in r.timestamps], list(r.generated_tokens)))
                left -= 1
                if k + 1 < per_stream:
                    send(s, k + 1)
            pool = _cache_bytes(mgr)
        finally:
            mgr.stop(block=True, timeout=30)
            try:
                mgr.destroy()
            except Exception:
                pass
            if model.config._attn_implementation != original_attn:
                model.set_attn_implementation(original_attn)
    duration = max(r.token_times_s[-1] for r in records)
    return LoadRun(concurrency=n, scheduling="continuous", requests=records, duration_s=duration,
                   kv_bytes_peak=int(round(kv_tokens_peak(records) * kvpt)), kv_pool_bytes=pool,
                   steps=0, details={"engine": "transformers ContinuousBatchingManager", "page_size": page,
                                     "num_blocks": n * pages_per_seq + 1, "max_batch_tokens": n + prefill_chunk,
                                     "prefill_chunk": prefill_chunk})


def _wait(mgr: Any, request_id: str | None, timeout: float = 600.0) -> Any:
    """The next finished result (of ``request_id`` when given); RuntimeError when the loop died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = mgr.get_result(timeout=1.0)
        if r is None:
            if not mgr.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
            continue
        if r.is_finished() and (request_id is None or r.request_id == request_id):
            return r
    raise RuntimeError(f"no result from continuous batching in {timeout:.0f} s")


def _cache_bytes(mgr: Any) -> int | None:
    """Bytes of the paged KV cache tensors the manager allocated (None if not found)."""
    cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
    if cache is None:
        return None
    import torch  # start-up time: torch loads only in stage processes
    total, seen = 0, set()
    for name in ("key_cache", "value_cache"):
        for t in getattr(cache, name, None) or []:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total or (cache_nbytes(cache) or None)


# ---- static batches over one transformers cache -------------------------------------------

def _static(engine: Any, prompts: dict, n: int, output_tokens: int, per_stream: int, prefill_chunk: int,
            pad_id: int, prefix: list[int] | None = None, shared_prefix: int = 0) -> LoadRun:
    import torch  # start-up time: torch loads only in stage processes

    model, dev, kw = engine.model, engine.device, engine._cache_kw
    records: list[RequestRecord] = []
    steps = dec_tokens = 0
    dec_s = 0.0
    kv_peak = 0
    with torch.inference_mode():
        _warm_up(engine, [prompts[(s, 0)] for s in range(n)], output_tokens, prefill_chunk, pad_id)
        held = None
        if prefix:  # the shared prefix for n rows, once, before the clock starts
            held = engine.new_cache()
            x = torch.tensor([prefix] * n, dtype=torch.long, device=engine.device)
            for c0 in range(0, len(prefix), prefill_chunk):
                model(input_ids=x[:, c0:c0 + prefill_chunk], **{kw: held}, use_cache=True, logits_to_keep=1)
        cached = 0
        t0 = time.perf_counter()
        now = 0.0
        for k in range(per_stream):
            batch = [prompts[(s, k)] for s in range(n)]
            start = now
            if held is not None:
                own = [p[len(prefix):] for p in batch]
                if len({len(p) for p in own}) != 1:
                    raise ValueError("a reused prefix needs own parts of one length per batch (no padding)")
                out = _static_batch(engine, own, output_tokens, prefill_chunk, pad_id, t0,
                                    cache=copy.deepcopy(held), offset=len(prefix))
                cached += n * len(prefix)
            else:
                out = _static_batch(engine, batch, output_tokens, prefill_chunk, pad_id, t0)
            times, toks, cache, step_info = out
            for s in range(n):
                records.append(RequestRecord(s, len(batch[s]), start, list(times), [row[s] for row in toks]))
            now = times[-1]
            steps += step_info[0]
            dec_tokens += n * (len(times) - 1)
            dec_s += times[-1] - times[0]
            kv_peak = max(kv_peak, cache_nbytes(cache))
            del cache
    duration = max(r.token_times_s[-1] for r in records)
    return LoadRun(concurrency=n, scheduling="static", requests=records, duration_s=duration,
                   kv_bytes_peak=kv_peak or None, kv_pool_bytes=None, decode_step_tokens=dec_tokens,
                   decode_step_s=dec_s, steps=steps, cached_prompt_tokens=cached if shared_prefix else None,
                   details={"engine": "qeval static batches (transformers cache)", "prefill_chunk": prefill_chunk,
                            "kv_cache": engine.kv_cache})


def _warm_up(engine: Any, batch: list[list[int]], output_tokens: int, prefill_chunk: int, pad_id: int,
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
    _static_batch(engine, [batch[0][:16]], 2, min(prefill_chunk, 16), pad_id)
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


def _static_batch(engine: Any, batch: list[list[int]], output_tokens: int, prefill_chunk: int, pad_id: int,
                  t0: float | None = None, cache: Any = None,
                  offset: int = 0) -> tuple[list[float], list[list[int]], Any, tuple[int]]:
    """One static batch: left-padded prefill in ``prefill_chunk`` columns, then greedy decode.
    ``cache``: a cache already holding ``offset`` tokens of every row (a reused shared
    prefix, no padding); ``batch`` then holds the rows' next tokens, of one length.
    Returns (times since ``t0`` of each step's tokens, tokens per step [step][row], the cache,
    (forward passes,))."""
    import torch  # start-up time: torch loads only in stage processes
    model, dev, kw = engine.model, engine.device, engine._cache_kw
    t0 = time.perf_counter() if t0 is None else t0
    n = len(batch)
    width = max(len(p) for p in batch)
    ids = torch.full((n, width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    if offset:
        mask = torch.ones((n, offset + width), dtype=torch.long)
        pos = torch.arange(offset, offset + width, dtype=torch.long).expand(n, width)
    else:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
    cache = engine.new_cache() if cache is None else cache
    forwards = 0
    out = None
    for c0 in range(0, width, prefill_chunk):
        c1 = min(c0 + prefill_chunk, width)
        out = model(input_ids=ids[:, c0:c1], attention_mask=mask[:, :offset + c1], position_ids=pos[:, c0:c1],
                    **{kw: cache}, use_cache=True, logits_to_keep=1)
        forwards += 1
    nxt = out.logits[:, -1].argmax(-1)
    toks = [nxt.tolist()]  # the host copy synchronises CUDA too
    times = [time.perf_counter() - t0]
    last = pos[:, -1]
    for _ in range(output_tokens - 1):
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                    **{kw: cache}, use_cache=True)
        forwards += 1
        nxt = out.logits[:, -1].argmax(-1)
        toks.append(nxt.tolist())
        times.append(time.perf_counter() - t0)
    return times, toks, cache, (forwards,)


def serve_open_loop(engine: Any, prompt_for: PromptFor, *, arrivals: Iterable[float], slots: int, max_waiting: int,
                    timeout_s: float, output_tokens: int, prefill_chunk: int = 256,
                    kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                    max_context: int | None = None, clock: Any = None, stream: int = 0,
                    pad_id: int = 0) -> OpenLoopRun:
    """Serve requests arriving at ``arrivals`` (s) with a :class:`qeval.engines.hf.HFEngine`
    in static batches of up to ``slots`` requests taken from the bounded waiting queue
    (admission at each batch boundary; refusals and drops counted).

    Args:
        prompt_for: ``(stream, i) -> prompt token ids`` of the i-th arrival.
        arrivals: arrival times, s since the point started (ascending).
        slots: most requests per batch.
        max_waiting, timeout_s: the queue's length limit and longest wait (s).
        clock: a :class:`~qeval.measure.arrivals.WallClock` (token times come from
            ``time.perf_counter`` on its origin).
        stream: the ``stream`` argument of ``prompt_for`` (distinct per point).
        kv_bytes_per_token, kv_budget_bytes, max_context, pad_id: as :func:`serve_closed_loop`.

    Returns:
        :class:`~qeval.measure.openloop.OpenLoopRun` (scheduling "static").

    Raises:
        NotAdmitted: a sequence beyond ``max_context``, or ``slots`` sequences beyond
            ``kv_budget_bytes``.
        ValueError: bad arguments.
    """
    import torch  # start-up time: torch loads only in stage processes
    _check(slots, output_tokens, 1, prefill_chunk)
    clock = clock or WallClock()
    if not isinstance(clock, WallClock):
        raise ValueError("the transformers open loop runs on the wall clock")
    queue = WaitingQueue(arrivals, max_waiting, timeout_s)
    if queue.next_arrival() is None:
        raise ValueError("an open-loop point needs at least one arrival")
    # prompts are made when a request gets a place and dropped when it ends (memory bounded by
    # the slots, not the schedule); the point's first prompt sizes the KV cache, as every
    # prompt of a point has the load depth (admitted_prompt checks it)
    first = [int(t) for t in prompt_for(stream, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    per_seq = len(first) + output_tokens
    if max_context is not None and per_seq > max_context:
        raise NotAdmitted(f"{per_seq} tokens per sequence is beyond the model's context of {max_context}")
    kvpt = kv_bytes_per_token or engine.kv_bytes_per_token(64)
    if kv_budget_bytes is not None and slots * per_seq * kvpt > kv_budget_bytes:
        raise NotAdmitted(f"KV cache of {slots} x {per_seq} tokens = {slots * per_seq * kvpt / 2**30:.2f} "
                          f"GiB exceeds the KV budget of {max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
    records: list[RequestRecord] = []
    kv_peak = batches = 0
    with torch.inference_mode():
        _warm_up(engine, [first] * slots, output_tokens, prefill_chunk, pad_id,  # every batch it may form
                 rows=range(1, slots + 1))
        clock.start()
        now = 0.0
        while True:
            take = queue.admit(now, slots)
            if not take:
                nxt = queue.next_arrival()
                if nxt is None:
                    break
                now = clock.idle_until(nxt)
                continue
            batch = [admitted_prompt(prompt_for, stream, r.index, len(first)) for r in take]
            times, toks, cache, _ = _static_batch(engine, batch, output_tokens, prefill_chunk, pad_id, clock.t0)
            kv_peak = max(kv_peak, cache_nbytes(cache))
            del cache
            batches += 1
            for j, r in enumerate(take):
                r.outcome, r.ended_s = "completed", times[-1]
                records.append(RequestRecord(r.index, len(batch[j]), r.arrival_s, list(times),
                                             [row[j] for row in toks]))
            now = clock.now()
    return OpenLoopRun(requests=queue.requests, completed=records, scheduling="static", tally=queue.tally,
                       kv_bytes_peak=kv_peak or None, kv_pool_bytes=None,
                       details={"engine": "qeval static batches (transformers cache)", "slots": slots,
                                "batches": batches, "prefill_chunk": prefill_chunk, "kv_cache": engine.kv_cache})
