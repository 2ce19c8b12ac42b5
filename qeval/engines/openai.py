"""Engine over an OpenAI-compatible HTTP endpoint (``engine: openai``): a server that
already runs (``endpoint: {url, api_key_env}``) or one qeval starts on the tier's artifact
(``serve: llama-server | vllm``, :mod:`qeval.engines.servers`).

What goes over the wire (httpx; the OpenAI client library was checked: it hides the
stream's chunk arrival times behind its own iterator and retries, and knows none of the
servers' token-id extensions):

* ``POST /v1/completions`` with the prompt as token ids from the source model's Hugging
  Face tokenizer (llama-server and vLLM both take a list of ints), ``stream: true`` and
  ``stream_options.include_usage``: TTFT and every inter-token time are chunk arrival
  times (``time.perf_counter`` when the chunk's line is read). Greedy: ``temperature 0``,
  ``top_k 1``, no penalties; prompt caching off (llama-server ``cache_prompt: false``,
  vLLM started with ``--no-enable-prefix-caching``), so a repeated speed prompt is
  prefilled again. A stop token ends the answer as in the in-process engines; the speed
  sweep asks for ``ignore_eos`` (a fixed length, as vLLM ``bench serve --ignore-eos``).
* token ids of the answer: llama-server returns them in ``logprobs.content[].id`` and
  vLLM as ``token_id:N`` with ``return_tokens_as_token_ids``. A token the server holds
  back (llama-server sends nothing for a token that ends in an incomplete UTF-8
  character) arrives with the next chunk; the count comes from ``usage`` and such tokens'
  ids from llama-server's own ``tokens`` field of a non-streamed answer when needed.
* the tokenizer check: each depth prompt's text is sent as text with ``max_tokens 1``;
  ``usage.prompt_tokens`` must equal the source tokenizer's count, else
  :class:`TokenizerMismatch` names both counts (a server with another tokenizer would be
  measured on other tokens than every other tier).
* scoring (fidelity) from the server's top-k log-probabilities (llama-server ``n_probs``,
  vLLM ``logprobs``): one request per position with the prefix as prompt and
  ``max_tokens 1`` (llama-server reuses its cached prefix, ``cache_prompt: true``).
  :meth:`OpenAIEngine.iter_logprobs` yields full-vocabulary rows with the top ``k``
  exact and the remaining mass spread evenly over the other tokens; the fidelity stage
  also reports the top-``k`` estimate proper (:func:`qeval.measure.fidelity.topk_kld_rows`:
  the remaining mass in one bucket), labelled with ``k``.

The API key is read from the environment variable the recipe names, sent only in the
``Authorization`` header, and never written to a file or a message.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import QevalInputError, TierUnavailable
from .base import Capabilities, EngineOptions, Generation, MemoryInfo
from .llama_tools import tool_path
from .llamacpp import default_flash_attn, gguf_file
from .servers import (EndpointSpec, ManagedServer, ServeSpec, ServerFailed, free_port, llama_server_command,
                      round_ctx, server_peak_counter, vllm_binary, vllm_command)

DEFAULT_TOPK = 20


class EndpointError(QevalInputError):
    """An endpoint that cannot be used as configured (unreachable, refused key, no model)."""


class TokenizerMismatch(EndpointError):
    """The server counts a prompt's tokens differently from the source tokenizer."""


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
        self.dialect = "openai"  # "llama.cpp", "vllm" or "openai" (unknown server)

    def models(self) -> dict:
        """``GET /v1/models``.

        Raises:
            EndpointError: unreachable, the key refused (401/403), or another HTTP error.
        """
        httpx = self._httpx
        try:
            r = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise EndpointError(f"cannot reach {self.base_url}: {e.__class__.__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": "), field="endpoint.url") from None
        if r.status_code in (401, 403):
            raise EndpointError(f"{self.base_url} refused the API key (HTTP {r.status_code})",
                                field="endpoint.api_key_env")
        if r.status_code != 200:
            raise EndpointError(f"{self.base_url}/v1/models answered HTTP {r.status_code}", field="endpoint.url")
        try:
            return r.json()
        except ValueError:
            raise EndpointError(f"{self.base_url}/v1/models did not answer JSON", field="endpoint.url") from None

    def connect(self, model: str | None = None) -> None:
        """Pick the model (``model``, else the first listed) and the server's dialect.

        Raises:
            EndpointError: as :meth:`models`, or no model served / ``model`` not among them.
        """
        data = self.models().get("data") or []
        names = [m.get("id") for m in data if isinstance(m, dict)]
        if not names:
            raise EndpointError(f"{self.base_url} serves no model (GET /v1/models is empty)", field="endpoint.url")
        if model is not None and model not in names:
            raise EndpointError(f"{self.base_url} does not serve {model!r} (it serves {', '.join(map(str, names))})",
                                field="endpoint.model")
        self.model = model or names[0]
        owner = str(next((m.get("owned_by") for m in data if m.get("id") == self.model), "") or "").lower()
        self.dialect = "llama.cpp" if "llama" in owner else ("vllm" if "vllm" in owner else "openai")

    def body(self, prompt: Any, max_tokens: int, *, stream: bool, logprobs: int = 1, ignore_eos: bool = False,
             cache_prompt: bool = False) -> dict:
        """A greedy ``/v1/completions`` request body with the dialect's token-id extensions."""
        b: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens),
                             "temperature": 0.0, "top_p": 1.0, "stream": stream, "logprobs": int(logprobs)}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if ignore_eos:
            b["ignore_eos"] = True
        if self.dialect == "llama.cpp":
            b.update({"top_k": 1, "repeat_penalty": 1.0, "cache_prompt": cache_prompt, "n_probs": int(logprobs)})
        elif self.dialect == "vllm":
            b.update({"top_k": 1, "repetition_penalty": 1.0, "return_tokens_as_token_ids": True})
        return b

    def post(self, path: str, body: dict) -> dict:
        """A non-streamed POST; the JSON answer.

        Raises:
            RuntimeError: an HTTP error status (with the server's message, cut to 300 characters).
        """
        r = self.http.post(path, json=body)
        if r.status_code in (401, 403):  # llama-server lets /v1/models through without a key; not this
            raise EndpointError(f"{self.base_url} refused the API key (HTTP {r.status_code})",
                                field="endpoint.api_key_env")
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def stream(self, body: dict) -> Iterator[tuple[float, dict]]:
        """``(perf_counter time, chunk)`` for every ``data:`` line of a streamed completion.

        Raises:
            RuntimeError: an HTTP error status.
        """
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"/v1/completions answered HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                t = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield t, json.loads(data)

    def close(self) -> None:
        self.http.close()


def chunk_token_ids(chunk: dict) -> list[int]:
    """Token ids a completion chunk carries: llama-server's ``tokens`` or
    ``logprobs.content[].id``, vLLM's ``logprobs.tokens`` as ``token_id:N``."""
    if isinstance(chunk.get("tokens"), list):
        return [int(t) for t in chunk["tokens"]]
    out: list[int] = []
    for ch in chunk.get("choices") or []:
        lp = ch.get("logprobs") or {}
        if isinstance(lp.get("content"), list):
            out += [int(e["id"]) for e in lp["content"] if "id" in e]
        elif isinstance(lp.get("tokens"), list):
            out += [int(str(t).split(":", 1)[1]) for t in lp["tokens"] if str(t).startswith("token_id:")]
    return out


def chunk_topk(chunk: dict) -> list[list[tuple[int, float]]]:
    """Per generated token of a chunk, its top-k ``(token id, logprob)``: llama-server's
    ``logprobs.content[].top_logprobs[]`` (``id``, ``logprob``), vLLM's
    ``logprobs.top_logprobs[]`` (``{"token_id:N": logprob}``)."""
    out = []
    for ch in chunk.get("choices") or []:
        lp = ch.get("logprobs") or {}
        if isinstance(lp.get("content"), list):
            for e in lp["content"]:
                out.append([(int(t["id"]), float(t["logprob"])) for t in e.get("top_logprobs") or []])
        elif isinstance(lp.get("top_logprobs"), list):
            for d in lp["top_logprobs"]:
                out.append([(int(str(k).split(":", 1)[1]), float(v)) for k, v in (d or {}).items()
                            if str(k).startswith("token_id:")])
    return out


class OpenAIEngine:
    """A tier served over HTTP (see the module notes).

    Open it through :meth:`open`: ``options.server`` holds the tier's ``endpoint`` or
    ``serve`` settings, the server log's path, the source tokenizer's folder and the
    depth-prompt texts the tokenizer check sends.

    Attributes (beyond :class:`qeval.engines.base.Engine`'s):
        client: the :class:`Client`.
        server: the :class:`~qeval.engines.servers.ManagedServer` qeval started (None for
            an endpoint).
        topk: the log-probabilities per position the server returns when scoring (k).
        tokenizer_check: ``[{"text_tokens", "server_tokens"}]`` of the check that passed.
    """

    name = "openai"
    formats = ("gguf", "hf", "gptqmodel")
    decode_mode = None
    decode_note = None
    kv_requant_period = None
    capabilities = Capabilities(score=True, generate=True, batch=False, memory_counter="server", kv_bytes=False,
                                lm_eval=False, serve="qeval.engines.openai_load:serve_closed_loop")
    last_cache_allocated_bytes = None  # the server owns its cache

    @classmethod
    def warm_runtime(cls, source_path: str, options: EngineOptions) -> dict:
        """What runs in this process: httpx and the source tokenizer's library (the model and
        its runtime live in the server process, measured there)."""
        import httpx  # start-up time: only served tiers talk HTTP
        out = {"libraries": [f"httpx {httpx.__version__}"], "in_process": "HTTP client only"}
        serve = (options.server or {}).get("serve") or {}
        if serve.get("server") == "llama-server":  # built here (untimed) when missing, not in the timed load
            t0 = time.time()
            tool_path("llama-server", log=lambda m: print(f"[qeval] {m}", flush=True))
            out["kernel_build_seconds"] = round(time.time() - t0, 1)
        return out

    @classmethod
    def open(cls, fmt: str, path: Path | None, options: EngineOptions) -> "OpenAIEngine":
        """Start the tier's server on ``path`` (``serve``) or connect to its endpoint.

        Raises:
            ValueError: another format, or neither ``endpoint`` nor ``serve`` set.
            TierUnavailable: vLLM off CUDA, or not installed (one line, what to do).
            ServerFailed: the server did not start (its log tail attached).
            EndpointError, TokenizerMismatch: the endpoint or its tokenizer (one line).
        """
        if fmt not in cls.formats:
            raise ValueError(f"the {cls.name} engine serves {', '.join(cls.formats)} artifacts, not {fmt!r}")
        s = dict(options.server or {})
        endpoint = EndpointSpec.model_validate(s["endpoint"]) if s.get("endpoint") else None
        serve = ServeSpec.model_validate(s["serve"]) if s.get("serve") else None
        if (endpoint is None) == (serve is None):
            raise ValueError("the openai engine needs exactly one of endpoint: and serve:")
        return cls(fmt, path, options, endpoint=endpoint, serve=serve, log_path=s.get("log"),
                   tokenizer=s.get("tokenizer"), check_texts=s.get("check_texts") or (),
                   tokens=s.get("tokens") or {})

    def __init__(self, fmt: str, path: Path | None, options: EngineOptions, *, endpoint: EndpointSpec | None,
                 serve: ServeSpec | None, log_path: str | None, tokenizer: str | None,
                 check_texts: Sequence[str] = (), tokens: dict | None = None) -> None:
        from transformers import AutoTokenizer  # start-up time: transformers loads only in stage processes
        self.server: ManagedServer | None = None
        self.flash_attn: bool | None = None
        self.sampling = {"decode": "argmax (temperature 0, top_k 1)", "ignored_file_defaults": {}}
        self.topk = DEFAULT_TOPK
        self.score_topk = self.topk  # the fidelity stage's KLD is the top-k estimate
        self.last_cache_bytes = None
        self.kv_cache = options.kv_cache
        self.device = options.device
        self.tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
        if serve is not None:
            url = self._start(fmt, path, options, serve, Path(log_path or "server.log"), tokens or {})
            key, timeout = None, 600.0
        else:
            url, key, timeout = endpoint.url, api_key(endpoint), endpoint.timeout_s
        self.client = Client(url, key, timeout)
        try:
            self.client.connect(endpoint.model if endpoint else None)
            self.backend = f"{self.server.name}-{self.device}" if self.server else f"endpoint ({self.client.dialect})"
            self.vocab_size = len(self.tok) if self.tok is not None else 0
            try:
                self.tokenizer_check = check_tokenizer(self.client, self.tok, check_texts) if self.tok else []
            except Exception as e:  # noqa: BLE001 - a server dying here is the reason
                self._alive(e)
        except BaseException:
            self.close()
            raise

    # -- the server ----------------------------------------------------------------------
    def _start(self, fmt: str, path: Path | None, options: EngineOptions, serve: ServeSpec, log: Path,
               tokens: dict) -> str:
        """Start the managed server; ``tokens``: ``sequence`` (the longest sequence),
        ``load_sequence`` (one load request) and ``model`` (the model's context)."""
        port = free_port()
        parallel = serve.parallel or 1
        seq = int(tokens.get("sequence") or 2048)
        pool = max(seq, parallel * int(tokens.get("load_sequence") or 0))
        if serve.server == "llama-server":
            if fmt != "gguf":
                raise ValueError(f"llama-server serves GGUF artifacts, not {fmt!r}")
            self.flash_attn = default_flash_attn(options.device, options.kv_cache) if options.flash_attn is None \
                else bool(options.flash_attn)
            binary = tool_path("llama-server", log=lambda m: print(f"[qeval] {m}", flush=True))
            cmd = llama_server_command(binary, gguf_file(path), port=port, threads=options.threads, parallel=parallel,
                                       ctx_size=serve.ctx_size or round_ctx(pool), kv_cache=options.kv_cache, flash_attn=self.flash_attn,
                                       device=options.device, args=serve.args)
            name = "llama-server"
        else:
            if options.device != "cuda":
                raise TierUnavailable(f"vLLM serves on CUDA only and this stage runs on {options.device}; "
                                      "serve this tier with llama-server (GGUF) or run it on a CUDA machine")
            binary = vllm_binary()
            if binary is None:
                raise TierUnavailable("vllm is not installed: pip install vllm (best in its own environment; "
                                      "set QEVAL_VLLM to its executable)")
            cmd = vllm_command(binary, path, fmt, port=port, parallel=parallel,
                               max_model_len=serve.ctx_size or round_ctx(seq, tokens.get("model")),
                               gpu_memory_utilization=serve.gpu_memory_utilization,
                               kv_cache=options.kv_cache, args=serve.args)
            name = "vllm"
        self.server = ManagedServer(cmd, port=port, log_path=log, name=name)
        print(f"[qeval] starting {name} on 127.0.0.1:{port} (log {log})", flush=True)
        try:
            self.server.start(serve.startup_timeout_s)
        except ServerFailed as e:
            _print_tail(e)
            raise
        print(f"[qeval] {name} ready (pid {self.server.pid})", flush=True)
        return self.server.url

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

    # -- Engine API ----------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy streamed completion of ``prompt_ids``; token times are chunk arrival times
        (s since the request was sent). Tokens the server held back are counted from
        ``usage.completion_tokens`` at the time of the chunk that released them.

        Raises:
            ServerFailed: the managed server died (its log tail printed to the stage log).
            RuntimeError: an HTTP error or a stream without token ids.
        """
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
                ids = chunk_token_ids(chunk)
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

    def _answer_ids(self, prompt_ids: Sequence[int], max_new_tokens: int, ignore_stop: bool) -> list[int]:
        """Every answer token id, non-streamed (llama-server's native ``/completion`` with
        ``return_tokens``; other servers: the ids of ``logprobs``).

        Raises:
            ServerFailed: the managed server died during the request (CI saw this re-run cut
                by a SIGKILL: httpx's RemoteProtocolError is not the reason, the death is).
        """
        try:
            if self.client.dialect == "llama.cpp":
                d = self.client.post("/completion", {"prompt": [int(t) for t in prompt_ids],
                                                     "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                                                     "repeat_penalty": 1.0, "cache_prompt": False,
                                                     "return_tokens": True, "ignore_eos": ignore_stop})
                return [int(t) for t in d.get("tokens") or []]
            d = self.client.post("/v1/completions", self.client.body([int(t) for t in prompt_ids], max_new_tokens,
                                                                     stream=False, ignore_eos=ignore_stop))
            return chunk_token_ids(d)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason, whatever httpx saw
            self._alive(e)
            raise

    def topk_at(self, prefix: Sequence[int]) -> list[tuple[int, float]]:
        """The server's top-``k`` ``(token id, logprob)`` of the token after ``prefix``."""
        body = self.client.body([int(t) for t in prefix], 1, stream=False, logprobs=self.topk, cache_prompt=True)
        try:
            d = self.client.post("/v1/completions", body)
        except Exception as e:  # noqa: BLE001 - a dead server is the reason
            self._alive(e)
            raise
        rows = chunk_topk(d)
        if not rows or not rows[0]:
            raise RuntimeError(f"the server returned no top-{self.topk} log-probabilities")
        return rows[0]

    def iter_logprobs(self, token_ids: Sequence[int], window: int = 256,
                      first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Rows of :meth:`qeval.engines.base.Engine.iter_logprobs` from the server's top-k:
        one request per position; each row holds the top ``k`` log-probabilities at their
        ids and the remaining mass ``1 - sum(top k)`` spread evenly over the other
        ``vocab - k`` tokens (the top-k estimate; :func:`qeval.measure.fidelity.topk_kld_rows`
        keeps the remaining mass in one bucket instead). Shape ``[m, vocab]``, float32."""
        ids = [int(t) for t in token_ids]
        n = len(ids)
        first = max(0, int(first))
        step = max(1, int(window))
        for start in range(first, n - 1, step):
            m = min(step, n - 1 - start)
            out = np.empty((m, self.vocab_size), dtype=np.float32)
            for j in range(m):
                out[j] = topk_row(self.topk_at(ids[:start + j + 1]), self.vocab_size)
            yield start, out

    def attention_info(self, prompt_ids: Sequence[int] | None = None) -> dict:
        """The attention path as set when qeval starts the server (llama-server: flash
        attention on or off, K and V ``f16`` or ``q8_0``); an endpoint's or vLLM's are not
        visible over HTTP (None)."""
        kv = None
        if self.server is not None and self.flash_attn is not None:
            kv = "q8_0" if self.kv_cache == "int8" else "f16"
        impl = "flash" if self.flash_attn else ("standard" if self.flash_attn is False else "not visible over HTTP")
        return {"engine": self.server.name if self.server is not None else "endpoint", "implementation": impl,
                "flash_attn": self.flash_attn, "kv_cache_dtype": kv}

    def kv_bytes_per_token(self, depth: int = 64) -> float:
        """Not measured through HTTP (the server owns its cache).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("the openai engine cannot see the server's KV cache")

    def memory(self) -> MemoryInfo:
        """No weight bytes from the server (the tier's stored artifact gives them)."""
        return MemoryInfo(0, None, self.device, {"backend": self.backend})

    def peak_counter(self) -> Any:
        """The peak-memory counter of this tier (:meth:`reset`/:meth:`read`/``kind``): the
        managed server's RSS with its children on the CPU, NVML for its pid on CUDA; an
        endpoint's memory cannot be seen from here (:class:`NotMeasured`)."""
        if self.server is None:
            return NotMeasured()
        return server_peak_counter(self.server.pid, self.device)

    def close(self) -> None:
        """Close the HTTP client; stop and reap a managed server."""
        c = getattr(self, "client", None)
        if c is not None:
            c.close()
        if self.server is not None:
            self.server.stop()

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


def _print_tail(e: ServerFailed) -> None:
    """The one-line reason into this stage's log (the stage worker prints the server log's
    tail, :attr:`ServerFailed.log_tail`, after the traceback, where the row's tail shows it)."""
    print(f"[qeval] {e}", file=sys.stderr, flush=True)


def check_tokenizer(client: Client, tok: Any, texts: Sequence[str]) -> list[dict]:
    """Each text sent as text (``max_tokens`` 1): the server's ``usage.prompt_tokens``
    against the source tokenizer's count (special tokens added as the tokenizer adds them).

    Returns:
        ``[{"text_tokens", "server_tokens"}]`` per text.

    Raises:
        TokenizerMismatch: a count differs (both counts named).
        EndpointError: the server refused the request.
    """
    out = []
    for text in texts:
        want = len(tok(text)["input_ids"])
        try:
            d = client.post("/v1/completions", client.body(text, 1, stream=False, logprobs=0))
        except EndpointError:
            raise
        except RuntimeError as e:
            raise EndpointError(f"{client.base_url} refused a completion: {e}", field="endpoint.url") from None
        got = int((d.get("usage") or {}).get("prompt_tokens") or -1)
        if got != want:
            raise TokenizerMismatch(f"the server counts {got} prompt tokens where the source tokenizer counts {want} "
                                    f"(a depth prompt of {len(text)} characters): it serves another tokenizer",
                                    field="endpoint")
        out.append({"text_tokens": want, "server_tokens": got})
    return out


def depth_texts(tok: Any, depth_text: str | Path, depths: Sequence[int]) -> list[str]:
    """The depth prompts as text: the first ``d`` tokens of the depth text decoded, per
    depth, with runs of whitespace collapsed to one space: llama.cpp and transformers
    split a run of newlines differently on the very same vocabulary (``"\\n\\n"`` one
    token or two), which is no sign of another tokenizer (qeval sends token ids, never text)."""
    from ..measure.speed import depth_prompt_ids  # start-up time: the speed module is only needed here
    return [" ".join(tok.decode(depth_prompt_ids(tok, depth_text, int(d))).split()) for d in depths]


def preflight_endpoint(spec: EndpointSpec, *, tokenizer: str | Path | None = None,
                       texts: Sequence[str] = ()) -> dict:
    """Before any stage: the endpoint answers ``/v1/models`` with the key and, given the
    source tokenizer, counts the depth prompts' tokens as it does.

    Returns:
        ``{"model", "dialect", "tokenizer_check"}``.

    Raises:
        EndpointError: unset key variable, unreachable URL, refused key, no model.
        TokenizerMismatch: a depth prompt counted differently.
    """
    client = Client(spec.url, api_key(spec), min(spec.timeout_s, 120.0))
    try:
        client.connect(spec.model)
        checked = []
        client.post("/v1/completions", client.body("Hello", 1, stream=False, logprobs=0))  # the key, on a route that needs it
        if tokenizer is not None:
            from transformers import AutoTokenizer  # start-up time: only endpoint tiers check a tokenizer here
            checked = check_tokenizer(client, AutoTokenizer.from_pretrained(str(tokenizer)), texts)
        return {"model": client.model, "dialect": client.dialect, "tokenizer_check": checked}
    finally:
        client.close()


ENGINE = OpenAIEngine
