"""Continuous batching on llama.cpp: one context serving N sequences, driven through
llama-cpp-python's low-level API the way llama.cpp's own ``llama-server``
(``tools/server/server-context.cpp``, ``update_slots``) and ``llama-batched-bench`` drive it.

One context is created per load point with ``n_seq_max = N`` and a KV pool of N x
(``per_seq_ctx``) cells (llama.cpp's default non-unified cache: each sequence owns
``n_ctx / n_seq_max`` cells). Every step is one ``llama_decode`` of one ``llama_batch``
that holds, in this order:

1. one token for every stream that is decoding (its last greedy token, at its next
   position, logits requested), as the server puts each generating slot's sampled token
   first;
2. up to ``prefill_chunk`` prompt tokens of the streams waiting for their prefill, oldest
   request first (chunked prefill: a long prompt takes several steps, each shared with
   the other streams' decode), logits requested only for a prompt's last token.

After the decode the logits of the requested rows (contiguous, in batch order:
``llama_get_logits``) are reduced by argmax in numpy, and every token produced by that
step is stamped with the same host time. A request that has its ``output_tokens`` is
done: its cells are dropped with ``llama_memory_seq_rm(mem, seq, -1, -1)`` and the
stream sends its next request (a fresh prompt) at once: a closed loop. Greedy only;
end-of-sequence tokens are ignored (fixed output length, like vLLM bench's
``--ignore-eos``).

The open loop (:func:`serve_open_loop`) runs the same steps on a context of ``slots``
sequences; requests arrive on a schedule and wait in the bounded queue of
:mod:`qeval.measure.arrivals` (admission at every step boundary, as ``update_slots`` takes new
tasks once per loop); a request given a free sequence joins the batch at the next step.

llama-cpp-python's high-level ``Llama`` class was checked: it serves one sequence per
context and hides per-token times, so the loop is written here over ``llama_batch_init``
/ ``llama_decode`` / ``llama_memory_seq_rm``.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import numpy as np

from ..measure.arrivals import Request, WaitingQueue, WallClock
from ..measure.load import LazyPrompts, LoadRun, NotAdmitted, PromptFor, RequestRecord, admitted_prompt
from ..measure.openloop import OpenLoopRun
from .llamacpp_interference import serve_with_long_prompt  # noqa: F401 - the interference loop beside the serve one

_CTX_ROUND = 256  # llama.cpp pads the per-sequence context to 256 cells (GGML_PAD(n_ctx_seq, 256))


class _Stream:
    __slots__ = ("idx", "k", "prompt", "fed", "pos", "toks", "times", "start", "done")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.k = -1
        self.done = False

    def begin(self, prompt: Sequence[int], now: float) -> None:
        self.k += 1
        self.prompt = [int(t) for t in prompt]
        self.fed = 0          # prompt tokens already in the cache
        self.pos = 0          # next position of this sequence
        self.toks: list[int] = []
        self.times: list[float] = []
        self.start = now


def serve_closed_loop(engine: Any, prompt_for: PromptFor, *, concurrency: int, output_tokens: int,
                      requests_per_stream: int, prefill_chunk: int = 256,
                      kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                      max_context: int | None = None, shared_prefix: int = 0, reuse_prefix: bool = False) -> LoadRun:
    """Serve ``concurrency`` closed-loop streams from one llama.cpp context.

    Args:
        engine: a loaded :class:`qeval.engines.llamacpp.LlamaCppEngine` (its model, threads,
            KV type and flash-attention setting are used; its own context is left alone).
        prompt_for: ``(stream, k) -> prompt token ids`` of the stream's k-th request.
        concurrency: N, the streams served at once (``n_seq_max``).
        output_tokens: new tokens per request (>= 1).
        requests_per_stream: requests each stream sends, one after the other.
        prefill_chunk: prompt tokens per step (shared by the waiting prompts).
        kv_budget_bytes: the most bytes the KV pool may take; None: not checked.
        kv_bytes_per_token, max_context: taken for the common serve signature
            (:func:`qeval.measure.serving.load_sweep`) and not used: the pool's size comes from
            llama.cpp's own context and the model's training context.
        shared_prefix: every prompt starts with the same this many tokens.
        reuse_prefix: with ``shared_prefix``, the prefix is prefilled once (untimed: a system
            prompt already cached, as a server holds it) into its own sequence of a unified KV
            cache, and every request's sequence starts as a copy of it
            (``llama_memory_seq_cp``, metadata only on a unified cache, as
            :mod:`qeval.engines.llamacpp_prefix`): only its own part is prefilled.

    Returns:
        :class:`~qeval.measure.load.LoadRun` (scheduling "continuous"); ``details`` holds
        ``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``kv_unified``; ``cached_prompt_tokens`` with
        ``shared_prefix`` (0 without reuse).

    Raises:
        NotAdmitted: a sequence would exceed the model's training context, the KV pool
            exceeds ``kv_budget_bytes``, llama.cpp refuses the context, or ``llama_decode``
            finds no KV slot (return code 1).
        RuntimeError: any other ``llama_decode`` failure.
        ValueError: bad arguments (concurrency, output_tokens, prefill_chunk < 1).
    """
    if concurrency < 1 or output_tokens < 1 or requests_per_stream < 1 or prefill_chunk < 1:
        raise ValueError("concurrency, output_tokens, requests_per_stream and prefill_chunk must be >= 1")
    L = engine._L
    # prompts made as requests start (LazyPrompts), never a table of concurrency x requests
    # entries; the first sizes the context and is checked before anything is built
    first = [int(t) for t in prompt_for(0, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    engine._check_ids(first)
    prefix = first[:shared_prefix] if shared_prefix else []
    if shared_prefix and len(first) <= shared_prefix:
        raise ValueError(f"every prompt must start with the same {shared_prefix} tokens and have its own part")
    prompts = LazyPrompts(prompt_for, len(first), prefix=prefix or None, check=engine._check_ids)
    reuse = bool(prefix) and reuse_prefix
    ctx, batch, info = _open_context(engine, len(first) + output_tokens, concurrency,
                                     prefill_chunk, kv_budget_bytes, prefix_tokens=len(prefix) if reuse else 0)
    n_ctx, n_ctx_seq, n_batch, pool, kv_per_token = (info[k] for k in ("n_ctx", "n_ctx_seq", "n_batch", "pool",
                                                                        "kv_per_token"))
    vocab = engine.vocab_size
    try:
        mem = L.llama_get_memory(ctx)
        pseq = concurrency  # the prefix's own sequence (reuse only)
        if reuse:  # the system prompt, prefilled once before the clock starts
            for c0 in range(0, len(prefix), n_batch):
                part = prefix[c0:c0 + n_batch]
                for j, t in enumerate(part):
                    _put(batch, j, t, c0 + j, pseq, False)
                batch.n_tokens = len(part)
                if L.llama_decode(ctx, batch) != 0:
                    raise NotAdmitted(f"llama_decode refused the {len(prefix)}-token shared prefix (n_ctx {n_ctx})")
            L.llama_synchronize(ctx)
        cached = 0
        streams = [_Stream(i) for i in range(concurrency)]
        records: list[RequestRecord] = []
        kv_peak = steps = dec_tokens = 0
        dec_s = 0.0

        def begin(s: _Stream, k: int, now: float) -> None:
            nonlocal cached
            s.begin(prompts[(s.idx, k)], now)
            if reuse:
                L.llama_memory_seq_cp(mem, pseq, s.idx, -1, -1)
                s.fed = s.pos = len(prefix)
                cached += len(prefix)

        t0 = time.perf_counter()
        prev = 0.0  # end of the previous step (s since t0): a step's time includes building its batch
        for s in streams:
            begin(s, 0, 0.0)
        while True:
            active = [s for s in streams if not s.done]
            if not active:
                break
            outputs, nxt, prefilling = _decode_step(L, ctx, batch, active, prefill_chunk, vocab, n_ctx)
            now = time.perf_counter() - t0
            steps += 1
            if not prefilling:  # a pure decode step: batched-bench's S_TG counts these
                dec_tokens += len(outputs)
                dec_s += now - prev
            prev = now
            kv_peak = max(kv_peak, sum(s.pos for s in active))
            for s, tok in zip(outputs, nxt):
                s.toks.append(int(tok))
                s.times.append(now)
                if len(s.toks) < output_tokens:
                    continue
                records.append(RequestRecord(s.idx, len(s.prompt), s.start, s.times, s.toks))
                L.llama_memory_seq_rm(mem, s.idx, -1, -1)
                if s.k + 1 < requests_per_stream:
                    begin(s, s.k + 1, now)
                else:
                    s.done = True
        duration = max((r.token_times_s[-1] for r in records), default=0.0)
        if reuse:  # the shared prefix's cells are held once however many streams use them
            kv_peak = max(0, kv_peak - (concurrency - 1) * len(prefix))
        return LoadRun(concurrency=concurrency, scheduling="continuous", requests=records, duration_s=duration,
                       kv_bytes_peak=int(round(kv_peak * kv_per_token)), kv_pool_bytes=pool,
                       decode_step_tokens=dec_tokens, decode_step_s=dec_s, steps=steps,
                       cached_prompt_tokens=cached if shared_prefix else None,
                       details={"n_ctx": int(L.llama_n_ctx(ctx)), "n_ctx_seq": n_ctx_seq, "n_batch": n_batch,
                                "kv_unified": reuse, "prefill_chunk": prefill_chunk})
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def serve_open_loop(engine: Any, prompt_for: PromptFor, *, arrivals: Iterable[float], slots: int, max_waiting: int,
                    timeout_s: float, output_tokens: int, prefill_chunk: int = 256,
                    kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                    max_context: int | None = None, clock: Any = None, stream: int = 0) -> OpenLoopRun:
    """Serve requests arriving at ``arrivals`` from one llama.cpp context of ``slots``
    sequences, with a bounded waiting queue (:class:`~qeval.measure.arrivals.WaitingQueue`:
    admission at every step boundary, refusals, drops after ``timeout_s``). A request that
    gets a place joins the running batch at the next step (continuous batching, chunked
    prefill as in :func:`serve_closed_loop`); when nothing runs and nothing waits, the loop
    idles until the next arrival.

    Args:
        prompt_for: ``(stream, i) -> prompt token ids`` of the i-th arrival.
        arrivals: arrival times, s since the point started (ascending).
        slots: sequences served at once (``n_seq_max``).
        max_waiting, timeout_s: the queue's length limit and longest wait (s).
        output_tokens: new tokens per request (>= 1).
        clock: :class:`~qeval.measure.arrivals.WallClock` (default) or a scripted
            :class:`~qeval.measure.arrivals.StepClock` (tests: each step takes a set time).
        stream: the ``stream`` argument of ``prompt_for`` (distinct per point: fresh prompts).
        kv_bytes_per_token, max_context: the common serve signature; not used.

    Returns:
        :class:`~qeval.measure.openloop.OpenLoopRun` (scheduling "continuous").

    Raises:
        NotAdmitted: as :func:`serve_closed_loop` (context, KV budget, no KV slot).
        ValueError: bad arguments (no arrival, slots / output_tokens / prefill_chunk < 1).
    """
    if slots < 1 or output_tokens < 1 or prefill_chunk < 1:
        raise ValueError("an open-loop point needs arrivals, and slots, output_tokens, prefill_chunk >= 1")
    L = engine._L
    clock = clock or WallClock()
    queue = WaitingQueue(arrivals, max_waiting, timeout_s)
    if queue.next_arrival() is None:
        raise ValueError("an open-loop point needs arrivals, and slots, output_tokens, prefill_chunk >= 1")
    # prompts are made when a request gets a place and dropped when it ends: memory follows the
    # slots, not the schedule; the point's first prompt sizes the context (admitted_prompt)
    first = [int(t) for t in prompt_for(stream, 0)]
    if not first:
        raise ValueError("every prompt needs at least one token")
    engine._check_ids(first)
    ctx, batch, info = _open_context(engine, len(first) + output_tokens, slots, prefill_chunk, kv_budget_bytes)
    vocab = engine.vocab_size
    try:
        mem = L.llama_get_memory(ctx)
        streams = [_Stream(i) for i in range(slots)]
        owner: dict[int, Request] = {}  # stream index -> the request it serves
        records: list[RequestRecord] = []
        kv_peak = steps = 0
        clock.start()
        now = 0.0
        while True:
            free = [s for s in streams if s.idx not in owner]
            for r in queue.admit(now, len(free)):
                s = free.pop(0)
                owner[s.idx] = r
                p = admitted_prompt(prompt_for, stream, r.index, len(first))
                engine._check_ids(p)
                s.begin(p, r.arrival_s)  # TTFT counts from the arrival (queue wait in it)
            active = [s for s in streams if s.idx in owner]
            if not active:
                nxt_t = queue.next_arrival()
                if nxt_t is None:
                    break
                now = clock.idle_until(nxt_t)
                continue
            outputs, nxt, _ = _decode_step(L, ctx, batch, active, prefill_chunk, vocab, info["n_ctx"])
            now = clock.step()
            steps += 1
            kv_peak = max(kv_peak, sum(s.pos for s in active))
            for s, tok in zip(outputs, nxt):
                s.toks.append(int(tok))
                s.times.append(now)
                if len(s.toks) < output_tokens:
                    continue
                r = owner.pop(s.idx)
                r.outcome, r.ended_s = "completed", now
                records.append(RequestRecord(r.index, len(s.prompt), r.arrival_s, s.times, s.toks))
                L.llama_memory_seq_rm(mem, s.idx, -1, -1)
        return OpenLoopRun(requests=queue.requests, completed=records, scheduling="continuous", tally=queue.tally,
                           kv_bytes_peak=int(round(kv_peak * info["kv_per_token"])), kv_pool_bytes=info["pool"],
                           details={"n_ctx": info["n_ctx"], "n_ctx_seq": info["n_ctx_seq"],
                                    "n_batch": info["n_batch"], "slots": slots, "steps": steps,
                                    "prefill_chunk": prefill_chunk})
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def _decode_step(L: Any, ctx: Any, batch: Any, active: Sequence[_Stream], prefill_chunk: int, vocab: int,
                 n_ctx: int) -> tuple[list[_Stream], list[int], bool]:
    """One ``llama_decode`` of the active streams (batch order in the module docstring).
    Returns (the streams that got a token, in row order; their greedy tokens; whether the
    step held prompt tokens).

    Raises:
        NotAdmitted: no KV slot (``llama_decode`` returned 1).
        RuntimeError: any other ``llama_decode`` failure.
    """
    decoding = [s for s in active if s.fed == len(s.prompt)]
    waiting = sorted((s for s in active if s.fed < len(s.prompt)), key=lambda s: (s.start, s.idx))
    n = 0
    outputs: list[_Stream] = []  # in batch order: who gets the row of each requested logit
    for s in decoding:
        _put(batch, n, s.toks[-1], s.pos, s.idx, True)
        s.pos += 1
        n += 1
        outputs.append(s)
    budget = prefill_chunk
    for s in waiting:
        if budget == 0:
            break
        take = min(budget, len(s.prompt) - s.fed)
        for j in range(take):
            last = s.fed + j == len(s.prompt) - 1
            _put(batch, n, s.prompt[s.fed + j], s.pos, s.idx, last)
            s.pos += 1
            n += 1
        s.fed += take
        budget -= take
        if s.fed == len(s.prompt):
            outputs.append(s)
    batch.n_tokens = n
    rc = L.llama_decode(ctx, batch)
    if rc == 1:
        raise NotAdmitted(f"llama_decode found no KV slot for {n} tokens with {len(active)} sequences "
                          f"(n_ctx {n_ctx})")
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, {len(active)} sequences, n_ctx {n_ctx})")
    logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(outputs), vocab))
    return outputs, logits.argmax(axis=1).tolist(), bool(waiting)

def _open_context(engine: Any, longest: int, n_seq: int, prefill_chunk: int,
                  kv_budget_bytes: float | None, prefix_tokens: int = 0) -> tuple[Any, Any, dict]:
    """A llama.cpp context of ``n_seq`` sequences of ``longest`` tokens each (padded to 256
    cells) and a batch of ``n_seq + prefill_chunk`` tokens, warmed up and cleared.
    ``prefix_tokens`` > 0: one more sequence (index ``n_seq``) for a shared prefix and a
    unified KV cache (every sequence draws on one pool: a copied prefix shares its cells),
    ``n_seq`` x the per-sequence cells + the prefix's.
    Returns ``(ctx, batch, info)``; the caller frees both.

    Raises:
        NotAdmitted: beyond the model's training context, a pool over ``kv_budget_bytes``,
            or a context llama.cpp refuses.
    """
    L = engine._L
    if longest > engine.n_ctx_train:
        raise NotAdmitted(f"{longest} tokens per sequence is beyond the model's context of {engine.n_ctx_train}")
    n_ctx_seq = -(-longest // _CTX_ROUND) * _CTX_ROUND
    n_ctx = n_ctx_seq * n_seq + (-(-prefix_tokens // _CTX_ROUND) * _CTX_ROUND if prefix_tokens else 0)
    kv_per_token = engine.kv_bytes_per_token_analytic()
    pool = int(round(kv_per_token * n_ctx))
    if kv_budget_bytes is not None and pool > kv_budget_bytes:
        raise NotAdmitted(f"llama.cpp's KV pool of {n_seq} x {n_ctx_seq} cells = {pool / 2**30:.2f} GiB "
                          f"exceeds the KV budget of {max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
    n_batch = n_seq + prefill_chunk
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = n_seq + (1 if prefix_tokens else 0)
    cp.n_threads = cp.n_threads_batch = engine.threads
    cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k = cp.type_v = engine.type_kv
    # llama.cpp's default (common.h): each sequence owns n_ctx / n_seq_max cells; a shared prefix: one pool
    cp.kv_unified = bool(prefix_tokens)
    cp.embeddings = False
    ctx = L.llama_init_from_model(engine._model, cp)
    if not ctx:
        raise NotAdmitted(f"llama.cpp refused a context of {n_ctx} tokens for {n_seq} sequences")
    batch = L.llama_batch_init(n_batch, 0, 1)
    try:
        _warm_up(L, ctx, batch, engine.vocab_size)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
    except BaseException:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        raise
    return ctx, batch, {"n_ctx": n_ctx, "n_ctx_seq": n_ctx_seq, "n_batch": n_batch, "pool": pool,
                        "kv_per_token": kv_per_token}

def _put(batch: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = tok
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


def _warm_up(L: Any, ctx: Any, batch: Any, vocab: int) -> None:
    """16 tokens of sequence 0 decoded once (as ``llama-batched-bench`` warms up): first-call
    costs (graph allocation, thread pool) stay out of the measured run."""
    n = min(16, int(L.llama_n_batch(ctx)))
    for i in range(n):
        _put(batch, i, (i * 7919) % vocab, i, 0, i == n - 1)
    batch.n_tokens = n
    if L.llama_decode(ctx, batch) != 0:
        raise NotAdmitted("llama_decode failed on the warm-up batch")
    L.llama_synchronize(ctx)
