"""Engine over an OpenAI-compatible HTTP endpoint (``engine: openai``): a server that
already runs (``endpoint: {url, api_key_env}``) or one qeval starts on the tier's artifact
(``serve: llama-server | vllm | sglang``: a registered managed server,
:mod:`qeval.engines.servers`).

What goes over the wire (httpx; the OpenAI client library was checked: it hides the
stream's chunk arrival times behind its own iterator and retries, and knows none of the
servers' token-id extensions):

* ``POST /v1/completions`` with the prompt as token ids from the source model's Hugging
  Face tokenizer (every known server takes a list of ints), ``stream: true`` and
  ``stream_options.include_usage``: TTFT and every inter-token time are chunk arrival
  times (``time.perf_counter`` when the chunk's line is read). Greedy: ``temperature 0``,
  and the server dialect's own fields (``top_k 1``, no penalties, prompt caching off);
  a managed server is started with its prefix cache off, so a repeated speed prompt is
  prefilled again. A stop token ends the answer as in the in-process engines; the speed
  sweep asks for ``ignore_eos`` (a fixed length, as vLLM ``bench serve --ignore-eos``).
* token ids of the answer: where the server's dialect
  (:class:`~qeval.engines.servers.Dialect`, picked by the managed server's kind or an
  endpoint's ``owned_by``) says they are. A token the server holds back (llama-server
  sends nothing for a token that ends in an incomplete UTF-8 character) arrives with the
  next chunk; the count comes from ``usage`` and such tokens' ids from a non-streamed
  answer when needed.
* the tokenizer check: each depth prompt's text is sent as text with ``max_tokens 1``;
  ``usage.prompt_tokens`` must equal the source tokenizer's count, else
  :class:`TokenizerMismatch` names both counts (a server with another tokenizer would be
  measured on other tokens than every other tier). A managed server's KV pool is cleared
  after it: the check's long prompts do not stay in the pool.
* a clean KV pool per timed phase (:meth:`OpenAIEngine.kv_pool_phase`): before each speed
  depth and each load point a managed server's pool is cleared through its own API
  (llama-server's slot erase, vLLM's prefix-cache reset, SGLang's cache flush; a server
  without one is restarted), its own counters are read before and after, and a pool that
  is not empty at the start fails the phase in one line naming the tier and the server.
* scoring (fidelity) from the server's top-k log-probabilities. Where the server returns
  the log-probabilities of the prompt's own positions (vLLM's ``prompt_logprobs``
  extension of ``/v1/completions``: ``choices[0].prompt_logprobs``, one
  ``{token id: {logprob, rank, decoded_token}}`` per prompt token, None for the first),
  one request per sequence; otherwise (llama-server, an unknown server) one request per
  position with the prefix as prompt and ``max_tokens 1`` (llama-server ``n_probs``,
  reusing its cached prefix, ``cache_prompt: true``). vLLM is the one dialect that has
  it unless ``options.server["prompt_logprobs"]`` says otherwise; a server that answers
  such a request without the field is scored per position from then on. Both paths keep
  the ``k`` most probable tokens (vLLM adds the prompt's own token when it is outside
  them: dropped, so both paths give the same rows).
  :meth:`OpenAIEngine.iter_logprobs` yields full-vocabulary rows with the top ``k``
  exact and the remaining mass spread evenly over the other tokens; the fidelity stage
  also reports the top-``k`` estimate proper (:func:`qeval.measure.fidelity.topk_kld_rows`:
  the remaining mass in one bucket), labelled with ``k``.

Prompt modes (the tier's ``prompt_mode``, :data:`PROMPT_MODES`): ``tokens`` (all of the
above: token ids in and out; the default), ``text`` (``/v1/completions`` with the prompt as
text: the source tokenizer decodes the ids qeval built, its own chat template included, and
encodes the answer text back; Ollama, LM Studio, hosted completions) and ``chat``
(``/v1/chat/completions`` with the suite's messages; the server renders its own template).
In text and chat modes TTFT and inter-token times are the arrival times of the chunks that
carry text (servers stream a token a chunk; counted tokens beyond the chunks take the last
chunk's time); a
token count is the server's ``usage.completion_tokens`` where it sends it, else the source
tokenizer's count of the returned text, and :meth:`OpenAIEngine.served_info` says which
(``token_counts``). A prompt that is token ids alone (a speed depth, a load request) goes to
a chat server as one user message holding its decoded text. Scoring in text mode, where the
dialect returns top-k by token id (llama-server, vLLM): one request per position on the
decoded prefix (the server tokenizes that text itself; :meth:`OpenAIEngine.topk_at`), the
same top-k estimate as tokens mode; a position the server answers without a top-k
(llama-server holds back a greedy token that ends in an incomplete UTF-8 character, and its
log-probabilities with it) is skipped and counted (``topk_skipped``, said in the row's
``kld_estimate``). Chat mode, and text mode on a dialect without top-k by id, say fidelity
is not measurable on this endpoint (:attr:`OpenAIEngine.fidelity_note`).

Ollama's native API (``endpoint: {url, dialect: ollama, model: <what ollama list shows>}``,
:mod:`qeval.engines.servers.ollama`): the same requests routed to ``/api/chat`` (chat mode,
the default there) or ``/api/generate`` with ``raw: true`` (text mode) by the dialect
(:meth:`Client.route`), their NDJSON answers read into the OpenAI chunk shape; token counts
from its ``prompt_eval_count``/``eval_count`` (``token_counts`` says so), its own timings in
the row (``served.ollama_timings``), its ``top_logprobs`` (by token text, mapped to source
ids: :meth:`OpenAIEngine._topk_by_text`) scoring text mode; a model not pulled is one line
naming ``ollama pull``.

The API key is read from the environment variable the recipe names, sent only in the
``Authorization`` header, and never written to a file or a message.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import QevalInputError, TierUnavailable
from .base import Capabilities, EngineOptions, Generation, MemoryInfo
from .servers import (OPENAI, Dialect, EndpointSpec, Launch, ManagedServer, PoolNotCleared, ServeOptions,
                      ServerFailed, dialect_for_owner, dialect_named, dialects, free_port, get_server, parse_serve,
                      round_ctx)

DEFAULT_TOPK = 20

#: The tier's ``prompt_mode`` values: token ids to ``/v1/completions``, text to
#: ``/v1/completions``, messages to ``/v1/chat/completions``.
PROMPT_MODES = ("tokens", "text", "chat")

#: Where a text or chat answer's token count came from (``served_info()["token_counts"]``).
COUNT_USAGE = OPENAI.usage_source  # "server usage" (Ollama's: prompt_eval_count/eval_count)
COUNT_SOURCE = "source tokenizer on the text"
#: Where a tokens-mode answer's count came from: the ids the server streamed.
COUNT_IDS = "server token ids"
#: Most answers whose server-side timings (Ollama's) are kept for the row (a measure stage sends far fewer).
MAX_TIMINGS = 4096


class EndpointError(QevalInputError):
    """An endpoint that cannot be used as configured (unreachable, refused key, no model)."""


class TokenizerMismatch(EndpointError):
    """The server counts a prompt's tokens differently from the source tokenizer."""


class NoTopK(RuntimeError):
    """The server answered a scoring request without a top-k at its position."""


def endpoint_dialect(spec: EndpointSpec | None, prompt_mode: str | None) -> tuple[Dialect | None, str | None]:
    """The dialect an endpoint names (``endpoint.dialect``; None: sniffed from ``owned_by``
    at connect) and the tier's prompt mode: on a dialect that takes no token ids (Ollama's
    native API) an unset mode is ``chat``.

    Raises:
        EndpointError: ``prompt_mode: tokens`` on such a dialect (one line, field ``prompt_mode``).
    """
    if spec is None or not spec.dialect:
        return None, prompt_mode
    wire = dialect_named(spec.dialect)
    if not wire.token_prompts:
        if prompt_mode == "tokens":
            raise EndpointError(f"the {wire.name} dialect takes text or messages, not token ids: set prompt_mode "
                                "text or chat", field="prompt_mode")
        prompt_mode = prompt_mode or "chat"
    return wire, prompt_mode


def wire_settings(tokens: dict) -> dict:
    """A dialect's per-tier settings (:attr:`Client.settings`, read by Ollama's): ``num_ctx``
    the longest sequence the tier serves (``tokens``: ``sequence``, ``load_sequence``)
    rounded up to 256 and at most the model's context (``model``); {} when none is known."""
    longest = max(int(tokens.get("sequence") or 0), int(tokens.get("load_sequence") or 0))
    return {"num_ctx": round_ctx(longest, tokens.get("model"))} if longest else {}


def api_key(spec: EndpointSpec | None, field: str = "endpoint.api_key_env") -> str | None:
    """The API key from the environment variable ``spec.api_key_env`` (None: no key asked).

    Raises:
        EndpointError: the variable is not set (names the variable, never a value).
    """
    if spec is None or not spec.api_key_env:
        return None
    key = os.environ.get(spec.api_key_env)
    if not key:
        raise EndpointError(f"environment variable {spec.api_key_env} (the endpoint's API key) is not set",
                            field=field)
    return key


class Client:
    """The HTTP side: one ``httpx.Client`` to ``base_url`` with the key in its headers.

    Args:
        base_url: ``http://host:port`` (no ``/v1``).
        key: the API key or None.
        timeout_s: seconds per request (connect and read).
    """

    def __init__(self, base_url: str, key: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx  # start-up time: only served tiers talk HTTP
        self._httpx = httpx
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model: str | None = None
        self.wire: Dialect = OPENAI  # the server's dialect (a managed server's, the endpoint's, or from owned_by)
        self.settings: dict = {}  # the dialect's per-tier settings (Ollama: num_ctx, seed, keep_alive)

    @property
    def dialect(self) -> str:
        """The dialect's name (``llama.cpp``, ``vllm``, ``sglang``, ``openai``)."""
        return self.wire.name

    def models(self, path: str = "/v1/models") -> dict:
        """``GET /v1/models`` (``path``: a dialect's own list, Ollama's ``/api/tags``).

        Raises:
            EndpointError: unreachable, the key refused (401/403), or another HTTP error.
        """
        httpx = self._httpx
        try:
            r = self.http.get(path)
        except httpx.HTTPError as e:
            raise EndpointError(f"cannot reach {self.base_url}: {e.__class__.__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": "), field="endpoint.url") from None
        if r.status_code in (401, 403):
            raise EndpointError(f"{self.base_url} refused the API key (HTTP {r.status_code})",
                                field="endpoint.api_key_env")
        if r.status_code != 200:
            raise EndpointError(f"{self.base_url}{path} answered HTTP {r.status_code}", field="endpoint.url")
        try:
            return r.json()
        except ValueError:
            raise EndpointError(f"{self.base_url}{path} did not answer JSON", field="endpoint.url") from None

    def connect(self, model: str | None = None, wire: Dialect | None = None) -> None:
        """Pick the model (``model``, else the first listed) and the server's dialect
        (``wire``, else the one its ``owned_by`` names: :func:`~qeval.engines.servers.dialect_for_owner`).

        The list comes from the dialect's own route (:attr:`Dialect.models_path`; Ollama's
        ``/api/tags``, whose names are what ``ollama list`` shows).

        Raises:
            EndpointError: as :meth:`models`, or no model served / ``model`` not among them
                (Ollama: one line naming ``ollama pull``).
        """
        lister = wire if wire is not None else OPENAI
        listed = lister.model_names(self.models(lister.models_path))
        names = [n for n, _ in listed]
        try:
            self.model = lister.pick_model(self.base_url, model, names)
        except ValueError as e:
            raise EndpointError(str(e), field="endpoint.model" if names else "endpoint.url") from None
        owner = next((o for n, o in listed if n == self.model), "")
        self.wire = wire if wire is not None else dialect_for_owner(owner)

    def body(self, prompt: Any, max_tokens: int, *, stream: bool, logprobs: int = 1, ignore_eos: bool = False,
             cache_prompt: bool = False, prompt_logprobs: int | None = None) -> dict:
        """A greedy ``/v1/completions`` request body with the dialect's token-id extensions
        (``prompt_logprobs``: vLLM's top-k of every prompt position, non-streamed only)."""
        b: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens),
                             "temperature": 0.0, "top_p": 1.0, "stream": stream, "logprobs": int(logprobs)}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if ignore_eos:
            b["ignore_eos"] = True
        if prompt_logprobs is not None:
            b["prompt_logprobs"] = int(prompt_logprobs)
        b.update(self.wire.extras(logprobs=int(logprobs), cache_prompt=cache_prompt))
        return b

    def chat_body(self, messages: Sequence[dict], max_tokens: int, *, stream: bool,
                  ignore_eos: bool = False) -> dict:
        """A greedy ``/v1/chat/completions`` request body (``temperature 0``; ``ignore_eos``
        only when asked: the speed sweep's fixed length); usage asked in the stream."""
        b: dict[str, Any] = {"model": self.model, "messages": list(messages), "max_tokens": int(max_tokens),
                             "temperature": 0.0, "top_p": 1.0, "stream": stream}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    def text_body(self, text: str, max_tokens: int, *, stream: bool, ignore_eos: bool = False,
                  cache_prompt: bool = False) -> dict:
        """A greedy ``/v1/completions`` request body with ``text`` as the prompt and no
        log-probabilities asked (the answer is read as text)."""
        b = self.body(text, max_tokens, stream=stream, ignore_eos=ignore_eos, logprobs=0, cache_prompt=cache_prompt)
        b.pop("logprobs", None)
        return b

    def token_ids(self, chunk: dict) -> list[int]:
        """Token ids of a chunk in this server's dialect."""
        return self.wire.token_ids(chunk)

    def route(self, path: str, body: dict) -> tuple[str, dict]:
        """The ``(path, body)`` sent for an OpenAI request in this server's dialect
        (:meth:`Dialect.route`: the same for the OpenAI servers; Ollama's native routes)."""
        return self.wire.route(path, body, self.settings)

    def _refused(self, r: Any, path: str) -> None:
        """Raise :class:`EndpointError` for a refused key (401/403) or an answer the dialect
        words as a setup error (:meth:`Dialect.refused`: Ollama's model not pulled), else
        RuntimeError for any other error status."""
        if r.status_code in (401, 403):  # llama-server lets /v1/models through without a key; not this
            raise EndpointError(f"{self.base_url} refused the API key (HTTP {r.status_code})",
                                field="endpoint.api_key_env")
        said = self.wire.refused(r.status_code, r.text, self.model)
        if said:
            raise EndpointError(said, field="endpoint.model")
        raise RuntimeError(f"{path} answered HTTP {r.status_code}: {r.text[:300]}")

    def post(self, path: str, body: dict) -> dict:
        """A non-streamed POST (routed in the dialect: :meth:`route`); the JSON answer in
        the OpenAI shape (:meth:`Dialect.answer`).

        Raises:
            EndpointError: the key refused, or a setup error the dialect names (one line).
            RuntimeError: another HTTP error status (with the server's message, cut to 300 characters).
        """
        path, body = self.route(path, body)
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            self._refused(r, path)
        return self.wire.answer(r.json())

    def stream(self, body: dict, path: str = "/v1/completions") -> Iterator[tuple[float, dict]]:
        """``(perf_counter time, chunk)`` for every chunk of a streamed completion (``path``:
        ``/v1/chat/completions`` for a chat one), read line by line in the dialect
        (:meth:`Dialect.read_line`: SSE ``data:`` lines, or Ollama's NDJSON objects).

        Raises:
            EndpointError: as :meth:`post`.
            RuntimeError: another HTTP error status, or a stream the dialect says was cut
                (:attr:`Dialect.requires_end`: it ended before its last object).
        """
        path, body = self.route(path, body)
        with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self._refused(r, path)
            for line in r.iter_lines():
                t = time.perf_counter()
                chunk, end = self.wire.read_line(line)
                if chunk is not None:
                    yield t, chunk
                if end:
                    return
            if self.wire.requires_end:
                raise RuntimeError(f"{path}: the stream ended before its last object (cut mid-answer)")

    def close(self) -> None:
        self.http.close()


def chunk_token_ids(chunk: dict, wire: Dialect | None = None) -> list[int]:
    """Token ids a completion chunk carries, in dialect ``wire``; without one, in the first
    registered dialect that finds any (:func:`~qeval.engines.servers.dialects`)."""
    if wire is not None:
        return wire.token_ids(chunk)
    return next((ids for d in dialects() if (ids := d.token_ids(chunk))), [])


def chunk_topk(chunk: dict, wire: Dialect | None = None) -> list[list[tuple[int, float]]]:
    """Per generated token of a chunk, its top-k ``(token id, logprob)`` in dialect ``wire``
    (without one: the first registered dialect that finds any)."""
    if wire is not None:
        return wire.topk(chunk)
    return next((rows for d in dialects() if (rows := d.topk(chunk))), [])


def chunk_text(chunk: dict) -> tuple[str, str | None]:
    """``(text piece, finish_reason)`` of a completion or chat chunk (or a whole answer):
    ``choices[0].text``, or a chat delta's / message's ``content`` with its reasoning field
    (:data:`REASONING_FIELDS`) put inline as ``<think>...</think>`` before it, so that the
    answer's thinking is read as in the token modes (:func:`qeval.measure.behaviour.split_thinking`).
    A piece holding thinking is marked for :class:`_TextJoin` (NUL, the thinking, NUL, any
    answer text), which opens ``<think>`` once and closes it before the first answer text."""
    for ch in (chunk.get("choices") or [])[:1]:
        if "text" in ch:
            return str(ch.get("text") or ""), ch.get("finish_reason")
        m = ch.get("delta") if ch.get("delta") is not None else (ch.get("message") or {})
        text, thought = message_parts(m)
        return (f"\0{thought}\0{text}" if thought else text), ch.get("finish_reason")
    return "", None


class _TextJoin:
    """Joins :func:`chunk_text` pieces: thinking between ``<think>`` and ``</think>``."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.thinking = False

    def add(self, piece: str) -> bool:
        """Add one chunk's piece; True when it carried any text."""
        if not piece:
            return False
        if piece.startswith("\0"):
            _, thought, text = piece.split("\0", 2)
            if not self.thinking:
                self.parts.append("<think>")
                self.thinking = True
            self.parts.append(thought)
            piece = text
        if piece and self.thinking:
            self.parts.append("</think>")
            self.thinking = False
        self.parts.append(piece)
        return True

    def text(self) -> str:
        """The joined text (thinking left open when the budget ended it, as a model's own
        inline ``<think>`` would be)."""
        return "".join(self.parts)


#: Where chat servers put a reasoning model's thinking, apart from ``content``: vLLM's reasoning
#: parsers ``reasoning`` (renamed from ``reasoning_content``, vllm#27752; the old name removed in
#: vllm#33402), llama-server ``--reasoning-format deepseek`` (its default ``auto`` too) and
#: DeepSeek's API ``reasoning_content``. Without a parser the thinking stays inline in
#: ``content`` (``<think>...</think>``), which :func:`qeval.measure.behaviour.split_thinking` reads.
REASONING_FIELDS = ("reasoning", "reasoning_content")


def message_parts(m: dict) -> tuple[str, str | None]:
    """``(answer, thinking)`` of a chat message or a streamed delta: ``content`` (null, as a
    server sends when thinking spent ``max_tokens``, is ``""``) and the first reasoning field
    present (:data:`REASONING_FIELDS`; a server that fills both with the same text, as vLLM's
    compatibility alias did, is read once); thinking None when the server sent no such field."""
    thinking = next((m[f] for f in REASONING_FIELDS if isinstance(m.get(f), str)), None)
    return str(m.get("content") or ""), thinking


@dataclass
class ChatAnswer:
    """One chat completion with the thinking kept apart from the answer.

    Attributes:
        content: the answer (``message.content``; ``""`` when the server sent null).
        reasoning: the thinking from a reasoning field (None: the server sent none: no
            reasoning parser, or not a reasoning model).
        finish_reason: ``stop``, ``length`` (``max_tokens`` reached) ... as the server says.
        completion_tokens: ``usage.completion_tokens`` (thinking included), None when absent.
        reasoning_tokens: ``usage.completion_tokens_details.reasoning_tokens`` where the server
            counts them, else None.
        first_content_s: seconds from the request to the first answer text (after any
            thinking; streamed answers only, None otherwise or when no answer came).
    """
    content: str
    reasoning: str | None
    finish_reason: str | None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    first_content_s: float | None = None

    @property
    def finished(self) -> bool:
        """False when the token budget ended the answer (``finish_reason == "length"``)."""
        return self.finish_reason != "length"

    def segment(self) -> dict:
        """The fields a behaviour segment takes (:func:`qeval.measure.behaviour.summarise_behaviour`):
        ``text`` (the answer alone), ``reasoning`` and ``finished``."""
        return {"text": self.content, "reasoning": self.reasoning, "finished": self.finished}


def chat_answer(parts: Sequence[tuple[float, dict]], t0: float | None = None) -> ChatAnswer:
    """A :class:`ChatAnswer` from a whole chat answer (one part) or a stream's chunks
    (``(arrival time, chunk)``; ``choices[0].delta`` pieces joined, the last
    ``finish_reason`` and ``usage`` kept), ``t0`` the request's send time."""
    content, reasoning, finish, usage, first = [], [], None, None, None
    streamed = False
    for t, d in parts:
        usage = d.get("usage") or usage
        for ch in (d.get("choices") or [])[:1]:
            m = ch.get("delta")
            streamed = streamed or m is not None
            text, thought = message_parts(m if m is not None else ch.get("message") or {})
            if text and first is None and m is not None and t0 is not None:
                first = t - t0
            content.append(text)
            if thought is not None:
                reasoning.append(thought)
            finish = ch.get("finish_reason") or finish
    details = (usage or {}).get("completion_tokens_details") or {}
    rt = details.get("reasoning_tokens")
    ct = (usage or {}).get("completion_tokens")
    return ChatAnswer("".join(content), "".join(reasoning) if reasoning else None, finish,
                      int(ct) if ct is not None else None, int(rt) if rt is not None else None,
                      first if streamed else None)


def prompt_topk(answer: dict, k: int) -> list[list[tuple[int, float]] | None] | None:
    """Per prompt position, the ``k`` most probable ``(token id, logprob)`` from vLLM's
    ``choices[0].prompt_logprobs`` (entries ``{"<id>": {"logprob", "rank", ...}}``; ``rank``
    1-based; a bare float is taken as the logprob). Entry ``i`` is the distribution of
    prompt token ``i`` given tokens ``[:i]``; entry 0 is None. None when the answer has no
    ``prompt_logprobs`` (the server ignored the request field)."""
    ch = (answer.get("choices") or [{}])[0] or {}
    rows = ch.get("prompt_logprobs", answer.get("prompt_logprobs"))
    if not isinstance(rows, list):
        return None
    out: list[list[tuple[int, float]] | None] = []
    for d in rows:
        if not d:
            out.append(None)
            continue
        ent = []
        for key, v in d.items():
            tid = int(str(key).split(":", 1)[1]) if str(key).startswith("token_id:") else int(key)
            lp, rank = (float(v["logprob"]), v.get("rank")) if isinstance(v, dict) else (float(v), None)
            ent.append((rank if rank is not None else 1 << 30, -lp, tid, lp))
        ent.sort()  # by rank, then by logprob: ties and missing ranks alike
        out.append([(tid, lp) for _, _, tid, lp in ent[:k]])
    return out


class OpenAIEngine:
    """A tier served over HTTP (see the module notes).

    Open it through :meth:`open`: ``options.server`` holds the tier's ``endpoint`` or
    ``serve`` settings, the server log's path, the tier's name, the source tokenizer's
    folder and the depth-prompt texts the tokenizer check sends.

    Attributes (beyond :class:`qeval.engines.base.Engine`'s):
        client: the :class:`Client`.
        server: the :class:`~qeval.engines.servers.ManagedServer` qeval started (None for
            an endpoint).
        kind: the managed server's :class:`~qeval.engines.servers.ServerKind` (None for
            an endpoint).
        topk: the log-probabilities per position the server returns when scoring (k).
        prompt_logprobs: True when scoring asks for the whole sequence's positions in one
            request (vLLM ``prompt_logprobs``); False: one request per position.
        tokenizer_check: ``[{"text_tokens", "server_tokens"}]`` of the check that passed
            (chat mode: also ``difference``, reported, never failed: :func:`check_tokenizer`).
        restarts: times the managed server was restarted to empty its KV pool.
        prompt_mode: ``tokens``, ``text`` or ``chat`` (:data:`PROMPT_MODES`).
    """

    name = "openai"
    formats = ("gguf", "hf", "gptqmodel")
    decode_mode = None
    decode_note = None
    kv_requant_period = None
    capabilities = Capabilities(score=True, generate=True, batch=False, memory_counter="server", kv_bytes=False,
                                lm_eval=False)
    last_cache_allocated_bytes = None  # the server owns its cache

    @classmethod
    def warm_runtime(cls, source_path: str, options: EngineOptions) -> dict:
        """What runs in this process: httpx and the source tokenizer's library (the model and
        its runtime live in the server process, measured there)."""
        import httpx  # start-up time: only served tiers talk HTTP
        out = {"libraries": [f"httpx {httpx.__version__}"], "in_process": "HTTP client only"}
        serve = (options.server or {}).get("serve") or {}
        if serve.get("kind") == "llama-server":  # built here (untimed) when missing, not in the timed load
            from .llama_tools import tool_path  # start-up time: the build helpers only for llama-server
            t0 = time.time()
            tool_path("llama-server", log=lambda m: print(f"[qeval] {m}", flush=True))
            out["kernel_build_seconds"] = round(time.time() - t0, 1)
        return out

    @classmethod
    def open(cls, fmt: str, path: Path | None, options: EngineOptions) -> "OpenAIEngine":
        """Start the tier's server on ``path`` (``serve``) or connect to its endpoint.

        Raises:
            ValueError: another format, or neither ``endpoint`` nor ``serve`` set.
            TierUnavailable: a server that cannot run on this device, or is not installed
                (one line, what to do).
            ServerFailed: the server did not start (its log tail attached).
            EndpointError, TokenizerMismatch: the endpoint or its tokenizer (one line).
        """
        if fmt not in cls.formats:
            raise ValueError(f"the {cls.name} engine serves {', '.join(cls.formats)} artifacts, not {fmt!r}")
        s = dict(options.server or {})
        endpoint = EndpointSpec.model_validate(s["endpoint"]) if s.get("endpoint") else None
        serve = parse_serve(s["serve"]) if s.get("serve") else None
        if (endpoint is None) == (serve is None):
            raise ValueError("the openai engine needs exactly one of endpoint: and serve:")
        return cls(fmt, path, options, endpoint=endpoint, serve=serve, log_path=s.get("log"),
                   tokenizer=s.get("tokenizer"), depth_text=s.get("depth_text"), depths=s.get("depths") or (),
                   tokens=s.get("tokens") or {}, tier=s.get("tier"), prompt_logprobs=s.get("prompt_logprobs"),
                   prompt_mode=s.get("prompt_mode"), prefix_caching=bool(s.get("prefix_caching")))

    def __init__(self, fmt: str, path: Path | None, options: EngineOptions, *, endpoint: EndpointSpec | None,
                 serve: ServeOptions | None, log_path: str | None, tokenizer: str | None,
                 depth_text: str | Path | None = None, depths: Sequence[int] = (),
                 tokens: dict | None = None, tier: str | None = None, prompt_logprobs: bool | None = None,
                 prompt_mode: str | None = None, prefix_caching: bool = False) -> None:
        from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes
        if (prompt_mode or "tokens") not in PROMPT_MODES:
            raise ValueError(f"prompt_mode {prompt_mode!r} is not one of {', '.join(PROMPT_MODES)}")
        named, prompt_mode = endpoint_dialect(endpoint, prompt_mode)
        self.prompt_mode = prompt_mode or "tokens"
        self._server_timings: list[dict] = []  # a native dialect's own timings per answer (Ollama's; served_info)
        self._counts: set[str] = set()  # where answer token counts came from (served_info)
        self.server: ManagedServer | None = None
        self.kind: Any = None
        self.serve = serve
        self.launch: Launch | None = None
        self.tier = tier or "?"
        self.restarts = 0
        self._scratch: str | None = None
        self.flash_attn: bool | None = None
        self._attention: dict = {"flash_attn": None, "kv_cache_dtype": None}
        self.sampling = {"decode": "argmax (temperature 0, top_k 1)", "ignored_file_defaults": {}}
        self.topk = DEFAULT_TOPK
        self.score_topk = self.topk  # the fidelity stage's KLD is the top-k estimate
        self.topk_skipped = 0  # text mode: scored positions the server gave no top-k for (skipped, counted)
        self.prompt_logprobs = False  # set from the server's dialect once connected
        self.last_cache_bytes = None
        self.kv_cache = options.kv_cache
        self.device = options.device
        self.tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
        if serve is not None:
            try:
                url = self._start(fmt, path, options, serve, Path(log_path or "server.log"), tokens or {}, tokenizer,
                                  prefix_caching)
            except BaseException:
                self.close()  # its scratch folder and counter too
                raise
            key, timeout = None, 600.0
        else:
            url, key, timeout = endpoint.url, api_key(endpoint), endpoint.timeout_s
        self.client = Client(url, key, timeout)
        self.client.settings = wire_settings(tokens or {})
        try:
            self.client.connect(endpoint.model if endpoint else None,
                                self.kind.dialect if self.kind is not None else named)
            self.backend = f"{self.server.name}-{self.device}" if self.server else f"endpoint ({self.client.dialect})"
            self.prompt_logprobs = self.client.dialect == "vllm" if prompt_logprobs is None else bool(prompt_logprobs)
            if self.prompt_mode != "tokens":
                self.prompt_logprobs = False  # the server's positions are its own tokenization of the text
                if self.tok is None:
                    raise ValueError(f"prompt_mode {self.prompt_mode} needs the source tokenizer")
            self.vocab_size = len(self.tok) if self.tok is not None else 0
            try:
                texts = depth_texts(self.tok, depth_text, depths) if self.tok is not None and depth_text else []
                self.tokenizer_check = check_tokenizer(self.client, self.tok, texts,
                                                       self.prompt_mode) if self.tok else []
                if self.server is not None and texts:  # the check's long prompts leave the pool
                    self.clear_kv_pool("the tokenizer check")
            except Exception as e:  # noqa: BLE001 - a server dying here is the reason
                self._alive(e)
        except BaseException:
            self.close()
            raise

    # -- the server ----------------------------------------------------------------------
    def _start(self, fmt: str, path: Path | None, options: EngineOptions, serve: ServeOptions, log: Path,
               tokens: dict, tokenizer: str | None, prefix_caching: bool = False) -> str:
        """Start the managed server ``serve.kind``; ``tokens``: ``sequence`` (the longest
        sequence), ``load_sequence`` (one load request) and ``model`` (the model's context).

        Raises:
            TierUnavailable: the server cannot serve ``fmt`` on this device, or is not installed.
        """
        kind = get_server(serve.kind)
        why = kind.check(fmt, options.device)
        if why:
            raise TierUnavailable(why)
        self.kind = kind
        self._scratch = tempfile.mkdtemp(prefix="qeval-server-")
        self.launch = Launch(artifact=Path(path) if path is not None else Path("."), fmt=fmt, port=free_port(),
                             threads=options.threads, parallel=serve.parallel or 1, tokens=dict(tokens),
                             kv_cache=options.kv_cache, flash_attn=options.flash_attn, device=options.device,
                             tokenizer=tokenizer, scratch=Path(self._scratch), prefix_caching=prefix_caching)
        self._attention = kind.attention(serve, self.launch)
        self.flash_attn = self._attention.get("flash_attn")
        binary = kind.binary()
        env = dict(os.environ, **kind.env(serve)) if kind.env(serve) else None
        self.server = ManagedServer(kind.command(binary, serve, self.launch), port=self.launch.port, log_path=log,
                                    name=kind.kind, health_path=kind.health_path, env=env, device=options.device)
        self._launch_server(serve.startup_timeout_s)
        return self.server.url

    def _launch_server(self, timeout_s: float) -> None:
        """Start (or start again) the managed server and wait until it is ready."""
        print(f"[qeval] starting {self.server.name} on 127.0.0.1:{self.server.port} (log {self.server.log_path})",
              flush=True)
        try:
            self.server.start(timeout_s)
        except ServerFailed as e:
            _print_tail(e)
            raise
        print(f"[qeval] {self.server.name} ready (pid {self.server.pid})", flush=True)

    def _alive(self, err: BaseException | None = None) -> None:
        """Raise :class:`ServerFailed` (its log tail printed to this stage's log) when the
        managed server died; else re-raise ``err`` when given."""
        if err is not None and self.server is not None and self.server.proc is not None:
            try:  # a connection cut by a dying server is seen before its exit status: wait for it
                self.server.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - still running: the error is the server's answer
                pass
        died = self.server.died() if self.server is not None else None
        if died is not None:
            _print_tail(died)
            raise died from None
        if err is not None:
            raise err

    def _died_or(self, err: BaseException) -> None:
        """Raise :class:`ServerFailed` when the managed server died (``err`` is then only
        what the client saw of it); return otherwise."""
        try:
            self._alive(err)
        except ServerFailed:
            raise
        except Exception:  # noqa: BLE001 - the server lives: err is its answer, the caller words it
            pass

    # -- the KV pool ---------------------------------------------------------------------
    def _pool_fail(self, phase: str, why: str) -> PoolNotCleared:
        return PoolNotCleared(f"tier {self.tier}: the KV pool of {self.server.name} (pid {self.server.pid}) "
                              f"was not empty at the start of {phase}: {why}")

    def clear_kv_pool(self, phase: str) -> dict:
        """Empty the managed server's KV pool before ``phase`` and check it is empty: the
        server's own API (:meth:`~qeval.engines.servers.ServerKind.clear_pool`), or a
        restart where the server has none.

        Returns:
            ``{"phase", "cleared_by", "before", "after", "empty_at_start"}``: what was done
            (``erase_slots``, ``reset_prefix_cache``, ``flush_cache``, ``restart``) and the
            server's counters at the start (``after`` is filled by :meth:`kv_pool_phase`).

        Raises:
            PoolNotCleared: the clear failed or the pool still holds something (one line
                naming the tier, the server and the phase).
            ServerFailed: the server died.
        """
        if os.environ.get("QEVAL_TEST_POOL_NOT_CLEARED") == self.tier:  # test-only: a clear that does nothing
            action = "none (test fault)"
        else:
            try:
                action = self.kind.clear_pool(self.client.http, self.launch.parallel)
            except NotImplementedError:
                self.server.stop(keep_counter=True)
                self._launch_server(self.serve.startup_timeout_s)
                self.restarts += 1
                action = "restart"
            except Exception as e:  # noqa: BLE001 - the server's refusal or a dead server
                self._died_or(e)
                raise self._pool_fail(phase, f"it could not be cleared ({_first_line(e)})") from None
        try:
            state = self.kind.pool_state(self.client.http)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason
            self._died_or(e)
            raise self._pool_fail(phase, f"its counters could not be read ({_first_line(e)})") from None
        if not state.empty:
            raise self._pool_fail(phase, f"after {action}, {state.why}")
        return {"phase": phase, "cleared_by": action, "before": dict(state.counters), "after": None,
                "empty_at_start": True}

    @contextmanager
    def kv_pool_phase(self, phase: str) -> Iterator[dict | None]:
        """A timed phase (a speed depth, a load point) on an empty KV pool: cleared and
        checked on entry (:meth:`clear_kv_pool`), the server's counters read again on exit
        into the record's ``after``. Yields the record (None for an endpoint: not qeval's
        server to clear).

        Raises:
            PoolNotCleared: the pool was not empty at the start (one line).
        """
        if self.server is None:
            yield None
            return
        rec = self.clear_kv_pool(phase)
        if os.environ.get("QEVAL_TEST_KILL_SERVER") == self.tier:  # test-only: the server dies in a timed phase
            self._kill_server_for_test(phase)
        try:
            yield rec
        finally:
            if self.server.alive():
                try:
                    rec["after"] = dict(self.kind.pool_state(self.client.http).counters)
                except Exception:  # noqa: BLE001 - the phase's own error, if any, is the one to see
                    pass

    def _kill_server_for_test(self, phase: str) -> None:
        """Test-only fault at a named point (``QEVAL_TEST_KILL_SERVER=<tier>``, never set in
        normal use): SIGKILL the managed server at the start of this tier's first timed
        phase, its pool cleared, and reap it, so the phase's first request meets a dead
        server (:class:`ServerFailed`, "killed by SIGKILL mid-stage") the same way every time."""
        print(f"[qeval] test fault QEVAL_TEST_KILL_SERVER at {phase}: killing {self.server.name} "
              f"(pid {self.server.pid})", flush=True)
        os.kill(self.server.pid, signal.SIGKILL)
        self.server.proc.wait(timeout=60)

    # -- Engine API ----------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy streamed completion of ``prompt_ids``; token times are chunk arrival times
        (s since the request was sent). Tokens the server held back are counted from
        ``usage.completion_tokens`` at the time of the chunk that released them.

        In ``text`` and ``chat`` modes the prompt goes as text (:meth:`generate_text`).

        Raises:
            ServerFailed: the managed server died (its log tail printed to the stage log).
            RuntimeError: an HTTP error or a stream without token ids.
        """
        if self.prompt_mode != "tokens":
            return self.generate_text(prompt_ids, max_new_tokens, stop_ids=stop_ids, ignore_stop=ignore_stop)
        self._counts.add(COUNT_IDS)
        stop = set(int(s) for s in stop_ids)
        body = self.client.body([int(t) for t in prompt_ids], max_new_tokens, stream=True, ignore_eos=ignore_stop)
        toks: list[int] = []
        times: list[float] = []
        finished = False
        usage = None
        t0 = time.perf_counter()
        try:
            for t, chunk in self.client.stream(body):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                ids = self.client.token_ids(chunk)
                for i in ids:
                    toks.append(i)
                    times.append(t - t0)
                if not ignore_stop and any(i in stop for i in ids):
                    cut = next(k for k, i in enumerate(toks) if i in stop)
                    toks, times, finished = toks[:cut + 1], times[:cut + 1], True
                    break
        except Exception as e:  # noqa: BLE001 - a dead server is the reason, whatever httpx saw
            self._alive(e)
        self._alive()
        n = int((usage or {}).get("completion_tokens") or 0)
        if not finished and n > len(toks):  # held back (incomplete UTF-8 at the end): their ids from a re-run
            if not toks:
                raise RuntimeError(f"the server streamed {n} tokens without token ids ({self.client.dialect} dialect)")
            full = self._answer_ids(prompt_ids, max_new_tokens, ignore_stop)
            if full[:len(toks)] != toks[:len(full)]:
                full = toks + [-1] * (n - len(toks))
            times = _spread(times, len(full))
            toks = full[:len(times)]
        return Generation(toks, times[0] if times else 0.0, times, finished)

    # -- text and chat modes ------------------------------------------------------------------
    def prompt_text(self, prompt_ids: Sequence[int]) -> str:
        """The prompt ids as text for a text-mode server: the source tokenizer's decode with
        special tokens kept (the chat template's markers, which servers parse as special
        tokens), less a leading BOS where the source tokenizer adds one itself (the server
        adds its own as it tokenizes, as the tokenizer check counts)."""
        ids = [int(t) for t in prompt_ids]
        bos = getattr(self.tok, "bos_token_id", None)
        if ids and bos is not None and ids[0] == bos and self._adds_bos():
            ids = ids[1:]
        return self.tok.decode(ids, skip_special_tokens=False)

    def _adds_bos(self) -> bool:
        """Whether the source tokenizer puts BOS before a text it encodes."""
        if not hasattr(self, "_bos_added"):
            ids = self.tok("a")["input_ids"]
            self._bos_added = bool(ids) and ids[0] == self.tok.bos_token_id
        return self._bos_added

    def _turn_end(self, stop_ids: Sequence[int]) -> int | None:
        """The stop id an answer that ended on its own gets appended (text answers carry no
        stop token): the tokenizer's eos when it is a stop id, else the first stop id."""
        stop = [int(s) for s in stop_ids]
        eos = getattr(self.tok, "eos_token_id", None)
        return eos if eos is not None and eos in stop else (stop[0] if stop else None)

    def generate_text(self, prompt_ids: Sequence[int] | None, max_new_tokens: int, *, stop_ids: Sequence[int] = (),
                      ignore_stop: bool = False, messages: Sequence[dict] | None = None) -> Generation:
        """A greedy streamed answer in ``text`` or ``chat`` mode, read as text.

        Args:
            prompt_ids: the prompt qeval built (the source's chat template rendered); text
                mode sends :meth:`prompt_text` of it to ``/v1/completions``; chat mode, when
                ``messages`` is None, sends it as one user message holding that text.
            max_new_tokens: the answer's budget (``max_tokens``).
            stop_ids: stop ids; an answer the server ended itself (``finish_reason`` ``stop``)
                gets one appended (:meth:`_turn_end`), as the token mode's answers end with theirs.
            ignore_stop: the speed sweep's fixed length (``ignore_eos``).
            messages: chat mode: the conversation (``[{"role", "content"}]``).

        Returns:
            :class:`Generation`: ``token_ids`` the source tokenizer's ids of the answer text
            (plus the stop id); ``token_times_s`` one per counted token (the server's
            ``usage.completion_tokens``, else the source tokenizer's count), each the
            arrival time of the text chunk that brought it (s since the request; tokens
            beyond the chunks take the last chunk's time).

        Raises:
            ServerFailed: the managed server died.
            RuntimeError: an HTTP error.
        """
        if self.prompt_mode == "chat":
            msgs = list(messages) if messages is not None else [{"role": "user", "content": self.prompt_text(prompt_ids)}]
            body, path = self.client.chat_body(msgs, max_new_tokens, stream=True, ignore_eos=ignore_stop), \
                "/v1/chat/completions"
        else:
            body, path = self.client.text_body(self.prompt_text(prompt_ids), max_new_tokens, stream=True,
                                               ignore_eos=ignore_stop), "/v1/completions"
        join = _TextJoin()
        times: list[float] = []
        finish, usage = None, None
        t0 = time.perf_counter()
        try:
            for t, chunk in self.client.stream(body, path):
                usage = chunk.get("usage") or usage
                piece, fin = chunk_text(chunk)
                if join.add(piece):
                    times.append(t - t0)
                finish = fin or finish
                if chunk.get("ollama") and len(self._server_timings) < MAX_TIMINGS:  # Ollama's own timings
                    self._server_timings.append(chunk["ollama"])
        except Exception as e:  # noqa: BLE001 - a dead server is the reason, whatever httpx saw
            self._alive(e)
        self._alive()
        text = join.text()
        ids = [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]] if text else []
        finished = finish == "stop" and not ignore_stop
        end = self._turn_end(stop_ids) if finished else None
        if end is not None:
            ids.append(end)
        served = (usage or {}).get("completion_tokens")
        n = int(served) if served is not None else len(ids)
        self._counts.add(self.client.wire.usage_source if served is not None else COUNT_SOURCE)
        if not times:
            times = [time.perf_counter() - t0] if n else []
        return Generation(ids, times[0] if times else 0.0, _spread(times, n) if n else [], finished)

    def generate_messages(self, messages: Sequence[dict], max_new_tokens: int, *, stop_ids: Sequence[int] = (),
                          ignore_stop: bool = False) -> Generation:
        """Chat mode: the answer to ``messages`` (the suite's conversation), the server's
        template applied (:meth:`generate_text`).

        Raises:
            RuntimeError: not a chat-mode engine, or an HTTP error.
            ServerFailed: the managed server died.
        """
        if self.prompt_mode != "chat":
            raise RuntimeError(f"generate_messages needs prompt_mode chat (this tier: {self.prompt_mode})")
        return self.generate_text(None, max_new_tokens, stop_ids=stop_ids, ignore_stop=ignore_stop, messages=messages)

    # -- serving (the load workloads, :mod:`qeval.serving`) ---------------------------------------
    def open_core(self, spec: Any, clock: Any) -> Any:
        """The engine core every load workload drives (:class:`qeval.engines.openai_core.OpenAICore`:
        one streamed request per thread, the server schedules). Entering it starts a KV-pool
        phase (:meth:`kv_pool_phase`, named by ``spec.label``).

        Raises:
            PoolNotCleared, ServerFailed: as :meth:`kv_pool_phase`, when the core is entered.
        """
        from .openai_core import OpenAICore  # start-up time: only load stages serve batches
        return OpenAICore(self, spec, clock)

    def prefix_how(self) -> str:
        """How the server reuses a shared prefix's KV cache, one line (by dialect)."""
        return {"llama.cpp": "llama-server cache_prompt: true (a slot keeps its cached prompt)",
                "vllm": "vLLM --enable-prefix-caching",
                "ollama": "Ollama's own prompt cache (a runner slot keeps its last prompt)"}.get(
                    self.client.dialect, "the server's prompt cache")

    def wire_request(self, prompt_ids: Sequence[int], max_tokens: int, *, ignore_eos: bool = True,
                     cache_prompt: bool = False) -> tuple[str, dict]:
        """``(path, body)`` of one streamed load request for ``prompt_ids`` in this tier's
        prompt mode (token ids, :meth:`prompt_text`, or that text as one user message)."""
        if self.prompt_mode == "chat":
            msgs = [{"role": "user", "content": self.prompt_text(prompt_ids)}]
            return "/v1/chat/completions", self.client.chat_body(msgs, max_tokens, stream=True, ignore_eos=ignore_eos)
        if self.prompt_mode == "text":
            return "/v1/completions", self.client.text_body(self.prompt_text(prompt_ids), max_tokens, stream=True,
                                                            ignore_eos=ignore_eos, cache_prompt=cache_prompt)
        return "/v1/completions", self.client.body([int(t) for t in prompt_ids], max_tokens, stream=True,
                                                   ignore_eos=ignore_eos, cache_prompt=cache_prompt)

    def wire_tokens(self, chunk: dict) -> list[int]:
        """The tokens one streamed load chunk brings: the dialect's ids in ``tokens`` mode;
        in ``text`` and ``chat`` modes one placeholder ``-1`` per chunk that carries text
        (servers stream a token a chunk; the load figures count chunks)."""
        if self.prompt_mode == "tokens":
            return chunk_token_ids(chunk)
        return [-1] if chunk_text(chunk)[0] else []

    @property
    def fidelity_note(self) -> str | None:
        """Why teacher-forced fidelity cannot be measured on this tier (None: it can): chat
        mode (a chat route takes no reference tokens to score: no teacher-forced
        log-probabilities), and text mode on a dialect without top-k log-probabilities by
        token id (a plain OpenAI server, SGLang). Text mode on llama-server or vLLM is scored
        one request per position on the decoded prefix (:meth:`topk_at`), the top-k estimate."""
        if self.prompt_mode == "chat":
            return "fidelity not measurable on this endpoint (prompt_mode chat: no teacher-forced log-probabilities)"
        if self.prompt_mode == "text" and not self.client.wire.logprobs:
            return (f"fidelity not measurable on this endpoint (prompt_mode text: the {self.client.dialect} "
                    f"dialect returns no top-k log-probabilities by token id)")
        return None

    def served_info(self) -> dict:
        """What the row says about how this tier was served: ``prompt_mode``, ``token_counts``
        (where the answers' token counts came from: :data:`COUNT_USAGE`, :data:`COUNT_SOURCE`,
        :data:`COUNT_IDS`, joined with " and " when answers differed; None before any answer),
        ``dialect``, ``tokenizer_check`` (the check's rows) and ``fidelity`` (None, or
        :attr:`fidelity_note`); on the ollama dialect, once it answered, ``ollama_timings``:
        Ollama's own prompt and decode tokens/s and load seconds over this engine's answers
        (the speed requests of a measure stage), beside the client's figures in ``speed``
        (:func:`qeval.engines.servers.ollama.summarise_timings`)."""
        out = {"prompt_mode": self.prompt_mode,
               "token_counts": " and ".join(sorted(self._counts)) if self._counts else None,
               "dialect": self.client.dialect, "tokenizer_check": list(self.tokenizer_check),
               "fidelity": self.fidelity_note}
        if self._server_timings:
            from .servers.ollama import summarise_timings  # start-up time: only Ollama tiers have these
            out["ollama_timings"] = summarise_timings(self._server_timings)
        return out

    def _answer_ids(self, prompt_ids: Sequence[int], max_new_tokens: int, ignore_stop: bool) -> list[int]:
        """Every answer token id, non-streamed (the dialect's own route where it has one,
        e.g. llama-server's native ``/completion`` with ``return_tokens``; else the ids of
        a ``/v1/completions`` answer).

        Raises:
            ServerFailed: the managed server died during the request (CI saw this re-run cut
                by a SIGKILL: httpx's RemoteProtocolError is not the reason, the death is).
        """
        try:
            own = self.client.wire.answer_ids(self.client.post, prompt_ids, max_new_tokens, ignore_stop)
            if own is not None:
                return own
            d = self.client.post("/v1/completions", self.client.body([int(t) for t in prompt_ids], max_new_tokens,
                                                                     stream=False, ignore_eos=ignore_stop))
            return self.client.token_ids(d)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason, whatever httpx saw
            self._alive(e)
            raise

    def chat(self, messages: Sequence[dict], max_new_tokens: int, *, stream: bool = True) -> ChatAnswer:
        """A greedy ``/v1/chat/completions`` answer to ``messages`` (``[{"role", "content"}]``)
        with the thinking of a reasoning model kept apart (:class:`ChatAnswer`): for endpoints
        that serve chat, where the server's chat template and reasoning parser apply (the
        suites send token ids to ``/v1/completions`` instead, where thinking stays inline).

        Raises:
            ServerFailed: the managed server died.
            RuntimeError: an HTTP error.
        """
        body: dict[str, Any] = {"model": self.client.model, "messages": list(messages),
                                "max_tokens": int(max_new_tokens), "temperature": 0.0, "top_p": 1.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        try:
            if stream:
                return chat_answer(list(self.client.stream(body, "/v1/chat/completions")), t0)
            return chat_answer([(time.perf_counter(), self.client.post("/v1/chat/completions", body))], t0)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason, whatever httpx saw
            self._alive(e)
            raise

    def topk_at(self, prefix: Sequence[int]) -> list[tuple[int, float]]:
        """The server's top-``k`` ``(token id, logprob)`` of the token after ``prefix``.

        In ``text`` mode the prefix goes as text (:meth:`prompt_text`).

        Raises:
            RuntimeError: a chat-mode tier (:attr:`fidelity_note`), the server's dialect gives
                no log-probabilities by token id (SGLang, a plain OpenAI server), or the
                answer held none.
        """
        if self.prompt_mode == "chat":
            raise RuntimeError(self.fidelity_note)
        if not self.client.wire.logprobs:
            raise RuntimeError(f"the {self.client.dialect} dialect gives no top-k log-probabilities by token id: "
                               "this tier cannot be scored over HTTP")
        prompt = self.prompt_text(prefix) if self.prompt_mode == "text" else [int(t) for t in prefix]
        body = self.client.body(prompt, 1, stream=False, logprobs=self.topk, cache_prompt=True)
        try:
            d = self.client.post("/v1/completions", body)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason
            self._alive(e)
            raise
        rows = self.client.wire.topk(d) or self._topk_by_text(self.client.wire.topk_text(d))
        if not rows or not rows[0]:
            raise NoTopK(f"the server returned no top-{self.topk} log-probabilities")
        return rows[0]

    def _topk_by_text(self, rows: Sequence[Sequence[tuple[str, float]]]) -> list[list[tuple[int, float]]]:
        """Top-k rows by token text (Ollama's ``top_logprobs``) as ``(source token id,
        logprob)``: a text maps to the one source token that decodes to it alone
        (:meth:`_piece_ids`); a text no token or several tokens decode to is left out, its
        mass going to the rest (the top-k estimate stays a lower bound)."""
        if not rows:
            return []
        pieces = self._piece_ids()
        return [[(pieces[t], lp) for t, lp in row if t in pieces] for row in rows]

    def _piece_ids(self) -> dict[str, int]:
        """``{text: id}`` over the source vocabulary: each id decoded alone
        (``tok.decode([id])``), texts that several ids decode to dropped. Built once."""
        if getattr(self, "_pieces", None) is None:
            seen: dict[str, int] = {}
            twice: set[str] = set()
            for i in range(len(self.tok)):
                t = self.tok.decode([i])
                if t in seen:
                    twice.add(t)
                seen[t] = i
            self._pieces = {t: i for t, i in seen.items() if t not in twice}
        return self._pieces

    def sequence_topk(self, ids: Sequence[int]) -> list[list[tuple[int, float]] | None] | None:
        """The server's top-``k`` at every position of ``ids`` in one request (vLLM
        ``prompt_logprobs``, ``max_tokens 1``): entry ``i`` for token ``i`` given ``ids[:i]``.
        None when the server answered without ``prompt_logprobs``: :attr:`prompt_logprobs` is
        then turned off (one request per position from then on).

        Raises:
            ServerFailed: the managed server died.
            RuntimeError: an HTTP error (a sequence longer than the server's context, a
                ``k`` above vLLM's ``--max-logprobs``), or a list of another length than ``ids``.
        """
        body = self.client.body([int(t) for t in ids], 1, stream=False, logprobs=1, prompt_logprobs=self.topk)
        try:
            d = self.client.post("/v1/completions", body)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason
            self._alive(e)
            raise
        rows = prompt_topk(d, self.topk)
        if rows is None:
            print(f"[qeval] {self.backend} answered without prompt_logprobs: scoring one request per position",
                  flush=True)
            self.prompt_logprobs = False
            return None
        if len(rows) != len(ids):
            raise RuntimeError(f"the server returned prompt_logprobs for {len(rows)} positions of a "
                               f"{len(ids)}-token prompt")
        return rows

    def iter_logprobs(self, token_ids: Sequence[int], window: int = 256,
                      first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Rows of :meth:`qeval.engines.base.Engine.iter_logprobs` from the server's top-k:
        one request for the whole sequence where the server returns ``prompt_logprobs``
        (:meth:`sequence_topk`), else one request per position (:meth:`topk_at`); each row
        holds the top ``k`` log-probabilities at their ids and the remaining mass
        ``1 - sum(top k)`` spread evenly over the other ``vocab - k`` tokens (the top-k
        estimate; :func:`qeval.measure.fidelity.topk_kld_rows` keeps the remaining mass in
        one bucket instead). Shape ``[m, vocab]``, float32. In text mode a position the
        server answers without a top-k is left out (the window is split around it, each
        part yielded with its own start) and counted in :attr:`topk_skipped`.

        Raises:
            RuntimeError: tokens mode, a position without a top-k."""
        ids = [int(t) for t in token_ids]
        n = len(ids)
        first = max(0, int(first))
        step = max(1, int(window))
        seq = self.sequence_topk(ids) if (self.prompt_logprobs and n - 1 > first) else None
        for start in range(first, n - 1, step):
            m = min(step, n - 1 - start)
            out = np.empty((m, self.vocab_size), dtype=np.float32)
            lo = 0  # the first row of the current run of positions that have a top-k
            for j in range(m):
                top = seq[start + j + 1] if seq is not None else self._topk_or_none(ids[:start + j + 1])
                if not top:
                    if self.prompt_mode == "tokens":
                        raise RuntimeError(f"the server returned no top-{self.topk} log-probabilities at position "
                                           f"{start + j + 1}")
                    # text mode: this position is skipped and counted (the row says so, quality_stages);
                    # the rows either side are yielded with their own starts, so positions stay aligned
                    self.topk_skipped += 1
                    if j > lo:
                        yield start + lo, out[lo:j]
                    lo = j + 1
                    continue
                out[j] = topk_row(top, self.vocab_size)
            if m > lo:
                yield start + lo, out[lo:m]

    def _topk_or_none(self, prefix: Sequence[int]) -> list[tuple[int, float]] | None:
        """:meth:`topk_at`, or None where the server answered without a top-k (text mode:
        llama-server sends no log-probabilities for a greedy token that ends in an incomplete
        UTF-8 character, the ``incomplete`` branch of its ``process_token``, llama.cpp
        tools/server/server-context.cpp)."""
        try:
            return self.topk_at(prefix)
        except NoTopK:
            if self.prompt_mode == "tokens":
                raise
            return None

    def attention_info(self, prompt_ids: Sequence[int] | None = None) -> dict:
        """The attention path as the managed server's command sets it (llama-server: flash
        attention on or off, K and V ``f16`` or ``q8_0``); what the command leaves to the
        server, and an endpoint's, are not visible over HTTP (None)."""
        fa = self._attention.get("flash_attn")
        impl = "flash" if fa else ("standard" if fa is False else "not visible over HTTP")
        return {"engine": self.server.name if self.server is not None else "endpoint", "implementation": impl,
                "flash_attn": fa, "kv_cache_dtype": self._attention.get("kv_cache_dtype")}

    def kv_bytes_per_token(self, depth: int = 64) -> float:
        """Not measured through HTTP (the server owns its cache).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("the openai engine cannot see the server's KV cache")

    def memory(self) -> MemoryInfo:
        """No weight bytes from the server (the tier's stored artifact gives them)."""
        return MemoryInfo(0, None, self.device, {"backend": self.backend})

    def kv_pool_tokens(self) -> int | None:
        """KV cells every sequence shares on a managed llama-server (``--ctx-size`` with
        ``--kv-unified``): a load point needing more is not admitted. None elsewhere (vLLM
        sizes its pool from GPU memory and admits requests itself; an endpoint is unknown)."""
        if self.kind is None or self.launch is None or self.kind.kind != "llama-server":
            return None
        return int(self.kind.context_tokens(self.serve, self.launch))

    def peak_counter(self) -> Any:
        """The peak-memory counter of this tier (:meth:`reset`/:meth:`read`/``kind``): the
        managed server's, started before the server (its baseline) and summed over the
        server's process tree (RSS on the CPU, NVML per pid on CUDA:
        :func:`~qeval.engines.servers.tree_memory_counter`); an endpoint's memory cannot
        be seen from here (:class:`NotMeasured`)."""
        if self.server is None or self.server.memory is None:
            return NotMeasured()
        return self.server.memory

    def close(self) -> None:
        """Close the HTTP client; stop and reap a managed server; remove its scratch folder."""
        c = getattr(self, "client", None)
        if c is not None:
            c.close()
        if self.server is not None:
            self.server.stop()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class NotMeasured:
    """The peak counter of a remote endpoint: no figures (``kind`` says why)."""
    kind = "remote_endpoint_not_measured"

    def reset(self) -> None:
        pass

    def read(self) -> None:
        return None

    def reserved_unallocated(self) -> None:
        return None

    def close(self) -> None:
        pass


def topk_row(top: Sequence[tuple[int, float]], vocab: int) -> np.ndarray:
    """A full-vocabulary log-probability row from top-k ``(id, logprob)``: the k at their
    ids, the remaining mass spread evenly over the other ``vocab - k`` ids (floored at
    1e-30 so every log is finite). Shape ``[vocab]``, float32."""
    k = len(top)
    ids = np.array([i for i, _ in top], dtype=np.int64)
    lp = np.array([v for _, v in top], dtype=np.float64)
    rest = max(1.0 - float(np.exp(lp).sum()), 1e-30)
    row = np.full(vocab, np.log(rest / max(vocab - k, 1)), dtype=np.float64)
    row[ids] = lp
    return row.astype(np.float32)


def _spread(times: list[float], n: int) -> list[float]:
    """``n`` token times from the observed chunk times: held-back tokens take the time of
    the last chunk (they reached the client no earlier)."""
    if len(times) >= n:
        return times[:n]
    return times + [times[-1]] * (n - len(times))


def _first_line(e: BaseException) -> str:
    """An exception's class and first line, cut to 200 characters."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{e.__class__.__name__}: {text}"[:200] if not isinstance(e, RuntimeError) else text[:200]


def _print_tail(e: ServerFailed) -> None:
    """The one-line reason into this stage's log (the stage worker prints the server log's
    tail, :attr:`ServerFailed.log_tail`, after the traceback, where the row's tail shows it)."""
    print(f"[qeval] {e}", file=sys.stderr, flush=True)


def check_tokenizer(client: Client, tok: Any, texts: Sequence[str], mode: str = "tokens") -> list[dict]:
    """Each text sent as text (``max_tokens`` 1): the server's ``usage.prompt_tokens``
    against the source tokenizer's count (special tokens added as the tokenizer adds them).

    ``mode`` ``tokens`` and ``text`` (``/v1/completions``): a count that differs fails; in
    ``text`` mode a server that sends no ``usage`` cannot be checked (the row says so).
    ``chat``: each text goes as one user message to ``/v1/chat/completions``, where the
    server renders its own template; its count against the source template's rendering
    of the same message is reported (``difference``, server less source), never failed.

    Returns:
        ``[{"text_tokens", "server_tokens"}]`` per text (``server_tokens`` None: no usage
        sent); chat mode adds ``difference`` (None when either count is missing).

    Raises:
        TokenizerMismatch: a count differs (both counts named; not in chat mode).
        EndpointError: the server refused the request.
    """
    out = []
    for text in texts:
        if mode == "chat":
            msgs = [{"role": "user", "content": text}]
            try:
                want: int | None = len(_template_ids(tok, msgs))
            except Exception:  # noqa: BLE001 - a source without a chat template: nothing to compare
                want = None
            path, body = "/v1/chat/completions", client.chat_body(msgs, 1, stream=False)
        else:
            want = len(tok(text)["input_ids"])
            path = "/v1/completions"
            body = client.body(text, 1, stream=False, logprobs=0) if mode == "tokens" else \
                client.text_body(text, 1, stream=False)
        try:
            d = client.post(path, body)
        except EndpointError:
            raise
        except RuntimeError as e:
            raise EndpointError(f"{client.base_url} refused a completion: {e}", field="endpoint.url") from None
        count = (d.get("usage") or {}).get("prompt_tokens")
        got = int(count) if count is not None else None
        if mode == "chat":
            out.append({"text_tokens": want, "server_tokens": got,
                        "difference": got - want if got is not None and want is not None else None})
            continue
        if got is None and mode == "text":
            out.append({"text_tokens": want, "server_tokens": None})
            continue
        if got != want:
            raise TokenizerMismatch(f"the server counts {got if got is not None else -1} prompt tokens where the "
                                    f"source tokenizer counts {want} (a depth prompt of {len(text)} characters): "
                                    "it serves another tokenizer", field="endpoint")
        out.append({"text_tokens": want, "server_tokens": got})
    return out


def _template_ids(tok: Any, messages: Sequence[dict]) -> list[int]:
    """``messages`` with a generation prompt, as ids, in the source tokenizer's prompt format
    (:func:`qeval.measure.prompt_format.render_chat`: the one rendering every prompt goes through)."""
    from ..measure.prompt_format import render_chat  # start-up time: only the chat-mode token check renders
    return render_chat(tok, messages, add_generation_prompt=True, tokenize=True)


def depth_texts(tok: Any, depth_text: str | Path, depths: Sequence[int]) -> list[str]:
    """The depth prompts as text: the first ``d`` tokens of the depth text decoded, per
    depth, with runs of whitespace collapsed to one space: llama.cpp and transformers
    split a run of newlines differently on the very same vocabulary (``"\\n\\n"`` one
    token or two), which is no sign of another tokenizer (qeval sends token ids, never text)."""
    from ..measure.speed import depth_prompt_ids  # start-up time: the speed module is only needed here
    return [" ".join(tok.decode(depth_prompt_ids(tok, depth_text, int(d))).split()) for d in depths]


def preflight_endpoint(spec: EndpointSpec, *, tokenizer: str | Path | None = None,
                       depth_text: str | Path | None = None, depths: Sequence[int] = (),
                       prompt_mode: str | None = None) -> dict:
    """Before any stage: the endpoint answers ``/v1/models`` (the dialect's own list:
    Ollama's ``/api/tags``, the model pulled) with the key and, given the source tokenizer,
    counts the depth prompts' tokens as it does (the prompts of ``depths`` tokens cut from
    ``depth_text``, :func:`depth_texts`; in ``prompt_mode`` chat on its chat route, the
    difference reported: :func:`check_tokenizer`). ``spec.dialect`` names the dialect
    (:func:`endpoint_dialect`: Ollama's native routes, chat mode unless the tier says text).

    Returns:
        ``{"model", "dialect", "tokenizer_check"}``.

    Raises:
        EndpointError: unset key variable, unreachable URL, refused key, no model (Ollama:
            one line naming ``ollama pull``), prompt_mode tokens on Ollama's dialect.
        TokenizerMismatch: a depth prompt counted differently.
    """
    named, prompt_mode = endpoint_dialect(spec, prompt_mode)
    client = Client(spec.url, api_key(spec), min(spec.timeout_s, 120.0))
    if depths:  # Ollama's num_ctx: room for the deepest check prompt (the stage sets the tier's own)
        client.settings = wire_settings({"sequence": max(int(d) for d in depths) + 1})
    try:
        client.connect(spec.model, named)
        checked = []
        mode = prompt_mode or "tokens"
        if mode == "chat":  # the key, on a route that needs it (the one this tier uses)
            client.post("/v1/chat/completions", client.chat_body([{"role": "user", "content": "Hello"}], 1,
                                                                 stream=False))
        else:
            client.post("/v1/completions", client.body("Hello", 1, stream=False, logprobs=0) if mode == "tokens"
                        else client.text_body("Hello", 1, stream=False))
        if tokenizer is not None:
            from transformers import AutoTokenizer  # start-up time: only endpoint tiers check a tokenizer here
            tok = AutoTokenizer.from_pretrained(str(tokenizer))
            checked = check_tokenizer(client, tok, depth_texts(tok, depth_text, depths) if depth_text else [], mode)
        return {"model": client.model, "dialect": client.dialect, "tokenizer_check": checked}
    finally:
        client.close()


ENGINE = OpenAIEngine
