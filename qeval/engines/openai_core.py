"""The engine core of an OpenAI-compatible server (:class:`OpenAICore`, the ``open_core`` of
:class:`qeval.engines.openai.OpenAIEngine`): every load workload of :mod:`qeval.serving` drives
a served tier through it, batched by the server's own scheduler (llama-server's slots with
continuous batching, vLLM's scheduler), as vLLM ``bench serve`` and GuideLLM drive a server.

Each request is a streamed ``/v1/completions`` request (greedy, ``ignore_eos``: a fixed
output length) on its own daemon thread, sent in the tier's prompt mode
(:meth:`qeval.engines.openai.OpenAIEngine.wire_request`: token ids, or the decoded text, or
that text as one chat message; in text and chat modes a token is a chunk that carries text,
:meth:`~qeval.engines.openai.OpenAIEngine.wire_tokens`). The thread puts a
:class:`~qeval.serving.core.TokenEvent` on a queue for every chunk that brings tokens, each
token stamped with the workload's clock when its chunk's line was read (its arrival time);
:meth:`OpenAICore.step` waits for the first queued event and drains the rest. The event
that brings the request's ``max_new_tokens``-th token is held until the stream ends, so it
is the request's one ``done`` event and carries the server's count of cached prompt tokens
(:func:`cached_tokens`, from the final ``usage`` chunk); its tokens keep their arrival
times. httpx's connection pool holds one connection per open request. asyncio was
checked: it gives the same arrival times, and threads keep the engine's synchronous
client.

The stream is read line by line in the server's dialect
(:meth:`~qeval.engines.servers.Dialect.read_line`, the same loop for every dialect): SSE
``data:`` lines for the OpenAI servers, one JSON object a line (NDJSON) on Ollama's native
routes (:mod:`qeval.engines.servers.ollama`, the request routed by
:meth:`~qeval.engines.openai.Client.route`), whose objects are read into the OpenAI chunk
shape; an Ollama stream closed before its ``done: true`` object was cut mid-answer and ends
the request with ``error="error (stream cut before its end)"`` (a failure, counted).

The server schedules (``controls_steps`` False, ``scheduling`` ``server``): the core does
not refuse a request beyond its ``slots`` (the server queues it; the open loop holds its
own cap, :func:`qeval.serving.open_loop.client_cap`). A request's end with an error says
why, as :func:`qeval.serving.open_loop.outcome_of` reads it: ``"timeout"`` (no first token
within the request's ``timeout_s``: httpx's read timeout, or a first token that came later
than that; the connection is closed), the HTTP status (``"429"``, ``"503"``: refusals; any
other a failure), ``"connection (<httpx error>)"`` or ``"error (<exception>)"``. Where an
error is not a refusal or a timeout the managed server is checked
(:meth:`~qeval.engines.openai.OpenAIEngine._alive`): a dead server raises
:class:`~qeval.engines.servers.ServerFailed` from :meth:`OpenAICore.step`.

Opening the core (entering it) starts a timed phase on an empty KV pool
(:meth:`~qeval.engines.openai.OpenAIEngine.kv_pool_phase`, named by the spec's label);
leaving it aborts what still runs and ends the phase (the server's counters read again).
A shared prefix: :meth:`OpenAICore.cache_prefix` keeps its ids and a request started from it
is sent whole with ``cache_prompt`` (llama-server's slot keeps the cached prompt; vLLM's
prefix caching finds it), so the first such request fills the server's cache; without
reuse, a vLLM request of a shared-prefix workload gets its own ``cache_salt`` (no block
shared with another request).
"""
from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..serving.core import CoreSpec, CoreStats, TokenEvent
from ..serving.open_loop import REFUSED_STATUS
from .servers import dialects

#: Longest :meth:`OpenAICore.__exit__` waits, in seconds, for the threads of aborted requests
#: to end (a request the server has not answered yet notices its abort only when it does).
JOIN_S = 10.0


def cached_tokens(chunk: dict, previous: int | None = None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion chunk (the OpenAI
    field; llama-server fills it from its slot's reused cells, vLLM with
    ``--enable-prompt-tokens-details``), else ``previous``."""
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    got = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(got) if isinstance(got, (int, float)) and not isinstance(got, bool) else previous


def chunk_ids(chunk: dict) -> list[int]:
    """Token ids a streamed chunk carries, in the first registered dialect that finds any
    (as :func:`qeval.engines.openai.chunk_token_ids` without a dialect; that module imports
    this one, so not imported here): the tokens of an engine without ``wire_tokens``."""
    return next((ids for d in dialects() if (ids := d.token_ids(chunk))), [])


class _TimedOut(Exception):
    """No first token within the request's timeout."""


@dataclass(eq=False)
class _Request:
    """One submitted request and its thread's state (``lock`` guards ``resp`` and ``aborted``)."""
    rid: int
    ids: list[int]
    max_new_tokens: int
    cache_prompt: bool
    salt: bool
    timeout_s: float | None
    aborted: bool = False
    resp: Any = None
    streamed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class OpenAICore:
    """The served engine core (module docstring; the interface is
    :class:`qeval.serving.core.EngineCore`).

    Args:
        engine: an open :class:`qeval.engines.openai.OpenAIEngine` (or an object with its
            ``client``, ``backend`` and ``_alive``; ``wire_request``, ``wire_tokens``,
            ``kv_pool_tokens``, ``kv_pool_phase`` and ``_died_or`` are used where present).
        spec: the workload's :class:`~qeval.serving.core.CoreSpec`: ``slots`` (requests the
            workload keeps open, :meth:`free`), ``label`` (the KV-pool phase's name),
            ``shared_prefix`` (read with ``getattr``: prompts share that many leading tokens;
            > 0 salts a vLLM request that does not reuse them) and ``qeval_admits`` (the open
            loop: a request without ``timeout_s`` waits without a read limit); the prefill
            and KV fields are the server's own settings and not applied.
        clock: the workload's clock (``now()``, seconds): token events are stamped with it.
    """

    controls_steps = False
    scheduling = "server"

    def __init__(self, engine: Any, spec: CoreSpec, clock: Any) -> None:
        self.engine = engine
        self.spec = spec
        self.clock = clock
        self.client = engine.client
        self.slots = int(spec.slots)
        pool = getattr(engine, "kv_pool_tokens", None)
        self.kv_pool_tokens: int | None = pool() if callable(pool) else None
        self._wire_request = getattr(engine, "wire_request", None)  # the tier's prompt mode (tokens, text, chat)
        self._wire_tokens = getattr(engine, "wire_tokens", chunk_ids)
        self._events: queue.Queue[tuple[_Request, TokenEvent]] = queue.Queue()
        self._live: dict[int, _Request] = {}
        self._threads: list[threading.Thread] = []
        self._prefix: list[int] | None = None
        self._phase: Any = None
        self._failed: BaseException | None = None  # a dead server seen by a request's thread
        self._said: set[str] = set()  # HTTP statuses whose answer was printed once
        self._details: dict = {"dialect": self.client.dialect, "server": getattr(engine, "backend", None)}

    # -- the context ----------------------------------------------------------------------
    def __enter__(self) -> "OpenAICore":
        """Start the KV-pool phase (``engine.kv_pool_phase(spec.label or "load")`` where the
        engine has one): the server's pool cleared and checked, its record put in
        ``stats().details["kv_pool"]`` (None for an endpoint: left out).

        Raises:
            PoolNotCleared: the pool was not empty at the start (one line).
            ServerFailed: the managed server died.
        """
        phase = getattr(self.engine, "kv_pool_phase", None)  # each workload run on an empty KV pool
        if phase is not None:
            cm = phase(self.spec.label or "load")
            rec = cm.__enter__()
            self._phase = cm
            if rec is not None:
                self._details["kv_pool"] = rec  # the same dict: its "after" counters are filled as the phase ends
        return self

    def __exit__(self, *exc: Any) -> None:
        """Abort every request still open (:meth:`release`), wait up to :data:`JOIN_S` s for
        their threads, and end the KV-pool phase (its ``after`` counters read)."""
        try:
            for rid in list(self._live):
                self.release(rid)
            deadline = time.monotonic() + JOIN_S
            for th in self._threads:
                th.join(max(0.0, deadline - time.monotonic()))
            self._threads = [th for th in self._threads if th.is_alive()]
        finally:
            cm, self._phase = self._phase, None
            if cm is not None:
                cm.__exit__(*(exc if len(exc) == 3 else (None, None, None)))

    # -- the interface --------------------------------------------------------------------
    def submit(self, rid: int, prompt: Sequence[int], max_new_tokens: int, *, prefix: bool = False,
               prefill_chunk: int | None = None, timeout_s: float | None = None) -> None:
        """Send request ``rid`` on its own thread (module docstring); returns at once.

        Args:
            prompt: its token ids (with ``prefix``: the part after the cached prefix).
            max_new_tokens: new tokens asked (``max_tokens``, ``ignore_eos``).
            prefix: start from the prefix of :meth:`cache_prefix`: the whole prompt is sent with
                ``cache_prompt`` (the server's prompt cache serves the prefix).
            prefill_chunk: not applied (the server's chunk is its start-up setting).
            timeout_s: no first token within this many seconds ends the request with
                ``error="timeout"``; None: the client's own timeout (the open loop: none).

        Raises:
            ValueError: an empty prompt, ``max_new_tokens`` < 1, ``prefix`` without a cached
                one, or ``rid`` still open. More requests than ``slots`` are not refused (the
                server queues them).
        """
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a request needs at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if prefix and self._prefix is None:
            raise ValueError("submit(prefix=True) needs cache_prefix first")
        if rid in self._live:
            raise ValueError(f"request {rid} is still open")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError("timeout_s must be > 0 (None: no first-token timeout)")
        salt = not prefix and getattr(self.spec, "shared_prefix", 0) > 0 and self.client.dialect == "vllm"
        req = _Request(rid, (self._prefix + ids) if prefix else ids, int(max_new_tokens), bool(prefix), salt,
                       None if timeout_s is None else float(timeout_s))
        self._live[rid] = req
        if len(self._threads) > 2 * len(self._live) + 64:  # ended ones let go: memory follows the open requests
            self._threads = [th for th in self._threads if th.is_alive()]
        th = threading.Thread(target=self._run, args=(req,), daemon=True, name=f"qeval-request-{rid}")
        self._threads.append(th)
        th.start()

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """The token events that arrived: waits up to ``timeout_s`` seconds (None: until one
        arrives) for the first, then takes every one queued. Returns [] at once when no
        request is open, and [] when none arrived in time; never an event of a released
        request.

        Raises:
            ServerFailed: an event is a failure (not a timeout, 429 or 503, or a request that
                streamed no token) and the managed server died.
        """
        if self._failed is not None:
            raise self._failed
        if not self._live and self._events.empty():
            return []
        try:
            items = [self._events.get(timeout=None if timeout_s is None else max(0.0, float(timeout_s)))]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._events.get_nowait())
            except queue.Empty:
                break
        out: list[TokenEvent] = []
        check = False
        for req, ev in items:
            if self._live.get(ev.rid) is not req:  # released (aborted): its events are dropped
                continue
            if ev.done:
                del self._live[ev.rid]
                if ev.error not in (None, "timeout") and not (ev.error.isdigit() and int(ev.error) in REFUSED_STATUS):
                    check = True
                elif ev.error is None and not req.streamed:
                    check = True  # a stream with no token: a dying server is the likely reason
            out.append(ev)
        if self._failed is not None:
            raise self._failed
        if check:
            self.engine._alive()  # a dead server is the reason (ServerFailed, its log tail printed)
        return out

    def release(self, rid: int) -> None:
        """Abort request ``rid`` if it still runs (its connection shut, so the server drops
        it; a request not yet answered notices when its answer starts) and forget it: it
        brings no more events. Idempotent; an unknown ``rid`` is ignored."""
        req = self._live.pop(rid, None)
        if req is None:
            return
        with req.lock:
            req.aborted = True
            resp = req.resp
            if resp is not None:
                stream = (getattr(resp, "extensions", None) or {}).get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's read: it ends without an event
                    except OSError:
                        pass

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Keep ``ids`` as the shared prefix: nothing is sent now (the server's prompt cache
        holds it after the first request sent with it and ``cache_prompt``).

        Raises:
            ValueError: an empty prefix.
        """
        p = [int(t) for t in ids]
        if not p:
            raise ValueError("cache_prefix needs at least one token")
        self._prefix = p

    def free(self) -> int:
        """``slots`` less the requests open now (0 when as many or more are open)."""
        return max(0, self.slots - len(self._live))

    def stats(self) -> CoreStats:
        """Steps 0 (the server steps), no KV figures (the server owns its cache); ``details``:
        ``dialect``, ``server`` (the engine's backend) and ``kv_pool`` (the phase's record,
        the same dict the engine fills with its ``after`` counters as the core closes)."""
        return CoreStats(steps=0, details=self._details)

    # -- a request's thread ---------------------------------------------------------------
    def _body(self, req: _Request) -> tuple[str, dict]:
        """``(path, body)`` of ``req`` in the tier's prompt mode."""
        if self._wire_request is not None:
            path, body = self._wire_request(req.ids, req.max_new_tokens, ignore_eos=True, cache_prompt=req.cache_prompt)
        else:
            path, body = "/v1/completions", self.client.body(req.ids, req.max_new_tokens, stream=True, ignore_eos=True,
                                                             cache_prompt=req.cache_prompt)
        if req.salt:
            body["cache_salt"] = f"qeval-{req.rid}-{time.perf_counter_ns()}"  # no block shared with another request
        return path, body

    def _timeout(self, req: _Request) -> dict:
        """The httpx ``timeout`` argument of ``req``: its first-token limit as the read timeout
        (connect within 10 s or the limit); without one, the open loop's wait without limit,
        or the client's own timeout (the closed loop, the interference workload)."""
        import httpx  # start-up time: only served tiers talk HTTP
        limit = req.timeout_s
        if limit is not None:
            return {"timeout": httpx.Timeout(limit, connect=min(limit, 10.0))}
        if self.spec.qeval_admits:
            return {"timeout": httpx.Timeout(None, connect=10.0)}
        return {}

    def _put(self, req: _Request, ev: TokenEvent) -> None:
        self._events.put((req, ev))

    def _run(self, req: _Request) -> None:
        """Stream ``req`` and queue its events; exactly one ``done`` event unless it is aborted."""
        import httpx  # start-up time: only served tiers talk HTTP
        held: list[int] = []
        held_t: list[float] = []
        n = 0
        hit: int | None = None
        err: str | None = "error (no answer)"
        wire = self.client.wire
        ended = False
        try:
            path, body = self.client.route(*self._body(req))  # the dialect's own route (Ollama's /api/chat)
            sent = time.perf_counter()
            with self.client.http.stream("POST", path, json=body, **self._timeout(req)) as resp:
                with req.lock:
                    if req.aborted:
                        return
                    req.resp = resp
                try:
                    if resp.status_code != 200:
                        resp.read()
                        err = str(resp.status_code)
                        said = wire.refused(resp.status_code, resp.text, self.client.model)  # Ollama: ollama pull
                        self._say(err, said or f"{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
                    else:
                        for line in resp.iter_lines():
                            now, pc = self.clock.now(), time.perf_counter()
                            if req.aborted:
                                return
                            chunk, ended = wire.read_line(line)  # SSE data: lines, or Ollama's NDJSON
                            if chunk is None:
                                if ended:
                                    break
                                continue
                            hit = cached_tokens(chunk, hit)
                            got = [int(t) for t in self._wire_tokens(chunk)]
                            if got:
                                if n == 0 and req.timeout_s is not None and pc - sent > req.timeout_s:
                                    raise _TimedOut()
                                n += len(got)
                                if n < req.max_new_tokens:
                                    self._put(req, TokenEvent(req.rid, got, [now] * len(got)))
                                else:  # the last tokens: held for the stream's end (its usage), sent done
                                    held += got
                                    held_t += [now] * len(got)
                            if ended:
                                break
                        # a dialect whose stream ends on its own last object (Ollama's done: true): a
                        # stream closed before it was cut mid-answer, a failed request
                        err = "error (stream cut before its end)" if wire.requires_end and not ended else None
                finally:
                    with req.lock:
                        req.resp = None  # before the with closes it: release never touches a pooled connection
        except (_TimedOut, httpx.TimeoutException):
            err = "timeout"
        except httpx.HTTPError as e:
            err = f"connection ({e.__class__.__name__})"
            if not req.aborted:
                self._settle(e)
        except Exception as e:  # noqa: BLE001 - a bad chunk or body is this request's failure, counted
            err = f"error ({e.__class__.__name__})"
        finally:
            req.streamed = n
            if not req.aborted:
                self._put(req, TokenEvent(req.rid, held, held_t, done=True, error=err, cached_tokens=hit))

    def _settle(self, e: BaseException) -> None:
        """After a connection error: wait for a dying managed server to exit and keep its
        :class:`ServerFailed` for :meth:`step` (``engine._died_or``, where it has one)."""
        died_or = getattr(self.engine, "_died_or", None)
        if died_or is None:
            return
        try:
            died_or(e)
        except Exception as failed:  # noqa: BLE001 - ServerFailed: raised by step, in the workload's thread
            self._failed = self._failed or failed

    def _say(self, status: str, line: str) -> None:
        """Print the server's first answer of each HTTP error status to this stage's log (the
        event carries the status alone, as the open loop counts it)."""
        if status not in self._said:
            self._said.add(status)
            print(f"[qeval] {line}", file=sys.stderr, flush=True)
