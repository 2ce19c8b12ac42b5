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

llama-cpp-python's high-level ``Llama`` class was checked: it serves one sequence per
context and hides per-token times, so the loop is written here over ``llama_batch_init``
/ ``llama_decode`` / ``llama_memory_seq_rm``.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from ..measure.load import LoadRun, NotAdmitted, PromptFor, RequestRecord

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
                      max_context: int | None = None) -> LoadRun:
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

    Returns:
        :class:`~qeval.measure.load.LoadRun` (scheduling "continuous"); ``details`` holds
        ``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``kv_unified``.

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
    prompts = {(s, k): [int(t) for t in prompt_for(s, k)] for s in range(concurrency)
               for k in range(requests_per_stream)}
    for p in prompts.values():
        if not p:
            raise ValueError("every prompt needs at least one token")
        engine._check_ids(p)
    longest = max(len(p) for p in prompts.values()) + output_tokens
    if longest > engine.n_ctx_train:
        raise NotAdmitted(f"{longest} tokens per sequence is beyond the model's context of {engine.n_ctx_train}")
    n_ctx_seq = -(-longest // _CTX_ROUND) * _CTX_ROUND
    n_ctx = n_ctx_seq * concurrency
    kv_per_token = engine.kv_bytes_per_token_analytic()
    pool = int(round(kv_per_token * n_ctx))
    if kv_budget_bytes is not None and pool > kv_budget_bytes:
        raise NotAdmitted(f"llama.cpp's KV pool of {concurrency} x {n_ctx_seq} cells = {pool / 2**30:.2f} GiB "
                          f"exceeds the KV budget of {max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
    n_batch = concurrency + prefill_chunk
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = concurrency
    cp.n_threads = cp.n_threads_batch = engine.threads
    cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k = cp.type_v = engine.type_kv
    cp.kv_unified = False  # llama.cpp's default (common.h): each sequence owns n_ctx / n_seq_max cells
    cp.embeddings = False
    ctx = L.llama_init_from_model(engine._model, cp)
    if not ctx:
        raise NotAdmitted(f"llama.cpp refused a context of {n_ctx} tokens for {concurrency} sequences")
    batch = L.llama_batch_init(n_batch, 0, 1)
    vocab = engine.vocab_size
    try:
        mem = L.llama_get_memory(ctx)
        _warm_up(L, ctx, batch, vocab)
        L.llama_memory_clear(mem, True)
        streams = [_Stream(i) for i in range(concurrency)]
        records: list[RequestRecord] = []
        kv_peak = steps = dec_tokens = 0
        dec_s = 0.0
        t0 = time.perf_counter()
        prev = 0.0  # end of the previous step (s since t0): a step's time includes building its batch
        for s in streams:
            s.begin(prompts[(s.idx, 0)], 0.0)
        while True:
            active = [s for s in streams if not s.done]
            if not active:
                break
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
                raise NotAdmitted(f"llama_decode found no KV slot for {n} tokens with {concurrency} sequences "
                                  f"(n_ctx {n_ctx})")
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, {concurrency} sequences, n_ctx {n_ctx})")
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(outputs), vocab))
            nxt = logits.argmax(axis=1).tolist()
            now = time.perf_counter() - t0
            steps += 1
            if not waiting:  # a pure decode step: batched-bench's S_TG counts these
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
                    s.begin(prompts[(s.idx, s.k + 1)], now)
                else:
                    s.done = True
        duration = max((r.token_times_s[-1] for r in records), default=0.0)
        return LoadRun(concurrency=concurrency, scheduling="continuous", requests=records, duration_s=duration,
                       kv_bytes_peak=int(round(kv_peak * kv_per_token)), kv_pool_bytes=pool,
                       decode_step_tokens=dec_tokens, decode_step_s=dec_s, steps=steps,
                       details={"n_ctx": int(L.llama_n_ctx(ctx)), "n_ctx_seq": n_ctx_seq, "n_batch": n_batch,
                                "kv_unified": False, "prefill_chunk": prefill_chunk})
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


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
