"""One long prompt landing mid-decode on llama.cpp in process, at a given prefill chunk size.

``streams`` sequences decode (one token each per step, as
:mod:`qeval.engines.llamacpp_load` batches them); once every one has ``before_tokens`` new
tokens, a long prompt arrives in its own sequence and is prefilled ``chunk_size`` tokens
per step, each step shared with the streams' decode (chunked prefill, as llama.cpp's server
fills a batch up to ``n_batch``); ``chunk_size`` None puts the whole prompt in one step
(one ``llama_decode`` with ``n_batch = n_ubatch`` large enough: one graph compute). After
the long prompt's first token the streams decode ``after_tokens`` more steps. Every token
a step produces is stamped with the host time at the step's end.

The timelines feed :func:`qeval.measure.interference.interference_stats`. Greedy only;
end-of-sequence ignored. Written over llama-cpp-python's low-level API for the reasons
:mod:`qeval.engines.llamacpp_load` gives (the high-level ``Llama`` serves one sequence).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

_CTX_ROUND = 256  # llama.cpp pads a sequence's cells to 256


@dataclass
class InterferenceRun:
    """What :func:`serve_with_long_prompt` returns (times in seconds since the loop began).

    Attributes:
        chunk_size: prompt tokens of the long request per step (None: all in one step).
        stream_times: per stream, when each of its new tokens became known.
        stream_tokens: per stream, the ids of the tokens in ``stream_times`` (the one its
            untimed prefill produced left out).
        arrival_s: when the long prompt arrived (the end of the step that gave every stream
            ``before_tokens`` tokens).
        first_token_s: when the long prompt's first new token became known.
        long_first_token: that token's id.
        long_prompt_tokens: the long prompt's length.
        steps: ``llama_decode`` calls of the timed loop.
        long_steps: steps that held tokens of the long prompt.
        details: ``n_ctx``, ``n_batch``, ``streams``.
    """
    chunk_size: int | None
    stream_times: list[list[float]]
    stream_tokens: list[list[int]]
    arrival_s: float
    first_token_s: float
    long_first_token: int
    long_prompt_tokens: int
    steps: int
    long_steps: int
    details: dict = field(default_factory=dict)


def serve_with_long_prompt(engine: Any, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                           chunk_size: int | None, before_tokens: int = 4, after_tokens: int = 4) -> InterferenceRun:
    """Run the streams and the long prompt (module docstring) on one llama.cpp context.

    Args:
        engine: a loaded :class:`qeval.engines.llamacpp.LlamaCppEngine` (model, threads,
            KV type, flash attention; its own context is left alone).
        stream_prompts: one prompt per running stream (token ids; prefilled before the
            timed loop).
        long_prompt: the long prompt's token ids.
        chunk_size: its tokens per step (>= 1), or None for the whole prompt in one step.
        before_tokens: new tokens every stream has when the long prompt arrives (>= 2, so
            each has a gap before the window).
        after_tokens: steps the streams decode after the long prompt's first token (>= 1).

    Returns:
        :class:`InterferenceRun`.

    Raises:
        ValueError: no streams, an empty prompt, ``chunk_size`` < 1, ``before_tokens`` < 2,
            ``after_tokens`` < 1, a token id outside the vocabulary, or a sequence beyond the
            model's training context.
        RuntimeError: llama.cpp refuses the context or a decode.
    """
    L = engine._L
    prompts = [[int(t) for t in p] for p in stream_prompts]
    long = [int(t) for t in long_prompt]
    if not prompts or any(not p for p in prompts) or not long:
        raise ValueError("at least one stream, and no empty prompt")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be >= 1 (None: the whole prompt in one step)")
    if before_tokens < 2 or after_tokens < 1:
        raise ValueError("before_tokens must be >= 2 and after_tokens >= 1")
    for p in prompts + [long]:
        engine._check_ids(p)
    n = len(prompts)
    chunk = len(long) if chunk_size is None else min(chunk_size, len(long))
    # a stream decodes at most: before + the long prefill's steps + after
    most_steps = before_tokens + -(-len(long) // chunk) + after_tokens + 1
    per_seq = max(max(len(p) for p in prompts) + most_steps, len(long) + 1)
    if per_seq > engine.n_ctx_train:
        raise ValueError(f"{per_seq} tokens per sequence is beyond the model's context of {engine.n_ctx_train}")
    n_ctx_seq = -(-per_seq // _CTX_ROUND) * _CTX_ROUND
    n_batch = max(n + chunk, max(len(p) for p in prompts))
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx_seq * (n + 1)
    cp.n_batch = cp.n_ubatch = n_batch  # n_ubatch = n_batch: one llama_decode is one graph compute
    cp.n_seq_max = n + 1
    cp.n_threads = cp.n_threads_batch = engine.threads
    cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if engine.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k = cp.type_v = engine.type_kv
    cp.kv_unified = False
    cp.embeddings = False
    ctx = L.llama_init_from_model(engine._model, cp)
    if not ctx:
        raise RuntimeError(f"llama.cpp refused a context of {cp.n_ctx} tokens for {n + 1} sequences")
    batch = L.llama_batch_init(n_batch, 0, 1)
    vocab = engine.vocab_size

    def put(i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def decode(k: int, rows: int) -> np.ndarray:
        """One ``llama_decode`` of the batch's first ``k`` tokens; the ``rows`` logit rows kept."""
        batch.n_tokens = k
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({k} tokens, {n + 1} sequences)")
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, vocab))

    try:
        toks: list[list[int]] = [[] for _ in range(n)]
        times: list[list[float]] = [[] for _ in range(n)]
        pos = [len(p) for p in prompts]
        for s, p in enumerate(prompts):  # untimed: the streams are decoding when the loop starts
            for j, t in enumerate(p):
                put(j, t, j, s, j == len(p) - 1)
            toks[s].append(int(decode(len(p), 1)[0].argmax()))
        L.llama_synchronize(ctx)
        fed = 0
        arrival = first = None
        first_tok = -1
        steps = long_steps = after = 0
        t0 = time.perf_counter()
        while True:
            k = 0
            for s in range(n):
                put(k, toks[s][-1], pos[s], s, True)
                pos[s] += 1
                k += 1
            took = 0
            if arrival is not None and first is None:
                take = min(chunk, len(long) - fed)
                for j in range(take):
                    put(k, long[fed + j], fed + j, n, fed + j == len(long) - 1)
                    k += 1
                fed += take
                took = take
            rows = decode(k, n + int(took > 0 and fed == len(long)))
            now = time.perf_counter() - t0
            steps += 1
            long_steps += took > 0
            nxt = rows.argmax(axis=1).tolist()
            for s in range(n):
                toks[s].append(int(nxt[s]))
                times[s].append(now)
            if took and fed == len(long):
                first, first_tok = now, int(nxt[n])
            elif first is not None:
                after += 1
                if after >= after_tokens:
                    break
            if arrival is None and all(len(t) >= before_tokens for t in times):
                arrival = now
        return InterferenceRun(chunk_size=chunk_size, stream_times=times, stream_tokens=[t[1:] for t in toks],
                               arrival_s=float(arrival), first_token_s=float(first), long_first_token=first_tok,
                               long_prompt_tokens=len(long), steps=steps, long_steps=long_steps,
                               details={"n_ctx": int(L.llama_n_ctx(ctx)), "n_batch": n_batch, "streams": n})
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
