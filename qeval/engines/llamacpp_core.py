"""The llama.cpp engine core: one context serving ``slots`` sequences with continuous batching,
driven through llama-cpp-python's low-level API the way llama.cpp's own ``llama-server``
(``tools/server/server-context.cpp``, ``update_slots``) and ``llama-batched-bench`` drive it.
Every workload of :mod:`qeval.serving` runs on it (:class:`qeval.serving.core.EngineCore`).

One context per core with ``n_seq_max = slots`` and a KV pool of ``slots`` x (the spec's
longest sequence, padded to 256 cells) (llama.cpp's default non-unified cache: each sequence
owns ``n_ctx / n_seq_max`` cells). Every :meth:`LlamaCore.step` is one ``llama_decode`` of one
``llama_batch`` that holds, in this order:

1. one token for every request that is decoding (its last greedy token, at its next position,
   logits requested), as the server puts each generating slot's sampled token first;
2. up to ``prefill_chunk`` prompt tokens of the requests waiting for their prefill, oldest
   first (chunked prefill: a long prompt takes several steps, each shared with the others'
   decode; a request's own ``prefill_chunk`` caps its share), logits requested only for a
   prompt's last token.

After the decode the logits of the requested rows (contiguous, in batch order:
``llama_get_logits``) are reduced by argmax in numpy, and every token of that step is stamped
with the workload clock's ``step()``. A released request's cells are dropped with
``llama_memory_seq_rm(mem, seq, -1, -1)``. Greedy only; end-of-sequence ignored.

A shared prefix (:meth:`LlamaCore.cache_prefix`) is prefilled once into its own sequence of a
**unified** KV cache (``kv_unified``: one pool of cells for every sequence), and a request
submitted with ``prefix=True`` starts as a copy of it: ``llama_memory_seq_cp(mem, src, dst,
-1, -1)`` copies no K/V data on a unified cache (llama.cpp ``llama_kv_cache::seq_cp``, same
stream: metadata only), so the prefix's KV is held once however many requests share it, as
llama-server's slots keep a cached prompt.

llama-cpp-python's high-level ``Llama`` class was checked: it serves one sequence per context,
reuses only the longest common prefix of that one sequence and hides per-token times, so the
loop is written here over ``llama_batch_init`` / ``llama_decode`` / ``llama_memory_seq_cp`` /
``llama_memory_seq_rm``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..serving.core import CoreSpec, CoreStats, NotAdmitted, TokenEvent

_CTX_ROUND = 256  # llama.cpp pads the per-sequence context to 256 cells (GGML_PAD(n_ctx_seq, 256))


class _Seq:
    """One sequence of the context and the request it serves (None: free)."""
    __slots__ = ("idx", "rid", "prompt", "fed", "pos", "toks", "order", "max_new", "chunk", "cached", "done")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.rid: int | None = None

    def begin(self, rid: int, prompt: list[int], max_new: int, order: int, pos0: int, chunk: int | None) -> None:
        self.rid, self.prompt, self.max_new, self.order, self.chunk = rid, prompt, max_new, order, chunk
        self.fed = 0          # prompt tokens already in the cache
        self.pos = pos0       # next position of this sequence (after a copied prefix: its length)
        self.cached = pos0
        self.toks: list[int] = []
        self.done = False


def _put(batch: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = tok
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


class LlamaCore:
    """The core of a loaded :class:`qeval.engines.llamacpp.LlamaCppEngine` (its model, threads,
    KV type and flash-attention setting are used; its own context is left alone).

    Args:
        engine: the engine.
        spec: :class:`~qeval.serving.core.CoreSpec` (slots, longest sequence, prefill chunk,
            a shared prefix's length, the KV budget).
        clock: the workload's clock (``step()`` after every ``llama_decode``).

    Raises:
        NotAdmitted: a sequence beyond the model's training context, a KV pool over the
            spec's ``kv_budget_bytes`` (llama.cpp allocates its whole pool), or a context
            llama.cpp refuses.
    """

    controls_steps = True
    scheduling = "continuous"

    def __init__(self, engine: Any, spec: CoreSpec, clock: Any) -> None:
        L = self._L = engine._L
        self.engine, self.spec, self.clock = engine, spec, clock
        self.slots = spec.slots
        longest = spec.max_seq_tokens + spec.prefix_tokens
        if longest > engine.n_ctx_train:
            raise NotAdmitted(f"{longest} tokens per sequence is beyond the model's context of {engine.n_ctx_train}")
        self.budget = int(spec.prefill_chunk or longest)
        n_seq = spec.slots
        n_ctx_seq = -(-longest // _CTX_ROUND) * _CTX_ROUND
        pre = spec.prefix_tokens
        n_ctx = n_ctx_seq * n_seq + (-(-pre // _CTX_ROUND) * _CTX_ROUND if pre else 0)
        self.kv_per_token = engine.kv_bytes_per_token_analytic()
        self.pool = int(round(self.kv_per_token * n_ctx))
        if spec.kv_budget_bytes is not None and self.pool > spec.kv_budget_bytes:
            raise NotAdmitted(f"llama.cpp's KV pool of {n_seq} x {n_ctx_seq} cells = {self.pool / 2**30:.2f} GiB "
                              f"exceeds the KV budget of {max(spec.kv_budget_bytes, 0) / 2**30:.2f} GiB")
        self.kv_pool_tokens = n_ctx
        self.n_batch = n_seq + self.budget
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = self.n_batch  # n_ubatch = n_batch: one llama_decode is one graph compute
        cp.n_seq_max = n_seq + (1 if pre else 0)
        cp.n_threads = cp.n_threads_batch = engine.threads
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.type_k = cp.type_v = engine.type_kv
        # llama.cpp's default (common.h): each sequence owns n_ctx / n_seq_max cells; a shared prefix: one pool
        cp.kv_unified = bool(pre)
        cp.embeddings = False
        self._ctx = L.llama_init_from_model(engine._model, cp)
        if not self._ctx:
            raise NotAdmitted(f"llama.cpp refused a context of {n_ctx} tokens for {n_seq} sequences")
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._mem = L.llama_get_memory(self._ctx)
        self.n_ctx, self.n_ctx_seq = n_ctx, n_ctx_seq
        try:
            self._warm_up()
            L.llama_memory_clear(self._mem, True)
        except BaseException:
            self.close()
            raise
        self._seqs = [_Seq(i) for i in range(n_seq)]
        self._by_rid: dict[int, _Seq] = {}
        self._order = 0
        self._prefix: list[int] = []
        self._stats = CoreStats(kv_pool_bytes=self.pool)
        self._kv_peak = 0
        self._prev: float | None = None

    # -- set-up --------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        """16 tokens of sequence 0 decoded once (as ``llama-batched-bench`` warms up): first-call
        costs (graph allocation, thread pool) stay out of the measured run."""
        L, vocab = self._L, self.engine.vocab_size
        n = min(16, int(L.llama_n_batch(self._ctx)))
        for i in range(n):
            _put(self._batch, i, (i * 7919) % vocab, i, 0, i == n - 1)
        self._batch.n_tokens = n
        if L.llama_decode(self._ctx, self._batch) != 0:
            raise NotAdmitted("llama_decode failed on the warm-up batch")
        L.llama_synchronize(self._ctx)

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Prefill ``ids`` once into the prefix's own sequence (index ``slots``), untimed.

        Raises:
            ValueError: the core was not opened for a prefix of this length, or bad ids.
            NotAdmitted: llama.cpp refused the prefix.
        """
        prefix = [int(t) for t in ids]
        if not prefix or len(prefix) != self.spec.prefix_tokens:
            raise ValueError(f"the core was opened for a prefix of {self.spec.prefix_tokens} tokens, "
                             f"not {len(prefix)}")
        self.engine._check_ids(prefix)
        L, pseq, step = self._L, self.slots, self.n_batch
        for c0 in range(0, len(prefix), step):
            part = prefix[c0:c0 + step]
            for j, t in enumerate(part):
                _put(self._batch, j, t, c0 + j, pseq, False)
            self._batch.n_tokens = len(part)
            if L.llama_decode(self._ctx, self._batch) != 0:
                raise NotAdmitted(f"llama_decode refused the {len(prefix)}-token shared prefix (n_ctx {self.n_ctx})")
        L.llama_synchronize(self._ctx)
        self._prefix = prefix

    # -- the interface -------------------------------------------------------------------------
    def free(self) -> int:
        """Sequences without a request (a request joins the running batch at the next step)."""
        return sum(1 for s in self._seqs if s.rid is None)

    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        """Give request ``rid`` a free sequence; with ``prefix`` it starts as a copy of the cached
        prefix's and ``prompt`` is its own part. ``timeout_s`` is not used (qeval's queue times
        out waiting requests).

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, a request longer than the
                spec's sequences, no free sequence, ``prefix`` without a cached prefix, or a
                ``rid`` already running."""
        p = [int(t) for t in prompt]
        if not p or max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_new_tokens >= 1")
        self.engine._check_ids(p)
        if len(p) + max_new_tokens > self.spec.max_seq_tokens:
            raise ValueError(f"{len(p)} prompt + {max_new_tokens} new tokens exceed the core's sequences of "
                             f"{self.spec.max_seq_tokens}")
        if prefix and not self._prefix:
            raise ValueError("prefix=True needs cache_prefix first")
        if rid in self._by_rid:
            raise ValueError(f"request {rid} is already running")
        seq = next((s for s in self._seqs if s.rid is None), None)
        if seq is None:
            raise ValueError(f"no free sequence (slots {self.slots})")
        pos0 = len(self._prefix) if prefix else 0
        if prefix:
            self._L.llama_memory_seq_cp(self._mem, self.slots, seq.idx, -1, -1)
        seq.begin(rid, p, int(max_new_tokens), self._order, pos0, prefill_chunk)
        self._order += 1
        self._by_rid[rid] = seq

    def release(self, rid: int) -> None:
        """Drop the request's cells and free its sequence (idempotent)."""
        seq = self._by_rid.pop(rid, None)
        if seq is not None:
            self._L.llama_memory_seq_rm(self._mem, seq.idx, -1, -1)
            seq.rid = None

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """One ``llama_decode`` (module docstring); [] when no request runs.

        Raises:
            NotAdmitted: no KV slot (``llama_decode`` returned 1).
            RuntimeError: any other ``llama_decode`` failure."""
        active = [s for s in self._seqs if s.rid is not None and not s.done]
        if not active:
            return []
        L, batch = self._L, self._batch
        decoding = [s for s in active if s.fed == len(s.prompt)]
        waiting = sorted((s for s in active if s.fed < len(s.prompt)), key=lambda s: (s.order, s.idx))
        n = 0
        outputs: list[_Seq] = []  # in batch order: who gets the row of each requested logit
        for s in decoding:
            _put(batch, n, s.toks[-1], s.pos, s.idx, True)
            s.pos += 1
            n += 1
            outputs.append(s)
        budget = self.budget
        for s in waiting:
            if budget == 0:
                break
            take = min(budget, len(s.prompt) - s.fed, s.chunk or budget)
            for j in range(take):
                _put(batch, n, s.prompt[s.fed + j], s.pos, s.idx, s.fed + j == len(s.prompt) - 1)
                s.pos += 1
                n += 1
            s.fed += take
            budget -= take
            if s.fed == len(s.prompt):
                outputs.append(s)
        batch.n_tokens = n
        rc = L.llama_decode(self._ctx, batch)
        if rc == 1:
            raise NotAdmitted(f"llama_decode found no KV slot for {n} tokens with {len(active)} sequences "
                              f"(n_ctx {self.n_ctx})")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, {len(active)} sequences, n_ctx {self.n_ctx})")
        logits = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(len(outputs), self.engine.vocab_size))
        nxt = logits.argmax(axis=1).tolist()
        t = self.clock.step()
        st = self._stats
        st.steps += 1
        if not waiting:  # a pure decode step: batched-bench's S_TG counts these
            st.decode_step_tokens += len(outputs)
            st.decode_step_s += t - (self._prev if self._prev is not None else 0.0)
        self._prev = t
        shared = sum(1 for s in active if s.cached)  # a copied prefix's cells are held once
        self._kv_peak = max(self._kv_peak, sum(s.pos for s in active) - max(shared - 1, 0) * len(self._prefix))
        events = []
        for s, tok in zip(outputs, nxt):
            s.toks.append(int(tok))
            done = len(s.toks) >= s.max_new
            s.done = done
            events.append(TokenEvent(s.rid, [int(tok)], [t], done=done, cached_tokens=s.cached if done else None))
        return events

    def stats(self) -> CoreStats:
        """Steps, pure-decode steps' tokens and seconds, the KV pool and its fullest step."""
        st = self._stats
        st.kv_bytes_peak = int(round(self._kv_peak * self.kv_per_token))
        st.details = {"n_ctx": int(self._L.llama_n_ctx(self._ctx)) if self._ctx else self.n_ctx,
                      "n_ctx_seq": self.n_ctx_seq, "n_batch": self.n_batch, "kv_unified": bool(self.spec.prefix_tokens)}
        return st

    def close(self) -> None:
        """Free the context and batch (idempotent)."""
        if getattr(self, "_batch", None) is not None:
            self._L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            self._L.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "LlamaCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
