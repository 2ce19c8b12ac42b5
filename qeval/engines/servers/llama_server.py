"""llama.cpp's ``llama-server`` on a tier's GGUF file (``serve: llama-server``), built in the
installed llama-cpp-python's own CMake build and run with the CPU variant qeval chose
(:func:`qeval.engines.llama_tools.tool_path`; a separate cached build where that wheel has none).

Checked against that source (``tools/server`` and ``common/arg.cpp`` of llama-cpp-python
0.3.36's llama.cpp):

* ``POST /slots/{id}?action=erase`` clears one slot's cells from the KV pool
  (``slot.prompt_clear()``; the answer is ``{"id_slot", "n_erased"}``); every slot action
  is refused unless the server was started with ``--slot-save-path DIR``, so the command
  gives it the server's private scratch folder (nothing is saved there: qeval only erases);
* ``GET /slots`` (on by default, ``--slots`` given anyway) lists each slot with
  ``is_processing`` and ``n_prompt_tokens``, the tokens its cache holds: the pool is
  empty when every slot holds 0 and none is processing;
* ``GET /metrics`` needs ``--metrics``: ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, ``llamacpp:prompt_tokens_total``,
  ``llamacpp:tokens_predicted_total`` and ``llamacpp:n_decode_total`` (no KV usage gauge in
  this version: ``/slots`` says what the pool holds).

The recipe's ``ctx_size`` is ``--ctx-size``: KV cells the slots share (``--kv-unified``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Sequence

from ..llama_tools import tool_path
from ..llamacpp import default_flash_attn, gguf_file
from .base import Dialect, Launch, PoolState, ServeOptions, ServerKind, parse_prometheus, round_ctx

METRICS = ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
           "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total")


class LlamaServerOptions(ServeOptions):
    """``serve: {kind: llama-server}`` (or ``serve: llama-server``).

    ``ctx_size`` is ``--ctx-size``: KV cells the slots share (``--kv-unified``); None: the
    longest speed sequence, or ``parallel`` x the load sequence when that is more, rounded
    up to 256."""
    kind: Literal["llama-server"]


class LlamaDialect(Dialect):
    """llama-server's ``/v1/completions``: ``top_k``, ``repeat_penalty``, ``cache_prompt``
    and ``n_probs`` in the request; token ids in ``logprobs.content[].id`` (top-k in
    ``top_logprobs[]`` with ``id``), or a native ``/completion`` answer's ``tokens``."""
    name = "llama.cpp"
    owned_by = "llama"
    logprobs = True

    def extras(self, *, logprobs: int, cache_prompt: bool) -> dict:
        return {"top_k": 1, "repeat_penalty": 1.0, "cache_prompt": cache_prompt, "n_probs": int(logprobs)}

    def token_ids(self, chunk: dict) -> list[int]:
        if isinstance(chunk.get("tokens"), list):
            return [int(t) for t in chunk["tokens"]]
        out: list[int] = []
        for ch in chunk.get("choices") or []:
            content = (ch.get("logprobs") or {}).get("content")
            if isinstance(content, list):
                out += [int(e["id"]) for e in content if "id" in e]
        return out

    def topk(self, chunk: dict) -> list[list[tuple[int, float]]]:
        out = []
        for ch in chunk.get("choices") or []:
            content = (ch.get("logprobs") or {}).get("content")
            if isinstance(content, list):
                for e in content:
                    out.append([(int(t["id"]), float(t["logprob"])) for t in e.get("top_logprobs") or []])
        return out

    def answer_ids(self, post: Callable[[str, dict], dict], prompt_ids: Sequence[int], max_new_tokens: int,
                   ignore_stop: bool) -> list[int]:
        d = post("/completion", {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens,
                                 "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0, "cache_prompt": False,
                                 "return_tokens": True, "ignore_eos": ignore_stop})
        return [int(t) for t in d.get("tokens") or []]


class LlamaServer(ServerKind):
    """llama-server (see the module notes)."""
    kind = "llama-server"
    label = "llama-server"
    options: ClassVar[type[ServeOptions]] = LlamaServerOptions
    formats = ("gguf",)
    devices = ("cpu", "cuda")
    health_path = "/health"
    dialect = LlamaDialect()

    @classmethod
    def binary(cls) -> str:
        return str(tool_path("llama-server", log=lambda m: print(f"[qeval] {m}", flush=True)))

    @classmethod
    def context_tokens(cls, opts: ServeOptions, launch: Launch) -> int:
        """``--ctx-size``: the slots share one pool, so one deep speed prompt or
        ``parallel`` load streams must fit it."""
        seq = int(launch.tokens.get("sequence") or 2048)
        return opts.ctx_size or round_ctx(max(seq, launch.parallel * int(launch.tokens.get("load_sequence") or 0)))

    @classmethod
    def flash_attn(cls, launch: Launch) -> bool:
        """Flash attention as set: the tier's, else llama.cpp's default for the device and KV cache."""
        return default_flash_attn(launch.device, launch.kv_cache) if launch.flash_attn is None \
            else bool(launch.flash_attn)

    @classmethod
    def command(cls, binary: str, opts: ServeOptions, launch: Launch) -> list[str]:
        """llama-server on one GGUF file as qeval measures it: 127.0.0.1, ``threads`` for
        decode and batches, ``parallel`` slots sharing one KV pool of ``--ctx-size`` cells
        (``--kv-unified``), flash attention set explicitly, the int8 KV cache as ``q8_0`` K
        and V, every layer on the GPU for ``device="cuda"``, no prompt-cache RAM, no web
        UI, ``/metrics`` and ``/slots`` on, slot actions allowed (``--slot-save-path``)."""
        return llama_server_command(binary, gguf_file(launch.artifact), port=launch.port, threads=launch.threads,
                                    parallel=launch.parallel, ctx_size=cls.context_tokens(opts, launch),
                                    kv_cache=launch.kv_cache, flash_attn=cls.flash_attn(launch),
                                    device=launch.device, slot_dir=launch.scratch, args=opts.args)

    @classmethod
    def attention(cls, opts: ServeOptions, launch: Launch) -> dict:
        return {"flash_attn": cls.flash_attn(launch), "kv_cache_dtype": "q8_0" if launch.kv_cache == "int8" else "f16"}

    @classmethod
    def clear_pool(cls, http: Any, parallel: int) -> str:
        """``POST /slots/{id}?action=erase`` for every slot ``GET /slots`` lists."""
        r = http.get("/slots")
        if r.status_code != 200:
            raise RuntimeError(f"GET /slots answered HTTP {r.status_code}: {r.text[:200]}")
        for slot in r.json():
            e = http.post(f"/slots/{int(slot['id'])}", params={"action": "erase"})
            if e.status_code != 200:
                raise RuntimeError(f"POST /slots/{slot['id']}?action=erase answered HTTP {e.status_code}: "
                                   f"{e.text[:200]}")
        return "erase_slots"

    @classmethod
    def pool_state(cls, http: Any) -> PoolState:
        """``GET /slots`` (tokens each slot holds, slots processing) and ``GET /metrics``."""
        r = http.get("/slots")
        if r.status_code != 200:
            raise RuntimeError(f"GET /slots answered HTTP {r.status_code}: {r.text[:200]}")
        slots = r.json()
        held = {int(s["id"]): int(s.get("n_prompt_tokens") or 0) for s in slots}
        busy = [int(s["id"]) for s in slots if s.get("is_processing")]
        counters: dict[str, float] = {"slots_tokens": float(sum(held.values())), "slots_processing": float(len(busy))}
        m = http.get("/metrics")
        if m.status_code == 200:
            counters.update(parse_prometheus(m.text, METRICS))
        holding = {i: n for i, n in held.items() if n}
        why = "; ".join([f"slot {i} holds {n} tokens" for i, n in sorted(holding.items())]
                        + [f"slot {i} is processing" for i in busy])
        return PoolState(counters, not holding and not busy, why)


def llama_server_command(binary: str | Path, gguf: str | Path, *, port: int, threads: int, parallel: int,
                         ctx_size: int, kv_cache: str = "model", flash_attn: bool = False,
                         device: str = "cpu", slot_dir: str | Path | None = None,
                         args: Sequence[str] = ()) -> list[str]:
    """The llama-server command line (see :meth:`LlamaServer.command`); ``slot_dir``: the
    folder ``--slot-save-path`` names (slot actions, among them erase, need one)."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx_size),
           "--kv-unified", "-fa", "on" if flash_attn else "off", "-ngl", "999" if device == "cuda" else "0",
           "--cache-ram", "0", "--no-webui", "--no-context-shift", "--metrics", "--slots"]
    if slot_dir is not None:
        cmd += ["--slot-save-path", str(slot_dir)]
    if kv_cache == "int8":
        cmd += ["-ctk", "q8_0", "-ctv", "q8_0"]
    return cmd + [str(a) for a in args]


SERVER = LlamaServer
