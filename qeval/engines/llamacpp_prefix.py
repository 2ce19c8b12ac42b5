"""Prefix KV reuse on llama.cpp in process: a shared prefix (a system prompt, a RAG
template) prefilled once into one sequence, and every request's sequence started from a
copy of it, so only the request's own part is prefilled.

This is what llama.cpp's own server does for a shared prompt (``tools/server``: a slot
whose cached prompt shares a prefix with the new one keeps those cells, and
``llama_memory_seq_cp`` shares cells between sequences), written over llama-cpp-python's
low-level API (checked in 0.3.x: ``llama_memory_seq_cp(mem, src, dst, p0, p1)``,
``llama_memory_seq_rm``). The high-level ``Llama`` class was checked too: it reuses the
longest common prefix of *its one* sequence only (``Llama.generate``'s prefix match), so N
requests sharing one prefix cannot be served from one prefill with it.

Layout: one context with ``n_seq_max = slots + 1`` and a **unified** KV cache
(``kv_unified``: every sequence draws on one pool of cells). Sequence 0 holds the prefix;
request slot ``i`` is sequence ``i + 1``. With a unified cache ``llama_memory_seq_cp(mem, 0,
seq, -1, -1)`` copies no K/V data: it tags the prefix's cells as belonging to ``seq`` too
(llama.cpp ``llama_kv_cache::seq_cp``, same stream: metadata only), so the prefix's KV is
held once however many requests share it. A request's cells are dropped with
``llama_memory_seq_rm(mem, seq, -1, -1)``; cells still tagged with sequence 0 stay.

Greedy only (argmax of the logits, as :mod:`qeval.engines.llamacpp`). Each request counts
its prompt tokens and those served from the cache (:class:`PrefixStats`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

_CTX_ROUND = 256  # llama.cpp pads a context to 256 cells


@dataclass
class PrefixStats:
    """Prompt tokens of the requests served so far, and how many came from the cache.

    Attributes:
        requests: requests served.
        prompt_tokens: prompt tokens over all requests (prefix + own part each).
        cached_tokens: prompt tokens served from the reused prefix (not prefilled again).
    """
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def cached_share(self) -> float | None:
        """cached_tokens / prompt_tokens (0..1); None before any request."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class LlamaPrefixCache:
    """A llama.cpp context holding one shared prefix and ``slots`` request sequences.

    Args:
        engine: a loaded :class:`qeval.engines.llamacpp.LlamaCppEngine` (its model,
            threads, KV type and flash-attention setting; its own context is left alone).
        prefix_ids: the shared prefix's token ids (at least one).
        slots: requests held at once (sequences besides the prefix's).
        max_request_tokens: the most tokens one request adds after the prefix (its own
            part + new tokens); sizes the pool: ``prefix + slots x max_request_tokens``
            cells, rounded up to 256.
        n_batch: prompt tokens per ``llama_decode`` (chunked prefill); default the engine's.

    Raises:
        ValueError: an empty prefix, ``slots`` or ``max_request_tokens`` < 1, a token id
            outside the vocabulary, or a sequence beyond the model's training context.
        RuntimeError: llama.cpp refuses the context or a decode.
    """

    def __init__(self, engine: Any, prefix_ids: Sequence[int], *, slots: int = 1, max_request_tokens: int,
                 n_batch: int | None = None) -> None:
        L = engine._L
        self._L = L
        self.engine = engine
        self.prefix = [int(t) for t in prefix_ids]
        if not self.prefix or slots < 1 or max_request_tokens < 1:
            raise ValueError("a prefix of at least one token, slots >= 1 and max_request_tokens >= 1 are needed")
        engine._check_ids(self.prefix)
        if len(self.prefix) + max_request_tokens > engine.n_ctx_train:
            raise ValueError(f"{len(self.prefix) + max_request_tokens} tokens per sequence is beyond the model's "
                             f"context of {engine.n_ctx_train}")
        self.slots = slots
        self.max_request_tokens = max_request_tokens
        self.n_batch = int(n_batch or engine.n_batch)
        self.vocab = engine.vocab_size
        need = len(self.prefix) + slots * max_request_tokens
        cp = L.llama_context_default_params()
        cp.n_ctx = -(-need // _CTX_ROUND) * _CTX_ROUND
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = slots + 1
        cp.n_threads = cp.n_threads_batch = engine.threads
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.type_k = cp.type_v = engine.type_kv
        cp.kv_unified = True  # one pool: a copied prefix shares its cells (seq_cp is metadata only)
        cp.embeddings = False
        self._ctx = L.llama_init_from_model(engine._model, cp)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp refused a context of {cp.n_ctx} tokens for {slots + 1} sequences")
        self._batch = L.llama_batch_init(max(self.n_batch, 1), 0, 1)
        self._mem = L.llama_get_memory(self._ctx)
        self.stats = PrefixStats()
        self.steps = 0  # llama_decode calls
        self._prefill(self.prefix, 0, 0)  # the prefix, once, into sequence 0

    # -- decoding --------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int], pos0: int, seq: int, last_logits: bool) -> None:
        b = self._batch
        for i, t in enumerate(ids):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = last_logits and i == len(ids) - 1
        b.n_tokens = len(ids)
        rc = self._L.llama_decode(self._ctx, b)
        self.steps += 1
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({len(ids)} tokens of sequence {seq} at {pos0})")

    def _prefill(self, ids: Sequence[int], pos0: int, seq: int) -> None:
        """``ids`` at positions ``pos0..`` of ``seq`` in chunks of ``n_batch``; the last
        token's logits kept."""
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            self._decode(chunk, pos0 + s, seq, s + len(chunk) == len(ids))

    def _argmax(self) -> int:
        row = np.ctypeslib.as_array(self._L.llama_get_logits_ith(self._ctx, -1), shape=(self.vocab,))
        return int(np.argmax(row))

    # -- requests --------------------------------------------------------------------------
    def generate(self, own_ids: Sequence[int], max_new_tokens: int, *, slot: int = 0, reuse: bool = True,
                 stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy answer to ``prefix + own_ids`` in request slot ``slot``.

        ``reuse``: the slot's sequence starts as a copy of the prefix's
        (``llama_memory_seq_cp``) and only ``own_ids`` are prefilled; otherwise the whole
        prompt is prefilled (a fresh prefill, for comparison). The slot's cells are dropped
        afterwards. Counts the request in :attr:`stats`.

        Returns:
            the new token ids (up to and including a stop token, at most ``max_new_tokens``).

        Raises:
            ValueError: an empty own part, a request longer than ``max_request_tokens``, a
                slot out of range, or a token id outside the vocabulary.
            RuntimeError: a decode fails.
        """
        own = [int(t) for t in own_ids]
        if not own or max_new_tokens < 1:
            raise ValueError("a request needs at least one own token and max_new_tokens >= 1")
        if len(own) + max_new_tokens > self.max_request_tokens:
            raise ValueError(f"{len(own)} own tokens + {max_new_tokens} new exceed max_request_tokens "
                             f"{self.max_request_tokens}")
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range (0..{self.slots - 1})")
        self.engine._check_ids(own)
        L, seq, p = self._L, slot + 1, len(self.prefix)
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        if reuse:
            L.llama_memory_seq_cp(self._mem, 0, seq, -1, -1)
            self._prefill(own, p, seq)
        else:
            self._prefill(self.prefix + own, 0, seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += p + len(own)
        self.stats.cached_tokens += p if reuse else 0
        stop = {int(t) for t in stop_ids}
        out = [self._argmax()]
        pos = p + len(own)
        while len(out) < max_new_tokens and out[-1] not in stop:
            self._decode([out[-1]], pos, seq, True)
            pos += 1
            out.append(self._argmax())
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return out

    def cells_of(self, seq: int) -> int:
        """Positions held by sequence ``seq`` (``llama_memory_seq_pos_max + 1``; 0 when empty)."""
        return int(self._L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def close(self) -> None:
        """Free the context and batch (idempotent)."""
        if getattr(self, "_batch", None) is not None:
            self._L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            self._L.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "LlamaPrefixCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
