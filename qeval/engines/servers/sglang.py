"""SGLang's server (``python -m sglang.launch_server``) on a tier's artifact
(``serve: sglang``): transformers and GPTQ/AWQ checkpoints; CUDA only. The Python that
has ``sglang`` installed is ``$QEVAL_SGLANG`` (SGLang pins its own torch: best in its own
environment), else this interpreter when it can import ``sglang``.

Checked against SGLang's source (``python/sglang/srt/server_args.py``,
``entrypoints/http_server.py``, ``entrypoints/openai/protocol.py``, ``metrics/collector.py``):

* flags: ``--model-path``, ``--tokenizer-path``, ``--host``, ``--port``,
  ``--served-model-name``, ``--context-length`` (tokens per sequence),
  ``--max-running-requests``, ``--mem-fraction-static``, ``--disable-radix-cache``
  (its prefix cache: repeated speed prompts would hit it), ``--kv-cache-dtype``,
  ``--enable-metrics``;
* ``POST /flush_cache`` frees the radix cache and the KV pool (400 while requests run);
* ``GET /metrics`` with ``--enable-metrics``: ``sglang:num_used_tokens``,
  ``sglang:token_usage`` (0..1), ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``;
* ``/v1/completions`` takes a prompt of token ids and, with ``return_token_ids``, gives
  the answer's ids in ``choices[].token_ids``; its log-probabilities are keyed by token
  text, not id, so the fidelity stage cannot score through it (``logprobs`` False).

The recipe's ``ctx_size`` is ``--context-length``: tokens per sequence.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from pydantic import Field

from ...errors import TierUnavailable
from .base import Dialect, Launch, PoolState, ServeOptions, ServerKind, parse_prometheus

SGLANG_ENV = "QEVAL_SGLANG"
METRICS = ("sglang:num_used_tokens", "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs")


class SglangOptions(ServeOptions):
    """``serve: {kind: sglang}``.

    Attributes:
        mem_fraction_static: ``--mem-fraction-static`` (share of GPU memory for weights and
            the KV pool); None: SGLang's own choice.

    ``ctx_size`` is ``--context-length`` (tokens per sequence); None: the longest sequence
    rounded up to 256, at most the model's context."""
    kind: Literal["sglang"]
    mem_fraction_static: float | None = Field(None, gt=0, le=1)


class SglangDialect(Dialect):
    """SGLang's ``/v1/completions``: ``top_k``, ``repetition_penalty`` and
    ``return_token_ids`` in the request; the ids in ``choices[].token_ids``."""
    name = "sglang"
    owned_by = "sglang"
    logprobs = False

    def extras(self, *, logprobs: int, cache_prompt: bool) -> dict:
        return {"top_k": 1, "repetition_penalty": 1.0, "return_token_ids": True}

    def token_ids(self, chunk: dict) -> list[int]:
        out: list[int] = []
        for ch in chunk.get("choices") or []:
            if isinstance(ch.get("token_ids"), list):
                out += [int(t) for t in ch["token_ids"]]
        return out


class Sglang(ServerKind):
    """SGLang (see the module notes)."""
    kind = "sglang"
    label = "SGLang"
    options: ClassVar[type[ServeOptions]] = SglangOptions
    formats = ("hf", "gptqmodel")
    devices = ("cuda",)
    health_path = "/health"
    dialect = SglangDialect()

    @classmethod
    def binary(cls) -> str:
        """The Python that runs ``sglang.launch_server``: ``$QEVAL_SGLANG``, else this one.

        Raises:
            TierUnavailable: neither has SGLang (what to install).
        """
        found = sglang_python()
        if found is None:
            raise TierUnavailable("sglang is not installed: pip install sglang (best in its own environment; "
                                  f"set {SGLANG_ENV} to that environment's python)")
        return found

    @classmethod
    def command(cls, binary: str, opts: ServeOptions, launch: Launch) -> list[str]:
        assert isinstance(opts, SglangOptions)
        return sglang_command(binary, launch.artifact, port=launch.port, parallel=launch.parallel,
                              context_length=cls.context_tokens(opts, launch), tokenizer=launch.tokenizer,
                              mem_fraction_static=opts.mem_fraction_static, kv_cache=launch.kv_cache,
                              served_name=launch.served_name, args=opts.args)

    @classmethod
    def attention(cls, opts: ServeOptions, launch: Launch) -> dict:
        return {"flash_attn": None, "kv_cache_dtype": "fp8_e4m3" if launch.kv_cache == "int8" else None}

    @classmethod
    def clear_pool(cls, http: Any, parallel: int) -> str:
        """``POST /flush_cache``."""
        r = http.post("/flush_cache")
        if r.status_code != 200:
            raise RuntimeError(f"POST /flush_cache answered HTTP {r.status_code}: {r.text[:200]}")
        return "flush_cache"

    @classmethod
    def pool_state(cls, http: Any) -> PoolState:
        """``GET /metrics``: empty when no token holds KV and no request runs or queues."""
        r = http.get("/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"GET /metrics answered HTTP {r.status_code}: {r.text[:200]}")
        c = parse_prometheus(r.text, METRICS)
        used = c.get("sglang:num_used_tokens", 0.0)
        running = c.get("sglang:num_running_reqs", 0.0)
        queued = c.get("sglang:num_queue_reqs", 0.0)
        why = ", ".join(s for s in (f"{used:.0f} tokens hold KV" if used else "",
                                    f"{running:.0f} requests running" if running else "",
                                    f"{queued:.0f} queued" if queued else "") if s)
        return PoolState(c, not (used or running or queued), why)


def sglang_python() -> str | None:
    """``$QEVAL_SGLANG`` (a python executable), else this interpreter when ``sglang``
    imports here; None otherwise."""
    named = os.environ.get(SGLANG_ENV)
    if named:
        return named if Path(named).is_file() else shutil.which(named)
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


def sglang_command(python: str, model: str | Path, *, port: int, parallel: int, context_length: int,
                   tokenizer: str | None = None, mem_fraction_static: float | None = None, kv_cache: str = "model",
                   served_name: str = "qeval", args: Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` on 127.0.0.1: ``--max-running-requests`` =
    ``parallel``, ``--context-length``, the radix (prefix) cache off, metrics on, the
    source's tokenizer, an int8 KV cache as ``--kv-cache-dtype fp8_e4m3`` (SGLang has no
    int8 KV cache; the row's backend says so)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", served_name, "--max-running-requests", str(parallel),
           "--context-length", str(context_length), "--disable-radix-cache", "--enable-metrics"]
    if tokenizer:
        cmd += ["--tokenizer-path", str(tokenizer)]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if kv_cache == "int8":
        cmd += ["--kv-cache-dtype", "fp8_e4m3"]
    return cmd + [str(a) for a in args]


SERVER = Sglang
