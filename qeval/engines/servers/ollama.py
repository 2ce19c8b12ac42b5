"""Ollama's native API as a wire dialect (``endpoint: {url, dialect: ollama, model: <tag>}``):
an endpoint that already runs ``ollama serve``, measured on its own routes rather than its
OpenAI-compatible ``/v1`` ones, so that its server-side timings and its per-token
log-probabilities come with every answer.

Checked against Ollama's API reference (https://docs.ollama.com/api/chat, the same fields
in ``docs/api.md`` and ``api/types.go`` of github.com/ollama/ollama; ``logprobs`` and
``top_logprobs`` added by ollama/ollama#12899, in 0.12.11):

* requests: ``POST /api/chat`` (``messages``; prompt_mode ``chat``) or ``POST /api/generate``
  (``prompt``, with ``raw: true``: the text is the source's chat template already rendered
  by qeval, so Ollama applies none; prompt_mode ``text``), each with ``stream``,
  ``keep_alive`` (:data:`KEEP_ALIVE`: the model stays loaded through a run, so a reload
  does not land in a timed request), ``options`` (``temperature 0``, ``top_k 1``,
  ``top_p 1``, ``repeat_penalty 1``: greedy with no penalty, Ollama's own default being
  1.1; ``seed``; ``num_predict`` the answer's budget; ``num_ctx`` the tier's longest
  sequence, a constant per tier since Ollama reloads a model whose ``num_ctx`` changes) and,
  when log-probabilities are asked, ``logprobs: true`` with ``top_logprobs`` (at most
  :data:`MAX_TOP_LOGPROBS`). Ollama has no ``ignore_eos``: a speed request may end before
  its budget, and its count is the server's ``eval_count``;
* answers: NDJSON (``application/x-ndjson``: one JSON object a line, no SSE ``data:``
  prefix, no ``[DONE]``), each with ``message.content`` (and ``message.thinking`` of a
  thinking model) on ``/api/chat`` or ``response`` on ``/api/generate``, and per-token
  ``logprobs`` (``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]``: tokens as text, not ids); the last object has ``done: true``,
  ``done_reason`` and the timings ``total_duration``, ``load_duration``,
  ``prompt_eval_count``, ``prompt_eval_duration``, ``eval_count``, ``eval_duration``
  (nanoseconds; ``prompt_eval_cached_count`` where the server sends it). A stream that
  ends without that object was cut (:attr:`OllamaDialect.requires_end`). An error is
  ``{"error": "..."}``: with HTTP 404 ``model '<name>' not found`` for a model that is
  not pulled (:meth:`OllamaDialect.refused` words it as ``ollama pull <name>``), or as a
  line of a stream that failed after its start;
* models: ``GET /api/tags`` lists the pulled models by the names ``ollama list`` shows
  (``qwen2.5:0.5b-instruct-q4_K_M``; a name without a tag is ``:latest``).

Each native object is read into the OpenAI chunk shape the engine already reads
(:meth:`OllamaDialect.normalize`: ``choices[0].delta.content`` or ``.text``,
``finish_reason``, ``usage.prompt_tokens`` = ``prompt_eval_count`` and
``usage.completion_tokens`` = ``eval_count``), with the native timings kept in the chunk's
``ollama`` field (:func:`timings`) and its log-probabilities in ``ollama_logprobs``.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Sequence

from .base import Dialect

#: ``keep_alive`` of every request: the model stays loaded this long after it (Ollama's default is 5m).
KEEP_ALIVE = "30m"
#: The most ``top_logprobs`` Ollama returns per position (its request validation: 0 to 20).
MAX_TOP_LOGPROBS = 20
#: The seed of every request (greedy decoding does not draw from it; sent so a sampler never does either).
SEED = 0
_NS = 1e-9


def timings(final: dict) -> dict:
    """The server-side figures of one answer from its final object (``done: true``).

    Returns:
        ``prompt_eval_count``, ``prompt_eval_cached_count`` (0 when not sent),
        ``eval_count`` (tokens), ``prompt_eval_s``, ``eval_s``, ``load_s``, ``total_s``
        (seconds, from Ollama's nanoseconds), ``prompt_tokens_per_s`` = (prompt_eval_count
        - cached) / prompt_eval_duration and ``decode_tokens_per_s`` = eval_count /
        eval_duration (Ollama's API reference: "divide eval_count / eval_duration * 10^9");
        a figure whose inputs are missing or 0 is None.
    """
    def num(k: str) -> float | None:
        v = final.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    pc, ec = num("prompt_eval_count"), num("eval_count")
    cached = num("prompt_eval_cached_count") or 0.0
    pd, ed, ld, td = (num(k) for k in ("prompt_eval_duration", "eval_duration", "load_duration", "total_duration"))
    return {"prompt_eval_count": int(pc) if pc is not None else None, "prompt_eval_cached_count": int(cached),
            "eval_count": int(ec) if ec is not None else None,
            "prompt_eval_s": pd * _NS if pd is not None else None, "eval_s": ed * _NS if ed is not None else None,
            "load_s": ld * _NS if ld is not None else None, "total_s": td * _NS if td is not None else None,
            "prompt_tokens_per_s": (pc - cached) / (pd * _NS) if pc is not None and pd else None,
            "decode_tokens_per_s": ec / (ed * _NS) if ec is not None and ed else None}


def summarise_timings(records: Sequence[dict]) -> dict | None:
    """The row's ``served.ollama_timings`` from per-answer :func:`timings` records: over
    all answers, prompt tokens/s = sum(prompt_eval_count - cached) / sum(prompt_eval_s)
    and decode tokens/s = sum(eval_count) / sum(eval_s) (token-weighted, as the client's
    own rates), the largest and the total ``load_s`` (a reload mid-run shows here), the
    prompt tokens Ollama said it served from its cache (``cached_prompt_tokens``: it keeps a
    slot's last prompt and its API has no switch to turn that off, so a repeated speed prompt
    can be partly a cache hit; 0 also where the server does not send
    ``prompt_eval_cached_count``), and the same two rates per prompt length
    (``by_prompt_tokens``: one per speed depth). None without records."""
    recs = [r for r in records if r]
    if not recs:
        return None

    def rates(rs: Sequence[dict]) -> dict:
        pt = sum((r["prompt_eval_count"] or 0) - r["prompt_eval_cached_count"] for r in rs
                 if r["prompt_eval_s"] and r["prompt_eval_count"] is not None)
        ps = sum(r["prompt_eval_s"] for r in rs if r["prompt_eval_s"] and r["prompt_eval_count"] is not None)
        et = sum(r["eval_count"] for r in rs if r["eval_s"] and r["eval_count"] is not None)
        es = sum(r["eval_s"] for r in rs if r["eval_s"] and r["eval_count"] is not None)
        return {"answers": len(rs), "prompt_tokens_per_s": pt / ps if ps else None,
                "decode_tokens_per_s": et / es if es else None}

    loads = [r["load_s"] for r in recs if r["load_s"] is not None]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(str(r["prompt_eval_count"]), []).append(r)
    return {**rates(recs), "load_s_max": max(loads) if loads else None, "load_s_total": sum(loads) if loads else None,
            "cached_prompt_tokens": sum(r["prompt_eval_cached_count"] for r in recs),
            "by_prompt_tokens": {k: rates(v) for k, v in sorted(by.items(), key=lambda kv: (len(kv[0]), kv[0]))},
            "source": "Ollama's final stream object (prompt_eval_count, prompt_eval_duration, eval_count, "
                      "eval_duration, load_duration; nanoseconds)"}


class OllamaDialect(Dialect):
    """Ollama's native ``/api/chat`` and ``/api/generate`` (the module notes): requests
    translated from the OpenAI bodies qeval builds (:meth:`route`), NDJSON answers read
    into the OpenAI chunk shape (:meth:`read_line`, :meth:`answer`), top-k by token text
    (:meth:`topk_text`), the model list from ``/api/tags`` and a model that is not pulled
    said as ``ollama pull``."""
    name = "ollama"
    owned_by = ""  # chosen by the endpoint's ``dialect: ollama`` only (its /v1 routes are plain OpenAI)
    logprobs = True  # per generated token, by token text (mapped to source ids by the engine)
    token_prompts = False
    requires_end = True
    usage_source = "Ollama prompt_eval_count/eval_count"
    models_path = "/api/tags"
    chat_path: ClassVar[str] = "/api/chat"
    generate_path: ClassVar[str] = "/api/generate"

    def route(self, path: str, body: dict, settings: dict | None = None) -> tuple[str, dict]:
        """The native ``(path, body)`` of an OpenAI ``/v1/chat/completions`` or
        ``/v1/completions`` body (module notes); ``settings``: ``num_ctx``, ``seed``,
        ``keep_alive`` (defaults :data:`SEED`, :data:`KEEP_ALIVE`; no ``num_ctx``: the model's own).

        Raises:
            ValueError: a prompt of token ids (Ollama takes text: prompt_mode text or chat),
                or another path.
        """
        s = settings or {}
        opts: dict[str, Any] = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "repeat_penalty": 1.0,
                                "seed": int(s.get("seed", SEED)), "num_predict": int(body.get("max_tokens") or 1)}
        if s.get("num_ctx"):
            opts["num_ctx"] = int(s["num_ctx"])
        out: dict[str, Any] = {"model": body.get("model"), "stream": bool(body.get("stream")), "options": opts,
                               "keep_alive": s.get("keep_alive", KEEP_ALIVE)}
        lp = body.get("logprobs")
        if lp and not isinstance(lp, bool):
            out["logprobs"] = True
            out["top_logprobs"] = min(int(lp), MAX_TOP_LOGPROBS)
        if path.endswith("/chat/completions"):
            out["messages"] = list(body.get("messages") or [])
            return self.chat_path, out
        if path.endswith("/completions"):
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError("Ollama's native API takes text, not token ids: set the tier's prompt_mode to text "
                                 "or chat")
            out["prompt"], out["raw"] = prompt, True
            return self.generate_path, out
        raise ValueError(f"the ollama dialect has no route for {path}")

    def normalize(self, obj: dict, streamed: bool) -> dict:
        """One native object in the OpenAI chunk shape (module notes): ``choices[0]`` with
        ``delta`` (streamed) or ``message`` (chat) or ``text`` (generate) and
        ``finish_reason`` (``done_reason`` once done); ``usage`` and ``ollama`` (:func:`timings`)
        on the final object; ``ollama_logprobs`` where the object carries log-probabilities.

        Raises:
            RuntimeError: an ``{"error": ...}`` object (its message, cut to 300 characters).
        """
        if not isinstance(obj, dict):
            raise RuntimeError(f"Ollama sent a line that is not a JSON object: {str(obj)[:100]}")
        if obj.get("error"):
            raise RuntimeError(f"Ollama: {str(obj['error'])[:300]}")
        done = bool(obj.get("done"))
        finish = (obj.get("done_reason") or "stop") if done else None
        if isinstance(obj.get("message"), dict):
            m = obj["message"]
            msg = {"content": m.get("content") or ""}
            if isinstance(m.get("thinking"), str) and m["thinking"]:
                msg["reasoning"] = m["thinking"]  # read as the OpenAI servers' reasoning field
            choice: dict[str, Any] = {("delta" if streamed else "message"): msg, "finish_reason": finish}
        else:
            choice = {"text": obj.get("response") or "", "finish_reason": finish}
        out: dict[str, Any] = {"choices": [choice], "done": done}
        if isinstance(obj.get("logprobs"), list):
            out["ollama_logprobs"] = obj["logprobs"]
        if done:
            t = timings(obj)
            out["ollama"] = t
            usage: dict[str, Any] = {}
            if t["prompt_eval_count"] is not None:
                usage["prompt_tokens"] = t["prompt_eval_count"]
                usage["prompt_tokens_details"] = {"cached_tokens": t["prompt_eval_cached_count"]}
            if t["eval_count"] is not None:
                usage["completion_tokens"] = t["eval_count"]
            if usage:
                out["usage"] = usage
        return out

    def read_line(self, line: str) -> tuple[dict | None, bool]:
        """One NDJSON line: ``(chunk, True)`` for the final object, ``(chunk, False)``
        before it, ``(None, False)`` for a blank line.

        Raises:
            RuntimeError: an error object in the stream, or a line that is not JSON.
        """
        line = line.strip()
        if not line:
            return None, False
        try:
            obj = json.loads(line)
        except ValueError:
            raise RuntimeError(f"Ollama sent a line that is not JSON: {line[:100]}") from None
        chunk = self.normalize(obj, streamed=True)
        return chunk, chunk["done"]

    def answer(self, obj: Any) -> Any:
        """A non-streamed native answer in the OpenAI shape (:meth:`normalize`)."""
        return self.normalize(obj, streamed=False) if isinstance(obj, dict) and "models" not in obj else obj

    def topk_text(self, chunk: dict) -> list[list[tuple[str, float]]]:
        """Per generated token of a chunk, its ``top_logprobs`` as ``(token text, logprob)``,
        most probable first; a token without ``top_logprobs`` gives its own ``(token, logprob)``."""
        rows = []
        for e in chunk.get("ollama_logprobs") or []:
            if not isinstance(e, dict):
                continue
            top = e.get("top_logprobs") or [{"token": e.get("token"), "logprob": e.get("logprob")}]
            row = [(str(t.get("token") or ""), float(t["logprob"])) for t in top
                   if isinstance(t, dict) and isinstance(t.get("logprob"), (int, float))]
            rows.append(sorted(row, key=lambda p: -p[1]))
        return rows

    def model_names(self, answer: dict) -> list[tuple[str, str]]:
        """``(name, "ollama")`` of every pulled model in a ``GET /api/tags`` answer."""
        return [(str(m.get("name") or m.get("model")), "ollama") for m in answer.get("models") or []
                if isinstance(m, dict) and (m.get("name") or m.get("model"))]

    def pick_model(self, base_url: str, model: str | None, names: Sequence[str]) -> str:
        """The model the tier names, matched as ``ollama list`` shows it (a name without a
        tag is ``<name>:latest``); None: the first pulled one.

        Raises:
            ValueError: no model pulled, or ``model`` not among them (one line: ``ollama pull``).
        """
        if not names:
            raise ValueError(f"{base_url} has no model pulled (GET /api/tags is empty): run "
                             f"`ollama pull {model or '<model>'}` on the server")
        if model is None:
            return names[0]
        for want in (model, f"{model}:latest"):
            if want in names:
                return want
        raise ValueError(f"{base_url} has not pulled {model!r} (it has {', '.join(names)}): run `ollama pull {model}` "
                         "on the server")

    def refused(self, status: int, text: str, model: str | None) -> str | None:
        """One line for Ollama's 404 ``{"error": "model '<name>' not found"}`` naming
        ``ollama pull``; None for any other answer."""
        if status == 404 and "not found" in (text or ""):
            try:
                said = str(json.loads(text).get("error"))
            except (ValueError, AttributeError):
                said = text.strip()[:200]
            return f"Ollama answered 404 ({said}): run `ollama pull {model}` on the server"
        return None


DIALECT = OllamaDialect()
