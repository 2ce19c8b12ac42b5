"""One long prompt landing mid-decode on transformers in process, at a given prefill chunk size.

The transformers counterpart of :mod:`qeval.engines.llamacpp_interference`, with the same
:class:`~qeval.engines.llamacpp_interference.InterferenceRun` for
:func:`qeval.measure.interference.interference_stats`. ``streams`` prompts (one length) decode
as one static batch over the tier's own cache (one token each per step); once every stream
has ``before_tokens`` new tokens, the long prompt arrives and is prefilled ``chunk_size``
tokens per step into its own cache, each step being the streams' decode forward followed by
one chunk forward (transformers has no ragged batch that fuses a prefill chunk with other
sequences' decode in one forward outside its continuous-batching manager, whose steps are
not exposed); ``chunk_size`` None runs the whole prompt in one forward. Every token of a step
is stamped with the host time at the step's end, so a stream's gap in the window is its
decode plus the chunk beside it.

Greedy only; end-of-sequence ignored. transformers' ``ContinuousBatchingManager`` was checked:
it does chunk prefills beside decodes but gives no per-step control of when a prompt
arrives, so the loop is written here (as :mod:`qeval.engines.hf_load`'s static batches).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from .llamacpp_interference import InterferenceRun


def serve_with_long_prompt(engine: Any, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                           chunk_size: int | None, before_tokens: int = 4, after_tokens: int = 4) -> InterferenceRun:
    """Run the streams and the long prompt (module docstring) on a
    :class:`qeval.engines.hf.HFEngine`.

    Args:
        stream_prompts: one prompt per running stream, all of one length (prefilled untimed).
        long_prompt: the long prompt's token ids.
        chunk_size: its tokens per step (>= 1), or None for the whole prompt in one forward.
        before_tokens: new tokens every stream has when the long prompt arrives (>= 2).
        after_tokens: steps the streams decode after the long prompt's first token (>= 1).

    Returns:
        :class:`~qeval.engines.llamacpp_interference.InterferenceRun` (``steps``: loop steps;
        ``long_steps``: those that ran a chunk of the long prompt; ``details["forwards"]``).

    Raises:
        ValueError: no streams, an empty prompt, stream prompts of different lengths,
            ``chunk_size`` < 1, ``before_tokens`` < 2 or ``after_tokens`` < 1.
    """
    import torch  # start-up time: torch loads only in stage processes
    prompts = [[int(t) for t in p] for p in stream_prompts]
    long = [int(t) for t in long_prompt]
    if not prompts or any(not p for p in prompts) or not long:
        raise ValueError("at least one stream, and no empty prompt")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the stream prompts must have one length (one static batch, no padding)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be >= 1 (None: the whole prompt in one step)")
    if before_tokens < 2 or after_tokens < 1:
        raise ValueError("before_tokens must be >= 2 and after_tokens >= 1")
    model, dev, kw = engine.model, engine.device, engine._cache_kw
    n = len(prompts)
    chunk = len(long) if chunk_size is None else min(chunk_size, len(long))
    forwards = 0

    def forward(ids: Any, cache: Any) -> Any:
        nonlocal forwards
        forwards += 1
        return model(input_ids=ids, **{kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

    with torch.inference_mode():
        cache = engine.new_cache()
        nxt = forward(torch.tensor(prompts, dtype=torch.long, device=dev), cache)  # untimed: already decoding
        toks: list[list[int]] = [[t] for t in nxt.tolist()]
        times: list[list[float]] = [[] for _ in range(n)]
        lcache = engine.new_cache()
        lids = torch.tensor([long], dtype=torch.long, device=dev)
        fed = 0
        arrival = first = None
        first_tok = -1
        steps = long_steps = after = 0
        t0 = time.perf_counter()
        while True:
            nxt = forward(nxt[:, None], cache)
            took = 0
            lt = None
            if arrival is not None and first is None:
                take = min(chunk, len(long) - fed)
                lt = forward(lids[:, fed:fed + take], lcache)
                fed += take
                took = take
            row = nxt.tolist()  # the host copy synchronises CUDA too
            lfirst = int(lt[0]) if lt is not None and fed == len(long) else None
            now = time.perf_counter() - t0
            steps += 1
            long_steps += took > 0
            for s in range(n):
                toks[s].append(int(row[s]))
                times[s].append(now)
            if lfirst is not None:
                first, first_tok = now, lfirst
            elif first is not None:
                after += 1
                if after >= after_tokens:
                    break
            if arrival is None and all(len(t) >= before_tokens for t in times):
                arrival = now
    return InterferenceRun(chunk_size=chunk_size, stream_times=times, stream_tokens=[t[1:] for t in toks],
                           arrival_s=float(arrival), first_token_s=float(first), long_first_token=first_tok,
                           long_prompt_tokens=len(long), steps=steps, long_steps=long_steps,
                           details={"streams": n, "forwards": forwards, "engine": "qeval (transformers cache)"})
