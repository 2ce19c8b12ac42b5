"""The load sweep against an OpenAI-compatible server: N concurrent streams, each a closed
loop of streamed ``/v1/completions`` requests, batched by the server's own scheduler
(llama-server's slots with continuous batching, vLLM's scheduler), as vLLM ``bench serve``
and GuideLLM drive a server.

Each stream is a thread with its own requests in turn (a fresh prompt of ``depth`` token
ids, ``output_tokens`` new tokens, ``ignore_eos``); every token's time is the arrival time
of its chunk, in seconds since the run started. httpx's connection pool holds one
connection per stream. asyncio was checked: it gives the same arrival times, and threads
keep the engine's synchronous client.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from ..measure.load import LoadRun, NotAdmitted, PromptFor, RequestRecord
from .openai import chunk_token_ids


def serve_closed_loop(engine: Any, prompt_for: PromptFor, *, concurrency: int, output_tokens: int,
                      requests_per_stream: int, prefill_chunk: int = 256,
                      kv_budget_bytes: float | None = None, kv_bytes_per_token: float | None = None,
                      max_context: int | None = None) -> LoadRun:
    """Serve ``concurrency`` closed-loop streams against ``engine``'s server.

    Args:
        engine: an open :class:`qeval.engines.openai.OpenAIEngine`.
        prompt_for: ``(stream, k) -> prompt token ids``.
        concurrency: N streams at once (more than the server's slots queue there).
        output_tokens: new tokens per request.
        requests_per_stream: requests each stream sends in turn.
        prefill_chunk, kv_budget_bytes, kv_bytes_per_token, max_context: the common serve
            signature (:func:`qeval.measure.serving.load_sweep`); the server schedules its
            own prefill and owns its KV cache, so they are not used here.

    Returns:
        :class:`~qeval.measure.load.LoadRun` (scheduling ``server``); ``details`` holds the
        server's dialect and the streams' HTTP errors (none when it ran clean).

    Raises:
        NotAdmitted: the server refused a request (an HTTP error status: e.g. more tokens
            than its context).
        ServerFailed: a managed server died during the run.
        ValueError: concurrency, output_tokens or requests_per_stream < 1.
    """
    if concurrency < 1 or output_tokens < 1 or requests_per_stream < 1:
        raise ValueError("concurrency, output_tokens and requests_per_stream must be >= 1")
    client = engine.client
    records: list[RequestRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(concurrency + 1)
    t0 = [0.0]

    def stream(s: int) -> None:
        go.wait()
        for k in range(requests_per_stream):
            ids = [int(t) for t in prompt_for(s, k)]
            start = time.perf_counter() - t0[0]
            toks: list[int] = []
            times: list[float] = []
            try:
                for t, chunk in client.stream(client.body(ids, output_tokens, stream=True, ignore_eos=True)):
                    got = chunk_token_ids(chunk)
                    toks += got
                    times += [t - t0[0]] * len(got)
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                with lock:
                    errors.append(e)
                return
            if not toks:
                with lock:
                    errors.append(RuntimeError("a request streamed no token ids"))
                return
            with lock:
                records.append(RequestRecord(s, len(ids), start, times, toks))

    threads = [threading.Thread(target=stream, args=(s,), daemon=True, name=f"qeval-stream-{s}")
               for s in range(concurrency)]
    for th in threads:
        th.start()
    t0[0] = time.perf_counter()
    go.wait()
    for th in threads:
        th.join()
    if errors:
        engine._alive()  # a dead server is the reason (ServerFailed, its log tail printed)
        e = errors[0]
        if isinstance(e, RuntimeError) and "answered HTTP" in str(e):
            raise NotAdmitted(f"the server refused a request at concurrency {concurrency}: {str(e)[:200]}")
        raise e
    duration = max((r.token_times_s[-1] for r in records), default=0.0)
    return LoadRun(concurrency=concurrency, scheduling="server", requests=records, duration_s=duration,
                   details={"dialect": client.dialect, "server": engine.backend})
