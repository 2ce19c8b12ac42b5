"""Engine on llama.cpp through llama-cpp-python's low-level ctypes API, and GGUF helpers
(quantize with fallback accounting, tensor statistics).

Token ids come from the source model's Hugging Face tokenizer and go to llama.cpp as
they are: llama.cpp's own tokenizer differs from the HF one on some inputs, and every
tier must score the very same tokens.

The decode loop is written here (``llama_decode`` one token at a time, greedy argmax in
numpy) so each token's time is taken where it becomes known; ``Llama.generate`` was not
used because it hides the per-token timing and samples through its own sampler chain.

Settings that matter for the numbers:

* threads: ``n_threads`` and ``n_threads_batch`` both from the tier context.
* flash attention is set explicitly on or off (never llama.cpp's ``auto``) and reported as
  ``engine.flash_attn``. An int8 (``q8_0``) KV cache needs it. Default (``flash_attn:
  null``): on for every GGUF tier on CUDA, so a tier and its int8-KV twin differ in the
  cache only; on the CPU on only with the int8 KV cache (on the 2-core development CPU it
  slowed decode at depth 8000 from 13.6 to 3.7 tokens/s), and the table notes that such
  a pair differs in flash attention too.
* decoding is plain argmax over the logits (no sampler chain): the sampling defaults a
  converter copies from ``generation_config.json`` into the file (``general.sampling.*``:
  temperature, top-k/p, repeat penalty) are read only to be listed in
  ``engine.sampling["ignored_file_defaults"]``.
* ``device: cuda`` needs a llama-cpp-python build with GPU offload
  (``llama_supports_gpu_offload()``); a CPU build raises
  :class:`~qeval.errors.TierUnavailable` saying how to rebuild, instead of silently
  measuring the CPU.
* the context (and its KV cache, which llama.cpp allocates whole) is sized to the longest
  sequence seen so far, rounded up to 256 tokens, and recreated when a longer one comes,
  so peak memory at a depth reflects a cache sized for that depth.
* scoring reads logits only for the positions of the current window (at most ``n_batch``
  rows of ``vocab`` floats), never ``logits_all`` for the whole sequence.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import TierUnavailable
from ..failures import LLAMA_CPU_MARK
from .gguf_convert import llama_cpp_version
from ..osutil import stderr_fd_to
from .base import Capabilities, EngineOptions, Generation, MemoryInfo, greedy_loop
from . import ggml_cpu

# llama.cpp quantize types that refuse to run without an importance matrix
# (tools/quantize/quantize.cpp: "Please do not use IQ1_S, IQ1_M, IQ2_S, IQ2_XXS, IQ2_XS or
# Q2_K_S quantization without an importance matrix"). qeval computes no imatrix yet.
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_S", "IQ2_XXS", "IQ2_XS", "Q2_K_S")
K_QUANT_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"})
_CTX_ROUND = 256

_LOCK = threading.Lock()
_BACKEND_READY = False
_CAPTURE: list[str] | None = None
_LAST_LEVEL = 1


def _llama() -> Any:
    """``llama_cpp`` imported, ggml's backends loaded (the CPU variant this machine may run:
    :func:`qeval.engines.ggml_cpu.load_backends`), the backend initialised once, and qeval's
    log callback set (llama.cpp's info chatter off; errors to stderr; capture for quantize).

    Raises:
        RuntimeError: the build has CPU variant modules and none may run here.
    """
    global _BACKEND_READY, _LOG_CB
    import llama_cpp  # optional: the qeval[gguf] extra
    with _LOCK:
        if not _BACKEND_READY:
            _LOG_CB = _make_log_callback()
            llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))  # first: ggml logs the backend it loads
            sel = ggml_cpu.load_backends(Path(llama_cpp.__file__).resolve().parent)  # before llama.cpp's load_all
            # the stage's log names the kernels it runs: a stage killed by a signal is explained
            # from it (qeval.failures.signal_reason, LLAMA_CPU_MARK)
            print(f"{LLAMA_CPU_MARK}{sel.variant} ({sel.path or 'linked in'})"
                  + "".join(f"; passed over {x}" for x in sel.passed_over()), file=sys.stderr, flush=True)
            llama_cpp.llama_backend_init()
            _BACKEND_READY = True
    return llama_cpp


def _make_log_callback() -> Any:
    import llama_cpp  # optional: the qeval[gguf] extra

    @llama_cpp.llama_log_callback
    def cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - C callback
        global _LAST_LEVEL
        lvl = _LAST_LEVEL if level == 5 else level  # 5: continuation of the previous line
        _LAST_LEVEL = lvl
        s = text.decode("utf-8", "replace")
        if _CAPTURE is not None:
            _CAPTURE.append(s)
        elif lvl == 4 or os.environ.get("QEVAL_LLAMA_VERBOSE"):  # ggml: 1 debug 2 info 3 warn 4 error
            print(s, end="", file=sys.stderr, flush=True)
    return cb


_LOG_CB: Any = None  # the ctypes callback, kept alive for the life of the process


def cpu_backend() -> dict:
    """Which CPU kernels llama.cpp runs in this process: ``{"cpu_variant": "zen4" |
    "built-in", "instruction_sets": [...], "devices": [...], "variants": [...], ...}``
    (:func:`qeval.engines.ggml_cpu.describe`, after the backends are loaded)."""
    L = _llama()
    return ggml_cpu.describe(Path(L.__file__).resolve().parent)


def warm_runtime() -> dict:
    """Import llama-cpp-python and initialise llama.cpp's backends (what
    :class:`LlamaCppEngine` does first), without a model; the measure stage calls it before
    its memory baseline. Returns ``{"libraries": [...], "system_info": str}`` (llama.cpp's
    ``llama_print_system_info``) plus :func:`cpu_backend`'s keys (the CPU variant and the
    instruction sets that run)."""
    L = _llama()
    info = L.llama_print_system_info()
    return {"libraries": [f"llama_cpp {llama_cpp_version()}"],
            "system_info": info.decode("utf-8", "replace").strip() if isinstance(info, bytes) else str(info),
            **cpu_backend()}


# ---- ftypes and quantization -------------------------------------------------------------

def ftype_names() -> dict[str, int]:
    """llama.cpp file types by recipe name (``Q4_K_M`` -> ``LLAMA_FTYPE_MOSTLY_Q4_K_M``),
    from the installed llama-cpp-python; ``F32`` is ``LLAMA_FTYPE_ALL_F32``."""
    import llama_cpp  # optional: the qeval[gguf] extra
    out = {}
    for attr in dir(llama_cpp):
        for prefix in ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"):
            if attr.startswith(prefix):
                out[attr[len(prefix):]] = int(getattr(llama_cpp, attr))
    return dict(sorted(out.items()))


_FALLBACK = re.compile(r"^(?:warning:\s*)?(\S+)\s+- ncols\s+\d+ not divisible by\s+\d+ \(required for type\s+(\w+)\)"
                       r"\s+-> falling back to\s+(\w+)", re.M)


def quantize_gguf(src: str | Path, dst: str | Path, ftype: str | int, *, threads: int = 1) -> dict:
    """``llama_model_quantize`` from an F16/BF16/F32 GGUF to ``ftype`` (a name such as
    ``Q4_K_M`` or a ``LLAMA_FTYPE_*`` value).

    Writes ``<dst>.part`` and renames it when llama.cpp reports success; a failed run
    leaves no file behind (neither ``dst`` nor the partial file).

    Returns:
        ``{"seconds", "ftype", "fallback_tensors", "fallbacks", "fallback_names"}``:
        ``fallbacks`` maps ``"q4_K->q5_0"`` to a count, from llama.cpp's per-tensor
        warnings (rows not a multiple of the K-quant block of 256, for example).

    Raises:
        ValueError: unknown ftype name.
        RuntimeError: llama.cpp refused or failed (its error lines in the message).
    """
    global _CAPTURE
    llama_cpp = _llama()
    if isinstance(ftype, str):
        names = ftype_names()
        key = ftype.upper()
        if key not in names:
            raise ValueError(f"unknown llama.cpp file type {ftype!r} (valid: {', '.join(names)})")
        ftype_id = names[key]
    else:
        ftype_id = int(ftype)
    dst = Path(dst)
    part = dst.with_name(dst.name + ".part")
    part.unlink(missing_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_id
    params.nthread = max(1, int(threads))
    lines: list[str] = []
    t0 = time.time()
    ok = False
    try:
        # llama.cpp reports through its log callback and, for the per-tensor fallback
        # warnings, straight to stderr: capture both (fd 2 redirected for the call).
        with _LOCK:
            _CAPTURE = lines
        with tempfile.TemporaryFile() as err:
            try:
                with stderr_fd_to(err.fileno()):
                    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
            finally:
                with _LOCK:
                    _CAPTURE = None
            err.seek(0)
            lines.append(err.read().decode("utf-8", "replace"))
        log = "".join(lines)
        if rc != 0 or not part.is_file():
            errs = [ln.strip() for ln in log.splitlines()
                    if re.search(r"error|failed|invalid|requires|please", ln, re.I)]
            raise RuntimeError(f"llama.cpp quantize to {ftype} failed (code {rc}): "
                               + (" | ".join(errs[-4:]) or "no error message"))
        os.replace(part, dst)
        ok = True
    finally:
        if not ok:
            part.unlink(missing_ok=True)
    fb = {name: (want, got) for name, want, got in _FALLBACK.findall(log)}  # one entry per tensor
    counts = collections.Counter(f"{want}->{got}" for want, got in fb.values())
    return {"seconds": time.time() - t0, "ftype": ftype_id, "fallback_tensors": len(fb),
            "fallbacks": dict(sorted(counts.items())), "fallback_names": list(fb)}


def gguf_tensor_stats(path: str | Path) -> dict:
    """Storage figures of a GGUF file, read with the PyPI ``gguf`` package's reader.

    Returns:
        ``stored_bytes`` (tensor data bytes), ``parameters`` (elements of all tensors; a
        tied output shares ``token_embd``), ``bits_per_weight`` (stored bits / parameters),
        ``bits_per_weight_quantized`` (the same over 2-D weight tensors only, leaving out
        F32 norms and biases), ``tensor_types`` (type name -> tensor count),
        ``tensor_type_bytes``, ``non_kquant_matrices`` (2-D tensors outside the K-quant
        family Q2_K..Q8_K), ``file_bytes`` and the GGUF ``file_type``.
    """
    from gguf import GGUFReader  # start-up time: only GGUF paths read GGUF files

    r = GGUFReader(str(path))
    types: collections.Counter = collections.Counter()
    tbytes: collections.Counter = collections.Counter()
    nb = ne = mb = me = 0
    non_k = 0
    for t in r.tensors:
        name = t.tensor_type.name
        types[name] += 1
        b, n = int(t.n_bytes), int(t.n_elements)
        tbytes[name] += b
        nb += b
        ne += n
        if sum(1 for d in t.shape if int(d) > 1) >= 2:
            mb += b
            me += n
            if name not in K_QUANT_TYPES:
                non_k += 1
    ft = r.fields.get("general.file_type")
    file_type = int(ft.parts[ft.data[0]][0]) if ft is not None else None
    del r
    return {"stored_bytes": nb, "parameters": ne, "bits_per_weight": 8 * nb / ne if ne else None,
            "bits_per_weight_quantized": 8 * mb / me if me else None,
            "tensor_types": dict(sorted(types.items())), "tensor_type_bytes": dict(sorted(tbytes.items())),
            "non_kquant_matrices": non_k, "tensors": sum(types.values()),
            "file_bytes": Path(path).stat().st_size, "file_type": file_type}


def gguf_file(path: str | Path) -> Path:
    """``path`` when it is a file, else the single ``*.gguf`` file in the folder ``path``.

    Raises:
        RuntimeError: the folder does not hold exactly one GGUF file.
    """
    p = Path(path)
    if p.is_file():
        return p
    files = sorted(p.glob("*.gguf"))
    if len(files) != 1:
        raise RuntimeError(f"artifact {p} holds {len(files)} .gguf files, expected 1")
    return files[0]


def kv_type_bytes(ggml_type: int) -> float:
    """Bytes per element of a ggml type (``Q8_0``: 34/32) from the gguf package's table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # start-up time: only GGUF paths read GGUF files
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    return size / block


# ---- the engine ------------------------------------------------------------------------

REBUILD_HINT = ("rebuild llama-cpp-python with CUDA: `make setup CUDA=1 CUDA_ARCHS=<compute capability, e.g. 90>` "
                "(or CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir llama-cpp-python), "
                "or set device: cpu")


def require_gpu_offload(what: str = "this GGUF tier") -> None:
    """Raise unless the installed llama-cpp-python can offload layers to a GPU.

    Raises:
        TierUnavailable: a CPU-only build (``llama_supports_gpu_offload()`` is false), in one
            line naming the rebuild command.
    """
    L = _llama()
    if not bool(L.llama_supports_gpu_offload()):
        raise TierUnavailable(f"device cuda: this llama-cpp-python build has no GPU offload "
                              f"(llama_supports_gpu_offload() is false), so {what} would run on the CPU; "
                              + REBUILD_HINT)


def default_flash_attn(device: str, kv_cache: str) -> bool:
    """Flash attention when the recipe leaves ``flash_attn`` unset: on for every tier on
    CUDA (a tier and its int8-KV twin then differ in the cache only); on the CPU only
    with the int8 (q8_0) KV cache, which needs it (module notes)."""
    return True if device == "cuda" else kv_cache == "int8"


SAMPLING_KEYS = ("general.sampling.temp", "general.sampling.top_k", "general.sampling.top_p",
                 "general.sampling.min_p", "general.sampling.penalty_repeat", "general.sampling.penalty_last_n",
                 "general.sampling.mirostat", "general.sampling.sequence")

class LlamaCppEngine:
    """Engine over a GGUF file on llama.cpp.

    Args:
        path: the GGUF file.
        threads: ``n_threads`` and ``n_threads_batch``.
        kv_cache: "model" (F16 K and V) or "int8" (``q8_0`` K and V; needs flash attention).
        flash_attn: True/False, or None for "on only with the int8 KV cache".
        device: "cpu" or "cuda" (every layer offloaded to the first visible GPU, no split
            across GPUs; the build must support it).
        n_ctx: the smallest context to create (grown on demand).
        n_batch: tokens per ``llama_decode`` call (and logits rows per scoring window).

    Raises:
        ValueError: int8 KV cache with flash attention off.
        TierUnavailable: ``device="cuda"`` on a llama-cpp-python build without GPU offload.
        RuntimeError: llama.cpp cannot load the file.
    """

    name = "llamacpp"
    formats = ("gguf",)
    decode_mode = None  # one decode loop: no modes (transformers' eager/static)
    decode_note = None
    kv_requant_period = None  # the q8_0 cache is quantized per token, never re-quantized
    capabilities = Capabilities(score=True, generate=True, batch=True, memory_counter="process", kv_bytes=True,
                                lm_eval=False, scored_generate=True)

    @classmethod
    def warm_runtime(cls, source_path: str, options: EngineOptions) -> dict:
        """llama-cpp-python imported and llama.cpp's backends initialised, no model
        (:func:`warm_runtime`); ``source_path`` and ``options`` are not needed."""
        return warm_runtime()

    @classmethod
    def open(cls, fmt: str, path: Path, options: EngineOptions) -> "LlamaCppEngine":
        """A GGUF file, or a folder holding exactly one (``fmt`` ``gguf``), with the
        options' threads, KV cache, flash attention and device.

        Raises:
            ValueError: another format.
            RuntimeError: not exactly one GGUF file in the folder, or llama.cpp cannot load it.
        """
        if fmt not in cls.formats:
            raise ValueError(f"the {cls.name} engine opens {', '.join(cls.formats)} artifacts, not {fmt!r}")
        return cls(gguf_file(path), threads=options.threads, kv_cache=options.kv_cache,
                   flash_attn=options.flash_attn, device=options.device)

    def __init__(self, path: str | Path, *, threads: int = 1, kv_cache: str = "model",
                 flash_attn: bool | None = None, device: str = "cpu", n_ctx: int = 512,
                 n_batch: int = 512) -> None:
        L = _llama()
        self._L = L
        self.path = str(path)
        self.threads = max(1, int(threads))
        self.kv_cache = kv_cache
        self.flash_attn = default_flash_attn(device, kv_cache) if flash_attn is None else bool(flash_attn)
        self.flash_attn_source = "default" if flash_attn is None else "recipe"
        if kv_cache == "int8" and not self.flash_attn:
            raise ValueError("llama.cpp's q8_0 (int8) KV cache needs flash attention; set flash_attn true or null")
        if kv_cache not in ("model", "int8"):
            raise ValueError(f"kv_cache {kv_cache!r}: expected 'model' or 'int8'")
        if device == "cuda":
            require_gpu_offload()
        self.type_kv = L.GGML_TYPE_Q8_0 if kv_cache == "int8" else L.GGML_TYPE_F16
        offload = device == "cuda"
        self.device = "cuda" if offload else "cpu"
        self.backend = f"llama.cpp-{self.device}"
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = -1 if offload else 0
        if offload:  # one GPU, the first visible one (the one NVML measures), not a split over all
            mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
            mp.main_gpu = 0
        self._model = L.llama_model_load_from_file(self.path.encode(), mp)
        if not self._model:
            raise RuntimeError(f"llama.cpp cannot load {self.path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self._model))
        self.n_batch = int(n_batch)
        self._min_ctx = max(int(n_ctx), _CTX_ROUND)
        self._ctx = None
        self._batch = None
        self.n_ctx = 0
        self.last_cache_bytes: int | None = None
        self.last_cache_allocated_bytes: int | None = None
        self.last_cache_tokens: int | None = None
        self.last_state_bytes: int | None = None
        self.last_perf: dict | None = None
        ignored = {k.split(".")[-1]: v for k in SAMPLING_KEYS if (v := self._meta(k)) is not None}
        self.sampling = {"decode": "argmax", "ignored_file_defaults": ignored}

    # -- context -------------------------------------------------------------------------
    def _ensure_ctx(self, n_tokens: int) -> Any:
        """A context holding at least ``n_tokens``, its cache cleared."""
        L = self._L
        if self._ctx is None or n_tokens > self.n_ctx:
            self._free_ctx()
            n = max(self._min_ctx, -(-int(n_tokens) // _CTX_ROUND) * _CTX_ROUND)
            cp = L.llama_context_default_params()
            cp.n_ctx = n
            cp.n_batch = cp.n_ubatch = self.n_batch
            cp.n_seq_max = 1
            cp.n_threads = cp.n_threads_batch = self.threads
            cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                  else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            cp.type_k = cp.type_v = self.type_kv
            cp.no_perf = False
            cp.embeddings = False
            ctx = L.llama_init_from_model(self._model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp cannot create a context of {n} tokens "
                                   f"(flash_attn={self.flash_attn}, kv_cache={self.kv_cache})")
            self._ctx = ctx
            self.n_ctx = int(L.llama_n_ctx(ctx))
            self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        L.llama_memory_clear(L.llama_get_memory(self._ctx), True)
        self._cached_prompt = None
        return self._ctx

    def _free_ctx(self) -> None:
        L = self._L
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        self.n_ctx = 0

    def _decode(self, ids: Sequence[int], pos0: int, logits: str) -> None:
        """One ``llama_decode`` of ``ids`` at positions ``pos0..``; ``logits`` is "all",
        "last" or "none" (which rows llama.cpp computes and keeps)."""
        b = self._batch
        n = len(ids)
        b.n_tokens = n
        for i, t in enumerate(ids):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = logits == "all" or (logits == "last" and i == n - 1)
        rc = self._L.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} at position {pos0} ({n} tokens, n_ctx {self.n_ctx})")

    def _last_logits(self) -> np.ndarray:
        ptr = self._L.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))

    def _chunk_logprobs(self, n: int, m: int) -> np.ndarray:
        """Log-softmax (float32, natural log) of the first ``m`` of the ``n`` logit rows the
        last ``llama_decode`` kept: shape ``[m, vocab]``."""
        ptr = self._L.llama_get_logits(self._ctx)
        x = np.ctypeslib.as_array(ptr, shape=(n, self.vocab_size))[:m].astype(np.float32, copy=True)
        x -= x.max(axis=1, keepdims=True)
        x -= np.log(np.exp(x).sum(axis=1, keepdims=True, dtype=np.float32))
        return x

    def _check_ids(self, ids: Sequence[int]) -> None:
        if len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token id out of range for this GGUF's vocabulary of {self.vocab_size}")

    # -- Engine API ----------------------------------------------------------------------
    def iter_logprobs(self, token_ids: Sequence[int], window: int = 256,
                      first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """See :meth:`qeval.engines.base.Engine.iter_logprobs`. Positions before ``first``
        only fill the cache (no logits computed); from ``first`` on the sequence is
        evaluated in chunks of ``min(window, n_batch)`` tokens on the same cache, only the
        chunk's logits are read, and log-softmax runs in float32."""
        ids = [int(t) for t in token_ids]
        self._check_ids(ids)
        n = len(ids)
        first = max(0, int(first))
        if n < 2 or first >= n - 1:
            return
        self._ensure_ctx(n)
        for s in range(0, first, self.n_batch):
            self._decode(ids[s:min(s + self.n_batch, first)], s, "none")
        step = max(1, min(int(window), self.n_batch))
        for start in range(first, n - 1, step):
            chunk = ids[start:start + step]
            m = min(len(chunk), n - 1 - start)
            self._decode(chunk, start, "all")
            yield start, self._chunk_logprobs(len(chunk), m)

    def generate_scored(self, prompt_ids: Sequence[int], score_start: int, score_end: int, max_new_tokens: int, *,
                        stop_ids: Sequence[int] = (), window: int = 256) -> tuple[Generation, list]:
        """See :meth:`qeval.engines.hf.HFEngine.generate_scored`: one chunked prefill that
        yields the rows ``iter_logprobs(prompt_ids[:score_end], window, score_start - 1)``
        gives, the rest of the prompt on the same cache, then greedy decoding."""
        ids = [int(t) for t in prompt_ids]
        self._check_ids(ids)
        n = len(ids)
        first = score_start - 1
        if not 0 <= first < score_end - 1 < n:
            raise ValueError(f"score range {score_start}..{score_end} must lie inside the {n}-token prompt")
        self._ensure_ctx(n + max_new_tokens)
        rows: list = []
        state = {"pos": n}

        def prefill() -> int:
            for s in range(0, first, self.n_batch):
                self._decode(ids[s:min(s + self.n_batch, first)], s, "none")
            step = max(1, min(int(window), self.n_batch))
            done = first  # the prompt tokens in the cache
            for start in range(first, score_end - 1, step):
                chunk = ids[start:min(start + step, score_end)]
                m = min(len(chunk), score_end - 1 - start)
                self._decode(chunk, start, "all")
                rows.append((start - first, self._chunk_logprobs(len(chunk), m)))
                done = start + len(chunk)
            if done == n:  # the last scored chunk ended the prompt: its last row is the next token's
                return int(np.argmax(self._last_logits()))
            # from where the scored chunks stopped: a scored span of whole windows ends one
            # token short of score_end (llama.cpp refuses the gap: positions must be consecutive)
            for s in range(done, n, self.n_batch):
                chunk = ids[s:s + self.n_batch]
                self._decode(chunk, s, "last" if s + len(chunk) == n else "none")
            return int(np.argmax(self._last_logits()))

        def step(tok: int) -> int:
            self._decode([tok], state["pos"], "last")
            state["pos"] += 1
            return int(np.argmax(self._last_logits()))

        return greedy_loop(prefill, step, max_new_tokens, stop_ids), rows

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), ignore_stop: bool = False) -> Generation:
        """Greedy decoding with per-token timings (seconds since the call): the prompt in
        ``n_batch`` chunks, then one ``llama_decode`` per new token. Sets
        ``last_cache_bytes`` (KV bytes held for the tokens in the cache),
        ``last_cache_allocated_bytes`` (the K and V buffers of the whole context),
        ``last_cache_tokens`` and ``last_perf`` (llama.cpp's own prompt/eval timings)."""
        L = self._L
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("generate needs at least one prompt token")
        self._check_ids(ids)
        ctx = self._ensure_ctx(len(ids) + max_new_tokens)
        L.llama_perf_context_reset(ctx)
        state = {"pos": len(ids)}

        def prefill() -> int:
            for s in range(0, len(ids), self.n_batch):
                chunk = ids[s:s + self.n_batch]
                self._decode(chunk, s, "last" if s + len(chunk) == len(ids) else "none")
            return int(np.argmax(self._last_logits()))

        def step(tok: int) -> int:
            self._decode([tok], state["pos"], "last")
            state["pos"] += 1
            return int(np.argmax(self._last_logits()))

        gen = greedy_loop(prefill, step, max_new_tokens, stop_ids, ignore_stop)
        self._cached_prompt = ids  # decode_again may cut the cache back to it
        pos = state["pos"]
        L.llama_synchronize(ctx)
        pc = L.llama_perf_context(ctx)
        self.last_perf = {"t_p_eval_ms": pc.t_p_eval_ms, "n_p_eval": pc.n_p_eval,
                          "t_eval_ms": pc.t_eval_ms, "n_eval": pc.n_eval}
        self.last_cache_tokens = pos
        self.last_cache_bytes = int(round(self.kv_bytes_per_token_analytic() * pos))
        # llama.cpp allocates (and clears) the K and V buffers for the whole context
        self.last_cache_allocated_bytes = int(round(self.kv_bytes_per_token_analytic() * self.n_ctx))
        # llama.cpp's own count (K/V rows + ~12 bytes of cell metadata per token + header)
        self.last_state_bytes = int(L.llama_state_seq_get_size(ctx, 0))
        return gen

    def decode_again(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation | None:
        """Decode ``max_new_tokens`` after ``prompt_ids`` again without prefilling it: the
        cache left by the last :meth:`generate` of the same prompt is cut back to
        ``len(prompt_ids) - 1`` tokens (``llama_memory_seq_rm``), the last prompt token is
        fed again, then the same greedy loop (stop tokens ignored). Its ``prefill_s`` is one
        token's time, not a TTFT. None when the cache does not hold that prompt."""
        L = self._L
        ids = [int(t) for t in prompt_ids]
        if self._ctx is None or not ids or getattr(self, "_cached_prompt", None) != ids:
            return None
        ctx = self._ctx
        L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, len(ids) - 1, -1)
        state = {"pos": len(ids)}

        def prefill() -> int:
            self._decode(ids[-1:], len(ids) - 1, "last")
            return int(np.argmax(self._last_logits()))

        def step(tok: int) -> int:
            self._decode([tok], state["pos"], "last")
            state["pos"] += 1
            return int(np.argmax(self._last_logits()))

        gen = greedy_loop(prefill, step, max_new_tokens, (), True)
        L.llama_synchronize(ctx)
        return gen

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       stop_ids: Sequence[int] = (), pad_id: int = 0) -> list[tuple[list[int], bool]]:
        """Greedy answers to several prompts at once (quality only: no timings), with the
        same tokens as :meth:`generate` on each prompt alone.

        One context with a sequence per prompt (``n_seq_max`` = the prompts, llama.cpp's
        default non-unified KV cache: each sequence its own cells); every prompt prefilled
        alone in ``n_batch`` chunks, as :meth:`generate` does; then one ``llama_decode``
        per step holding the next token of every sequence still answering (the
        multi-sequence loop of :mod:`qeval.engines.llamacpp_load`, which llama.cpp's server
        runs too). A sequence stops at a stop token or ``max_new_tokens``. ``pad_id`` is
        not used (nothing is padded).

        Returns:
            per prompt ``(new token ids up to and including the stop token, finished)``.

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
            RuntimeError: llama.cpp refuses the context or a decode.
        """
        L = self._L
        ps = [[int(t) for t in p] for p in prompts]
        if not ps:
            return []
        for p in ps:
            if not p:
                raise ValueError("generate_batch needs at least one token per prompt")
            self._check_ids(p)
        n_seq = len(ps)
        n_ctx_seq = -(-(max(len(p) for p in ps) + max_new_tokens) // _CTX_ROUND) * _CTX_ROUND
        n_batch = max(self.n_batch, n_seq)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx_seq * n_seq
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.type_k = cp.type_v = self.type_kv
        cp.kv_unified = False
        cp.embeddings = False
        ctx = L.llama_init_from_model(self._model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp cannot create a context of {n_seq} sequences x {n_ctx_seq} tokens")
        batch = L.llama_batch_init(n_batch, 0, 1)
        stop = {int(t) for t in stop_ids}
        out: list[list[int]] = [[] for _ in ps]
        done = [False] * n_seq
        pos = [len(p) for p in ps]

        def put(i: int, tok: int, at: int, seq: int, logits: bool) -> None:
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, at, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits

        def decode(n: int) -> None:
            batch.n_tokens = n
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, {n_seq} sequences)")

        try:
            for q, p in enumerate(ps):
                for s0 in range(0, len(p), self.n_batch):
                    chunk = p[s0:s0 + self.n_batch]
                    for j, t in enumerate(chunk):
                        put(j, t, s0 + j, q, s0 + j == len(p) - 1)
                    decode(len(chunk))
                tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.vocab_size,))))
                out[q].append(tok)
                done[q] = tok in stop or max_new_tokens <= 1
            while True:
                live = [q for q in range(n_seq) if not done[q]]
                if not live:
                    break
                for j, q in enumerate(live):
                    put(j, out[q][-1], pos[q], q, True)
                    pos[q] += 1
                decode(len(live))
                rows = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(live), self.vocab_size))
                for q, tok in zip(live, rows.argmax(axis=1).tolist()):
                    out[q].append(int(tok))
                    done[q] = int(tok) in stop or len(out[q]) >= max_new_tokens
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        return [(o, bool(o and o[-1] in stop)) for o in out]

    def attention_info(self, prompt_ids: Sequence[int] | None = None) -> dict:
        """The attention path of this engine's contexts: llama.cpp's flash-attention type is
        set explicitly (enabled or disabled, never ``auto``), and K and V use ``type_kv``.

        Returns:
            ``{"engine": "llama.cpp", "implementation": "flash" | "standard",
            "flash_attn": bool, "kv_cache_dtype": "f16" | "q8_0", "kv_type_k", "kv_type_v"}``.
        """
        from gguf.constants import GGMLQuantizationType  # start-up time: only GGUF paths read GGUF files
        name = GGMLQuantizationType(int(self.type_kv)).name.lower()
        return {"engine": "llama.cpp", "implementation": "flash" if self.flash_attn else "standard",
                "flash_attn": bool(self.flash_attn), "kv_cache_dtype": name, "kv_type_k": name, "kv_type_v": name}

    # -- memory --------------------------------------------------------------------------
    def kv_bytes_per_token_analytic(self) -> float:
        """n_layer x n_head_kv x (head_dim_k + head_dim_v) x bytes per element of the cache
        type: the bytes one token's K and V rows occupy in llama.cpp's cache buffer."""
        L = self._L
        n_layer = int(L.llama_model_n_layer(self._model))
        n_head = int(L.llama_model_n_head(self._model))
        n_head_kv = int(L.llama_model_n_head_kv(self._model))
        n_embd = int(L.llama_model_n_embd(self._model))
        arch = self._meta("general.architecture") or "llama"
        dk = int(self._meta(f"{arch}.attention.key_length") or n_embd // n_head)
        dv = int(self._meta(f"{arch}.attention.value_length") or n_embd // n_head)
        return n_layer * n_head_kv * (dk + dv) * kv_type_bytes(self.type_kv)

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def kv_bytes_per_token(self, depth: int = 256) -> float:
        """Measured: the growth of llama.cpp's serialized sequence state
        (``llama_state_seq_get_size``: K and V rows plus a few bytes of cell metadata per
        token) between ``depth/2`` and ``depth`` cached tokens, divided by the tokens added."""
        L = self._L
        depth = max(int(depth), 4)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, self.vocab_size, size=depth).tolist()
        sizes = []
        for n in (depth // 2, depth):
            self._ensure_ctx(depth)
            for s in range(0, n, self.n_batch):
                self._decode(ids[s:min(s + self.n_batch, n)], s, "none" if s + self.n_batch < n else "last")
            L.llama_synchronize(self._ctx)
            sizes.append(int(L.llama_state_seq_get_size(self._ctx, 0)))
        return (sizes[1] - sizes[0]) / (depth - depth // 2)

    def weight_bytes(self) -> int:
        """Tensor data bytes of the loaded model (``llama_model_size``; equal to the GGUF
        file's tensor bytes, :func:`gguf_tensor_stats` ``stored_bytes``)."""
        return int(self._L.llama_model_size(self._model))

    def memory(self) -> MemoryInfo:
        """Weight bytes = GGUF tensor data bytes; KV bytes per token measured from the
        state size (the analytic figure in ``details``)."""
        return MemoryInfo(self.weight_bytes(), self.kv_bytes_per_token(256), self.device,
                          {"backend": self.backend, "kv_cache": self.kv_cache, "flash_attn": self.flash_attn,
                           "kv_bytes_per_token_analytic": self.kv_bytes_per_token_analytic(),
                           "parameters": int(self._L.llama_model_n_params(self._model)), "n_ctx": self.n_ctx})

    def open_core(self, spec: Any, clock: Any) -> Any:
        """The serving core for one workload run (:class:`qeval.engines.llamacpp_core.LlamaCore`:
        a context of ``spec.slots`` sequences with continuous batching).

        Raises:
            NotAdmitted: as :class:`~qeval.engines.llamacpp_core.LlamaCore`."""
        from .llamacpp_core import LlamaCore  # start-up time: only load stages serve batches
        return LlamaCore(self, spec, clock)

    def prefix_how(self) -> str:
        """How the core reuses a shared prefix, one line for the load section."""
        return "prefix prefilled once into its own sequence, copied into each request's (llama_memory_seq_cp)"

    def close(self) -> None:
        self._free_ctx()
        if getattr(self, "_model", None):
            self._L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


ENGINE = LlamaCppEngine
