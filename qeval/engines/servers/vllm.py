"""vLLM's OpenAI-compatible server (``vllm serve``) on a tier's artifact (``serve: vllm``):
transformers checkpoints, GPTQ/AWQ checkpoints and GGUF files; CUDA only. ``vllm`` must be
on ``PATH`` (or ``QEVAL_VLLM`` names it); vLLM pins its own torch, so it is best installed
in its own environment.

The command is checked against ``vllm serve``'s own parser at vLLM 0.34.0
(``tools/vllm_args.py``; its snapshot ``tests/data/vllm_serve_args-0.34.0.json``) and the
rest against vLLM's source (``vllm/engine/arg_utils.py``, ``vllm/entrypoints/common/
cli_args.py``, ``vllm/entrypoints/serve/dev/cache/api_router.py``, ``vllm/v1/metrics``):

* ``--disable-log-requests``: 0.17 removed it (and logs no requests unless
  ``--enable-log-requests``); 0.34 takes it again, as the pair of ``--enable-log-requests``.
  Not logging is the default, so the command passes neither;
* ``--no-enable-prefix-caching``: 0.34 still takes it (hidden from ``--help``, which shows
  ``--disable-prefix-caching``), the spelling earlier releases' ``--enable-``/``--no-``
  flags take;
* the model of ``vllm serve`` is a folder, or for GGUF the ``.gguf`` file itself, with
  ``--tokenizer`` naming the source checkpoint (a GGUF's own tokenizer conversion is
  slow and may differ; the int8 artifact stores none). GGUF is not in vLLM's core at 0.34:
  ``--quantization gguf`` and the GGUF loader come from ``vllm-gguf-plugin``
  (``pip install "vllm[extra-quant]"``);
* an int8 KV cache is ``--kv-cache-dtype fp8`` (0.34 also lists ``int8_per_token_head``,
  on its Triton attention backend only);
* ``POST /reset_prefix_cache`` is routed only with ``VLLM_SERVER_DEV_MODE=1`` (set in
  the server's environment): with ``--no-enable-prefix-caching`` a finished request's
  blocks are already free, and the reset drops any that are cached;
* ``GET /metrics`` (always on): ``vllm:kv_cache_usage_perc`` (0..1),
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:num_preemptions_total``.

The recipe's ``ctx_size`` is ``--max-model-len``: tokens per sequence (vLLM pages its KV
cache inside ``gpu_memory_utilization``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from pydantic import Field

from ...errors import TierUnavailable
from ..llamacpp import gguf_file
from .base import Dialect, Launch, PoolState, ServeOptions, ServerKind, parse_prometheus

VLLM_ENV = "QEVAL_VLLM"
METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:num_preemptions_total")
#: vLLM ``--quantization`` per qeval artifact format (None: read from the checkpoint's config).
VLLM_QUANTIZATION = {"hf": None, "gptqmodel": None, "gguf": "gguf"}


class VllmOptions(ServeOptions):
    """``serve: {kind: vllm}``.

    Attributes:
        gpu_memory_utilization: ``--gpu-memory-utilization`` (share of GPU memory).

    ``ctx_size`` is ``--max-model-len`` (tokens per sequence); None: the longest sequence
    rounded up to 256, at most the model's context."""
    kind: Literal["vllm"]
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)


class VllmDialect(Dialect):
    """vLLM's ``/v1/completions``: ``top_k``, ``repetition_penalty`` and
    ``return_tokens_as_token_ids`` in the request; ids as ``token_id:N`` strings in
    ``logprobs.tokens`` and the keys of ``logprobs.top_logprobs[]``."""
    name = "vllm"
    owned_by = "vllm"
    logprobs = True

    def extras(self, *, logprobs: int, cache_prompt: bool) -> dict:
        return {"top_k": 1, "repetition_penalty": 1.0, "return_tokens_as_token_ids": True}

    def token_ids(self, chunk: dict) -> list[int]:
        out: list[int] = []
        for ch in chunk.get("choices") or []:
            toks = (ch.get("logprobs") or {}).get("tokens")
            if isinstance(toks, list):
                out += [int(str(t).split(":", 1)[1]) for t in toks if str(t).startswith("token_id:")]
        return out

    def topk(self, chunk: dict) -> list[list[tuple[int, float]]]:
        out = []
        for ch in chunk.get("choices") or []:
            top = (ch.get("logprobs") or {}).get("top_logprobs")
            if isinstance(top, list):
                for d in top:
                    out.append([(int(str(k).split(":", 1)[1]), float(v)) for k, v in (d or {}).items()
                                if str(k).startswith("token_id:")])
        return out


class Vllm(ServerKind):
    """vLLM (see the module notes)."""
    kind = "vllm"
    label = "vLLM"
    options: ClassVar[type[ServeOptions]] = VllmOptions
    formats = ("hf", "gptqmodel", "gguf")
    devices = ("cuda",)
    health_path = "/health"
    dialect = VllmDialect()

    @classmethod
    def binary(cls) -> str:
        """``$QEVAL_VLLM``, else ``vllm`` on ``PATH``.

        Raises:
            TierUnavailable: neither (what to install).
        """
        found = vllm_binary()
        if found is None:
            raise TierUnavailable("vllm is not installed: pip install vllm (best in its own environment; "
                                  f"set {VLLM_ENV} to its executable)")
        return found

    @classmethod
    def command(cls, binary: str, opts: ServeOptions, launch: Launch) -> list[str]:
        assert isinstance(opts, VllmOptions)
        model = gguf_file(launch.artifact) if launch.fmt == "gguf" else launch.artifact
        return vllm_command(binary, model, launch.fmt, port=launch.port, parallel=launch.parallel,
                            max_model_len=cls.context_tokens(opts, launch),
                            gpu_memory_utilization=opts.gpu_memory_utilization, tokenizer=launch.tokenizer,
                            kv_cache=launch.kv_cache, served_name=launch.served_name, args=opts.args,
                            prefix_caching=launch.prefix_caching)

    @classmethod
    def env(cls, opts: ServeOptions) -> dict[str, str]:
        return {"VLLM_SERVER_DEV_MODE": "1"}  # routes POST /reset_prefix_cache

    @classmethod
    def attention(cls, opts: ServeOptions, launch: Launch) -> dict:
        return {"flash_attn": None, "kv_cache_dtype": "fp8" if launch.kv_cache == "int8" else None}

    @classmethod
    def clear_pool(cls, http: Any, parallel: int) -> str:
        """``POST /reset_prefix_cache``."""
        r = http.post("/reset_prefix_cache")
        if r.status_code != 200:
            raise RuntimeError(f"POST /reset_prefix_cache answered HTTP {r.status_code}: {r.text[:200]}")
        return "reset_prefix_cache"

    @classmethod
    def pool_state(cls, http: Any) -> PoolState:
        """``GET /metrics``: empty when no KV block is in use and no request runs or waits."""
        r = http.get("/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"GET /metrics answered HTTP {r.status_code}: {r.text[:200]}")
        c = parse_prometheus(r.text, METRICS)
        usage = c.get("vllm:kv_cache_usage_perc", 0.0)
        running = c.get("vllm:num_requests_running", 0.0)
        waiting = c.get("vllm:num_requests_waiting", 0.0)
        why = ", ".join(s for s in (f"KV cache {usage:.1%} in use" if usage else "",
                                    f"{running:.0f} requests running" if running else "",
                                    f"{waiting:.0f} waiting" if waiting else "") if s)
        return PoolState(c, not (usage or running or waiting), why)


def vllm_binary() -> str | None:
    """The ``vllm`` executable: ``$QEVAL_VLLM``, else ``vllm`` on ``PATH``; None if neither."""
    named = os.environ.get(VLLM_ENV)
    if named:
        return named if Path(named).is_file() else shutil.which(named)
    return shutil.which("vllm")


def vllm_command(binary: str, model: str | Path, fmt: str, *, port: int, parallel: int, max_model_len: int,
                 gpu_memory_utilization: float, tokenizer: str | None = None, kv_cache: str = "model",
                 served_name: str = "qeval", args: Sequence[str] = (), prefix_caching: bool = False) -> list[str]:
    """``vllm serve <model>`` on 127.0.0.1: ``--max-num-seqs`` = ``parallel``,
    ``--max-model-len``, ``--gpu-memory-utilization``, prefix caching off (repeated speed
    prompts would hit it), the source's tokenizer (``--tokenizer``), ``--quantization gguf``
    for a GGUF file, an int8 KV cache as ``--kv-cache-dtype fp8`` (vLLM has no int8 KV
    cache; the row's backend says so). ``prefix_caching`` (the load stage of a recipe with a
    shared prefix): ``--enable-prefix-caching`` and ``--enable-prompt-tokens-details`` (each
    answer's cached prompt tokens) instead."""
    cmd = [binary, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--max-num-seqs", str(parallel), "--max-model-len", str(max_model_len),
           "--gpu-memory-utilization", str(gpu_memory_utilization)]
    cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"] if prefix_caching \
        else ["--no-enable-prefix-caching"]
    q = VLLM_QUANTIZATION.get(fmt)
    if q:
        cmd += ["--quantization", q]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    if kv_cache == "int8":
        cmd += ["--kv-cache-dtype", "fp8"]
    return cmd + [str(a) for a in args]


SERVER = Vllm
