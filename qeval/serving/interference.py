"""Interference: one long prompt landing among streams that are decoding, at a prefill chunk
size, on any engine core; the stall figures come from :mod:`qeval.measure.interference`.

N streams are submitted and decode (their prefill runs before the measured part: a stream's
first token, from its prefill, is left out of its timeline). Once every stream has
``before_tokens`` new tokens, the long prompt arrives with its own prefill chunk
(``chunk_size`` tokens per step; None: the whole prompt in one step) and the loop runs until
its first token and ``after_tokens`` steps after it. On an in-process core each step is one
engine step shared by the streams' decode and a chunk of the long prompt (llama.cpp: one
``llama_decode`` of both; transformers: the streams' batch forward and the chunk's forward),
and every token of a step is stamped at its end; on a served core the server schedules the
prompt as its own batch setting says (llama-server ``--ubatch-size``, vLLM
``--max-num-batched-tokens``), measured as the server runs it, the chunk size recorded and not
applied (a server's chunk is its start-up setting).

Libraries checked: vLLM bench, GuideLLM, AIPerf and inference-perf report per-request ITL
over a whole run, not gaps within a window set by another request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..measure.arrivals import WallClock
from ..measure.interference import interference_stats
from ..measure.load import NotAdmitted
from .closed_loop import oom_types
from .core import CoreSpec, can_serve, open_core
from .workload import ServingContext, Workload


@dataclass
class InterferenceRun:
    """What :func:`long_prompt_run` returns (times in seconds on the run's clock).

    Attributes:
        chunk_size: prompt tokens of the long request per step (None: all in one step).
        stream_times: per stream, when each of its new tokens became known.
        stream_tokens: per stream, the ids of the tokens in ``stream_times`` (the one its
            prefill produced left out).
        arrival_s: when the long prompt arrived (the end of the step that gave every stream
            ``before_tokens`` tokens).
        first_token_s: when the long prompt's first new token became known.
        long_first_token: that token's id.
        long_prompt_tokens: the long prompt's length.
        steps: steps once every stream was decoding.
        long_steps: steps from the long prompt's arrival to its first token (those that held
            its prompt tokens, in process).
        details: the core's details and ``streams``.
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


def long_prompt_run(engine: Any, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                    chunk_size: int | None, before_tokens: int = 4, after_tokens: int = 4,
                    kv_bytes_per_token: float | None = None, clock: Any = None) -> InterferenceRun:
    """Run the streams and the long prompt (module docstring) on ``engine``'s core.

    Args:
        stream_prompts: one prompt per running stream (token ids).
        long_prompt: the long prompt's token ids.
        chunk_size: its tokens per step (>= 1), or None for the whole prompt in one step.
        before_tokens: new tokens every stream has when the long prompt arrives (>= 2, so each
            has a gap before the window).
        after_tokens: steps the streams decode after the long prompt's first token (>= 1).
        kv_bytes_per_token: the tier's KV bytes per token (passed to the core).
        clock: :class:`~qeval.measure.arrivals.WallClock` (default) or a scripted
            :class:`~qeval.measure.arrivals.StepClock` (tests).

    Returns:
        :class:`InterferenceRun`.

    Raises:
        ValueError: no streams, an empty prompt, ``chunk_size`` < 1, ``before_tokens`` < 2 or
            ``after_tokens`` < 1 (and what the core refuses: ids outside the vocabulary).
        NotAdmitted, RuntimeError: the engine refused the context or a step.
    """
    prompts = [[int(t) for t in p] for p in stream_prompts]
    long = [int(t) for t in long_prompt]
    if not prompts or any(not p for p in prompts) or not long:
        raise ValueError("at least one stream, and no empty prompt")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be >= 1 (None: the whole prompt in one step)")
    if before_tokens < 2 or after_tokens < 1:
        raise ValueError("before_tokens must be >= 2 and after_tokens >= 1")
    n = len(prompts)
    chunk = len(long) if chunk_size is None else min(chunk_size, len(long))
    # a stream decodes at most: its wait for the others' prefills + before + the long prefill's steps + after
    stream_new = n + before_tokens + -(-len(long) // chunk) + after_tokens + 2
    spec = CoreSpec(slots=n + 1, max_seq_tokens=max(max(len(p) for p in prompts) + stream_new, len(long) + 1),
                    prefill_chunk=None, kv_bytes_per_token=kv_bytes_per_token, qeval_admits=True,
                    warm_prompt=tuple(prompts[0]), label=f"interference, chunk {chunk_size}")
    clock = clock or WallClock()
    toks: list[list[int]] = [[] for _ in range(n)]
    times: list[list[float]] = [[] for _ in range(n)]
    with open_core(engine, spec, clock) as core:
        # a server decodes the streams at its own pace while it prefills the long prompt: they ask for
        # enough tokens not to end first (a prefill runs faster per token than a decode, so one per prompt
        # token is ample); a stream that ends first anyway fails the run below instead of looping
        ask = stream_new if core.controls_steps else stream_new + 4 * len(long)
        for s, p in enumerate(prompts):
            core.submit(s, p, ask)
        clock.start()
        decoding = False
        arrival = first = None
        first_tok = -1
        steps = long_steps = 0
        while True:
            events = core.step()
            if decoding:
                steps += 1
                if arrival is not None and first is None:
                    long_steps += 1
            for ev in events:
                if ev.rid == n:
                    if ev.tokens and first is None:
                        first, first_tok = ev.times[0], int(ev.tokens[0])
                    elif ev.error is not None:
                        raise RuntimeError(f"the long prompt ended with {ev.error}")
                    continue
                if ev.error is not None:
                    raise RuntimeError(f"stream {ev.rid} ended with {ev.error}")
                if ev.done:
                    raise RuntimeError(f"stream {ev.rid} ended ({ask} tokens) before the long prompt's first token "
                                       f"and {after_tokens} more")
                toks[ev.rid] += ev.tokens
                times[ev.rid] += ev.times
            # after its first token: until every stream has ``after_tokens`` more (in process: steps)
            if first is not None and all(sum(x > first for x in t) >= after_tokens for t in times):
                break
            decoding = decoding or all(toks)
            if arrival is None and decoding and all(len(t) - 1 >= before_tokens for t in toks):
                # in process: the end of the step that gave the last stream its token; served: now
                arrival = max(t[-1] for t in times) if core.controls_steps else clock.now()
                core.submit(n, long, 1, prefill_chunk=chunk)
        st = core.stats()
    return InterferenceRun(chunk_size=chunk_size, stream_times=[t[1:] for t in times],
                           stream_tokens=[t[1:] for t in toks], arrival_s=float(arrival), first_token_s=float(first),
                           long_first_token=first_tok, long_prompt_tokens=len(long), steps=steps,
                           long_steps=long_steps, details={**st.details, "streams": n, "engine_steps": st.steps})


def interference_sweep(engine: Any, stream_prompts: Sequence[Sequence[int]], long_prompt: Sequence[int], *,
                       chunk_sizes: Sequence[int], before_tokens: int = 4, after_tokens: int = 4,
                       progress: Callable[[str], None] = lambda s: None, kv_bytes_per_token: float | None = None,
                       kv_budget_bytes: float | None = None, max_context: int | None = None) -> dict:
    """One long prompt landing on ``len(stream_prompts)`` decoding streams, unchunked (the
    whole prompt in one step) and at each of ``chunk_sizes`` (tokens per step), with the stall
    figures of :func:`qeval.measure.interference.interference_stats` per run.

    Admission first, as every load point's (:func:`~qeval.measure.load.admission`): the
    streams' KV (prompt + ``before_tokens + after_tokens`` each) and the long prompt's must
    fit ``kv_budget_bytes``, and the long prompt the model's context; otherwise nothing runs.

    Returns:
        a dict of :class:`qeval.results_load.InterferenceSection`'s fields; ``not_measured``
        says why when the point is not admitted, the engine has no core, or it refuses the
        prompt or fails (the runs before it are kept; the load stage goes on).
    """
    out: dict[str, Any] = {"prompt_tokens": len(long_prompt), "streams": len(stream_prompts),
                           "stream_depth": max((len(p) for p in stream_prompts), default=0), "rows": [],
                           "not_measured": None}
    tail = before_tokens + after_tokens
    tokens = sum(len(p) + tail for p in stream_prompts) + len(long_prompt) + after_tokens
    if max_context is not None and len(long_prompt) + after_tokens > max_context:
        out["not_measured"] = (f"not admitted: the {len(long_prompt)}-token prompt + {after_tokens} new tokens is "
                               f"beyond the model's context of {max_context}")
        return out
    if kv_bytes_per_token and kv_budget_bytes is not None and tokens * kv_bytes_per_token > kv_budget_bytes:
        out["not_measured"] = (f"not admitted: KV cache of {tokens} tokens ({len(stream_prompts)} streams and the long "
                               f"prompt) = {tokens * kv_bytes_per_token / 2**30:.2f} GiB exceeds the KV budget of "
                               f"{max(kv_budget_bytes, 0) / 2**30:.2f} GiB")
        progress(f"load: interference {out['not_measured']}")
        return out
    if not can_serve(engine):
        out["not_measured"] = f"the {getattr(engine, 'name', 'engine')} engine has no serving core"
        return out
    for chunk in [None, *sorted(int(c) for c in chunk_sizes)]:
        progress(f"load: interference: {len(long_prompt)}-token prompt on {len(stream_prompts)} streams, "
                 f"{'unchunked' if chunk is None else f'{chunk} tokens per step'}")
        try:
            run = long_prompt_run(engine, stream_prompts, long_prompt, chunk_size=chunk, before_tokens=before_tokens,
                                  after_tokens=after_tokens, kv_bytes_per_token=kv_bytes_per_token)
        except (ValueError, RuntimeError, NotAdmitted, *oom_types()) as e:  # the tier's other load figures stand
            out["not_measured"] = f"{'unchunked' if chunk is None else f'chunk {chunk}'}: {e.__class__.__name__}: {e}"[:300]
            break
        st = interference_stats(run.stream_times, run.arrival_s, run.first_token_s).to_dict()
        for k in ("window_start_s", "window_end_s"):
            st.pop(k)
        out["rows"].append({"chunk_size": chunk, **st, "steps": int(run.steps), "long_steps": int(run.long_steps)})
    return out


def _run(ctx: ServingContext) -> dict | None:
    """``load.interference``: ``streams`` prompts of the load depth and one long prompt."""
    it = ctx.load.interference
    if it is None:
        return None
    fresh = ctx.prompts()
    return interference_sweep(ctx.engine, [fresh(2000 + s, 0) for s in range(it.streams)],
                              ctx.prompts(it.prompt_tokens)(3000, 0), chunk_sizes=it.chunk_sizes,
                              progress=ctx.progress, kv_bytes_per_token=ctx.kv_bytes_per_token,
                              kv_budget_bytes=ctx.kv_budget_bytes, max_context=ctx.max_context)


#: The long-prompt interference workload (``load.interference``).
WORKLOAD = Workload("interference", 40, _run)
